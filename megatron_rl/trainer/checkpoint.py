"""Atomic training checkpoints: model, distributed optimizer, scheduler, step, RNG, extras.

Layout under the checkpoint directory:
    step_00000012/        dist/ (megatron dist_checkpointing; the distributed optimizer in
                          megatron's `dp_reshardable` format), rng/rank00000.pt, meta.json
    step_00000013.partial a save in progress (or interrupted): never read
    step_00000011.replaced  the old step 11 while a redone step 11 takes its place (atomic_dir.py)
    latest                the name of the newest complete step directory (replaced atomically)

A save writes `step_N.partial`, then rank 0 renames it to `step_N` and only then points
`latest` at it, so an interrupted save leaves the previous checkpoint current and readable
(tests/e2e/test_restart.py kills the processes at each of these points).

The optimizer format: `dp_reshardable` writes and reads each rank's own optimizer shard in
parallel, with no exchange, where `fully_reshardable` (the format of checkpoints whose meta.json
names none) all-gathers the whole DP group's optimizer state onto every rank at a save and reads
all of it on every rank at a load (DP x the rank's share of host memory;
tests/distributed/test_checkpoint.py compares both, docs/gpu/review.md has the figures).
`dp_reshardable` reshards over DP only, so a checkpoint resumes at the TP, PP, EP and CP it was
written with (checked at load, naming the layouts); the model part still reshards to any layout,
which is what policy snapshots and `load_backbone` use. A checkpoint written in another format
(meta.json says which) loads in it.
Adam's step count is written to meta.json and set again after a load: megatron's
`dp_reshardable` load puts back torch Adam's per-parameter `step` tensors as they were when the
loading template was built (its step is a local, non-persistent entry), i.e. the fresh
optimizer's, so without it a resumed run's bias correction would restart.
RNG: the CPU generator, megatron's tracker, and with CUDA the default CUDA generator.

Model transforms (`transforms=`, the role's; transforms/base.py): each keeps its entry in
meta.json (`checkpoint_meta`, under its name) and says which model-state entries a checkpoint
holds (`keeps`). A LoRA role's `dist/` holds the trainable tensors only (adapters, and a critic's
value head) besides the optimizer, and meta.json's `lora` the settings and the base model's
identity (transforms/lora_base.py); the frozen base is not written. A load first asks every
transform whether the checkpoint resumes (`transforms.plan.check_saved_transforms`: the LoRA base
and settings; a LoRA checkpoint in a run without LoRA is refused), then loads the kept entries into
the model whose base the config already loaded. Without transforms that keep less (full
fine-tuning) the checkpoint holds the whole model, as ever; a LoRA run also resumes such a
checkpoint (LoRA checkpoints written before adapters-only ones) with every tensor.
"""

from __future__ import annotations

import json
from pathlib import Path

import megatron_rl.compat  # noqa: F401  (megatron-core on CPU needs its patches first)

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, tensor_parallel
from megatron.core import parallel_state as ps

from megatron_rl.conversion.spec_keys import EXTRA_STATE, checkpoint_keys, plan_load
from megatron_rl.trainer import atomic_dir
from megatron_rl.trainer.optimizer import (
    Trainable,
    adam_step,
    hybrid_optimizers,
    set_adam_steps,
    torch_optimizers,
    unify_adam_steps,
)
from megatron_rl.transforms.base import ModelTransform
from megatron_rl.transforms.plan import check_saved_transforms

OPTIMIZER_FORMAT = "dp_reshardable"
LEGACY_OPTIMIZER_FORMAT = "fully_reshardable"  # checkpoints whose meta.json names no format


def _step_dir(root: Path, step: int) -> Path:
    return root / atomic_dir.name("step", step)


def _cuda_present() -> bool:
    return torch.cuda.is_available()


def _rng_state() -> dict:
    """The CPU generator, megatron's RNG tracker (its own CUDA states: dropout forks, TP-aware
    init) and, with CUDA, the default CUDA generator of this rank's device, which the tracker
    does not hold (anything drawn with torch's default generator on the device)."""
    state = {"torch": torch.get_rng_state(), "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if _cuda_present():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and _cuda_present():  # absent in checkpoints written without CUDA (or before)
        torch.cuda.set_rng_state(state["cuda"])


def _layout() -> dict[str, int]:
    """The parallel sizes a `dp_reshardable` optimizer state is tied to (and DP, for the record)."""
    return {
        "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "ep": ps.get_expert_model_parallel_world_size(),
        "cp": ps.get_context_parallel_world_size(),
        "dp": ps.get_data_parallel_world_size(),
    }


def _check_layout(path: Path, meta: dict) -> None:
    saved, current = meta.get("layout"), _layout()
    if meta.get("optimizer_format", LEGACY_OPTIMIZER_FORMAT) != "dp_reshardable" or saved is None:
        return
    differ = [k for k in ("tp", "pp", "ep", "cp") if saved[k] != current[k]]
    if differ:
        raise ValueError(
            f"{path}: written at " + ", ".join(f"{k} {saved[k]}" for k in differ) + ", this run has "
            + ", ".join(f"{k} {current[k]}" for k in differ) + "; its optimizer state (megatron's "
            "dp_reshardable format) resumes only at the layout it was written with (DP may change). "
            "To start this layout from its weights alone, load them as a backbone (value.model.checkpoint) "
            "or convert them"
        )  # fmt: skip


def _check_layer_spec(path: Path, model_state: dict) -> None:
    """A training checkpoint resumes with the layer spec (TransformerEngine or local) it was written
    with: the other spec names some weights differently (conversion/spec_keys.py) and its optimizer
    state is laid out by parameter order, which the specs do not share. Weights alone load across
    specs (trainer.weights.load_backbone), so the error says how."""
    saved = checkpoint_keys(path / "dist")
    plan = plan_load(model_state, saved)
    requested = {getattr(entry, "key", None) for entry in model_state.values()}
    # TE's modules save `_extra_state` objects the local spec's do not ask for.
    unasked = sorted(k for k in saved if k.endswith(EXTRA_STATE) and k not in requested)
    if plan.renamed or plan.left_out or unasked:
        differing = sorted(plan.renamed.values()) + sorted(plan.left_out) + unasked
        raise ValueError(
            f"{path}: written with the other layer spec (TransformerEngine vs megatron's local spec: "
            f"{len(differing)} keys differ, e.g. {differing[0]}); a training checkpoint resumes only with the "
            f"spec it was written with (same TE availability and CP = 1 vs > 1). To start from its weights, "
            f"set model.checkpoint (or value.model.checkpoint) to {path / 'dist'}: weights load across specs"
        )


def _optimizer_state(trainable: Trainable, model_state: dict, sharding: str, is_loading: bool = False) -> dict:
    metadata = {"distrib_optim_sharding_type": sharding}
    return trainable.optimizer.sharded_state_dict(model_state, is_loading=is_loading, metadata=metadata)


def load_rng_file(path: Path) -> dict:
    """A rank's RNG state: tensors in dicts only (`weights_only=True`: a checkpoint from someone
    else never runs code here)."""
    try:
        return torch.load(path, weights_only=True)
    except Exception as exc:
        raise ValueError(f"{path}: not a plain-tensor RNG state, refusing to load it ({exc})") from exc


def _kept(key: str, transforms: list[ModelTransform]) -> bool:
    return all(transform.keeps(key) for transform in transforms)


def _kept_part(model, model_state: dict, transforms: list[ModelTransform]) -> dict:
    """The model's sharded state dict restricted to what the transforms keep (a LoRA model's
    adapters and value head); refuses a model with a trainable parameter outside it (its state
    would be lost)."""
    lost = sorted(n for n, p in model.named_parameters() if p.requires_grad and not _kept(n, transforms))
    if lost:
        names = ", ".join(t.name for t in transforms)
        raise RuntimeError(f"checkpoint ({names}): trainable parameters it would not keep: {lost[:3]}")
    return {k: v for k, v in model_state.items() if _kept(k, transforms)}


def save_checkpoint(
    directory: str | Path,
    step: int,
    trainable: Trainable,
    extra: dict | None = None,
    keep_last: int = 2,
    transforms: list[ModelTransform] = (),
) -> Path:
    """Collective: every rank of the model calls it. Returns the complete step directory. With
    `transforms` that keep an entry in meta.json, the model state they keep (a LoRA role's: its
    trainable tensors only) and their entries."""

    final = _step_dir(Path(directory), step)
    meta = {
        "step": step,
        "world_size": dist.get_world_size(),
        "layout": _layout(),
        "optimizer_format": OPTIMIZER_FORMAT,
        "scheduler": trainable.scheduler.state_dict(),
        "extra": extra or {},
    }
    saved_by = [t for t in transforms if t.checkpoint_meta() is not None]
    meta.update({t.name: t.checkpoint_meta() for t in saved_by})

    def finish(partial: Path) -> None:  # rank 0, after every rank wrote its shards
        meta["adam_step"] = adam_step(trainable)
        (partial / "meta.json").write_text(json.dumps(meta, indent=2))

    with atomic_dir.collective_write(
        final.parent, final.name, keep_last, "checkpoint.written", finish, subdirs=("dist", "rng")
    ) as partial:
        unify_adam_steps(trainable)  # one step count per optimizer, as megatron checkpoints it
        model = trainable.model[0].module
        model_state = model.sharded_state_dict()
        saved_model = _kept_part(model, model_state, saved_by) if saved_by else model_state
        state = {"model": saved_model, "optimizer": _optimizer_state(trainable, model_state, OPTIMIZER_FORMAT)}
        dist_checkpointing.save(state, str(partial / "dist"))
        torch.save(_rng_state(), partial / "rng" / f"rank{dist.get_rank():05d}.pt")
    return final


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The newest complete step directory, or None when there is none."""
    return atomic_dir.latest(Path(directory), "meta.json")


def group_settings(trainable: Trainable) -> list[list[dict]]:
    """Every optimizer parameter group's settings (all but its parameters and step count)."""
    return [
        [{k: v for k, v in group.items() if k not in ("params", "step")} for group in opt.param_groups]
        for opt in torch_optimizers(trainable.optimizer)
    ]


def restore_group_settings(trainable: Trainable, settings: list[list[dict]]) -> None:
    """Puts back each group's own settings after megatron's optimizer `load_state_dict`, which
    matches saved groups to current ones only by (wd_mult, lr_mult, is_expert_parallel,
    is_decoupled_lr): the critic's value-head groups differ from backbone groups only by
    `HEAD_GROUP_KEY`, so a resumed critic would get the head flag on a backbone group (head-only
    phases and snapshot loads would then treat the wrong parameters as the head). The run's config
    decides the settings; the checkpoint decides the state."""
    for opt, saved in zip(torch_optimizers(trainable.optimizer), settings, strict=True):
        for group, own in zip(opt.param_groups, saved, strict=True):
            for key in [k for k in group if k not in ("params", "step") and k not in own]:
                del group[key]
            group.update(own)


def load_checkpoint(
    directory: str | Path, trainable: Trainable, step: int | None = None, transforms: list[ModelTransform] = ()
) -> dict | None:
    """Collective: restores checkpoint `step` (default: the latest) into `trainable`; returns
    its meta ({"step", "extra", ...}) or None when there is none. The run's `transforms` check
    the checkpoint first (a LoRA base and settings) and, where it was written keeping less (a
    LoRA role's adapters), only that is loaded, into the model whose base is already loaded."""

    if step is None:
        path = latest_checkpoint(directory)
    else:
        path = atomic_dir.resolve(Path(directory), _step_dir(Path(directory), step).name, "meta.json")
        if path is None:
            raise FileNotFoundError(f"{_step_dir(Path(directory), step)}: no complete checkpoint of step {step}")
    if path is None:
        return None
    meta = json.loads((path / "meta.json").read_text())
    _check_layout(path, meta)
    check_saved_transforms(meta, list(transforms), path)
    sharding = meta.get("optimizer_format", LEGACY_OPTIMIZER_FORMAT)
    settings = group_settings(trainable)  # before megatron's sharded_state_dict / load touch them
    for hybrid in hybrid_optimizers(trainable.optimizer):
        # what megatron's load does first (a CPU patch would fill torch-Adam state instead); our
        # dummy_step (trainer/optimizer.py) makes no gradient for every parameter at once
        if not hybrid.state:
            hybrid.dummy_step()
    unify_adam_steps(trainable)  # one step count per optimizer, as megatron checkpoints it
    model = trainable.model[0].module
    model_state = model.sharded_state_dict()
    # the transforms whose entry the checkpoint has: it was written keeping what they keep
    partial = [t for t in transforms if meta.get(t.name) is not None and t.checkpoint_meta() is not None]
    loaded_model = _kept_part(model, model_state, partial) if partial else model_state
    _check_layer_spec(path, loaded_model)
    optimizer_state = _optimizer_state(trainable, model_state, sharding, is_loading=True)
    loaded = dist_checkpointing.load({"model": loaded_model, "optimizer": optimizer_state}, str(path / "dist"))
    if partial:  # what the transforms do not keep (a LoRA base) stays as the config loaded it
        missing, unexpected = model.load_state_dict(loaded["model"], strict=False)
        absent = [k for k in missing if _kept(k, partial)]
        if absent or unexpected:
            raise RuntimeError(f"{path}: the checkpoint ({', '.join(t.name for t in partial)}) does not fit the "
                               f"model: missing {absent[:3]}, unexpected {unexpected[:3]}")  # fmt: skip
    else:
        model.load_state_dict(loaded["model"])
    trainable.optimizer.load_state_dict(loaded["optimizer"])
    for hybrid in hybrid_optimizers(trainable.optimizer):
        # megatron ends its other formats' loads with this, not dp_reshardable's: the loaded state
        # reaches the sub-optimizers and the copies they step (a no-op where the load filled the
        # existing tensors in place, as it does on CPU)
        hybrid._sync_hdo_state_to_sub_optimizers()
    if meta.get("adam_step") is not None:
        set_adam_steps(trainable, meta["adam_step"])
    restore_group_settings(trainable, settings)
    trainable.scheduler.load_state_dict(meta["scheduler"])
    rng_file = path / "rng" / f"rank{dist.get_rank():05d}.pt"
    if meta["world_size"] == dist.get_world_size() and rng_file.is_file():
        _set_rng_state(load_rng_file(rng_file))
    return meta
