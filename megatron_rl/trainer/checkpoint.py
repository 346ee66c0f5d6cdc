"""Atomic training checkpoints: model, distributed optimizer, scheduler, step, RNG, extras.

Layout under the checkpoint directory:
    step_00000012/        dist/ (megatron dist_checkpointing, optimizer in the reshardable
                          `fully_reshardable` format), rng/rank00000.pt, meta.json
    step_00000013.partial a save in progress (or interrupted): never read
    step_00000011.replaced  the old step 11 while a redone step 11 takes its place (atomic_dir.py)
    latest                the name of the newest complete step directory (replaced atomically)

A save writes `step_N.partial`, then rank 0 renames it to `step_N` and only then points
`latest` at it, so an interrupted save leaves the previous checkpoint current and readable
(tests/e2e/test_restart.py kills the processes at each of these points).
"""

from __future__ import annotations

import json
from pathlib import Path

import megatron_rl.compat  # noqa: F401  (megatron-core on CPU needs its patches first)

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, tensor_parallel

from megatron_rl.trainer import atomic_dir
from megatron_rl.trainer.optimizer import Trainable, torch_optimizers, unify_adam_steps

_OPTIMIZER_FORMAT = {"distrib_optim_sharding_type": "fully_reshardable"}


def _step_dir(root: Path, step: int) -> Path:
    return root / atomic_dir.name("step", step)


def _rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def load_rng_file(path: Path) -> dict:
    """A rank's RNG state: tensors in dicts only (`weights_only=True`: a checkpoint from someone
    else never runs code here)."""
    try:
        return torch.load(path, weights_only=True)
    except Exception as exc:
        raise ValueError(f"{path}: not a plain-tensor RNG state, refusing to load it ({exc})") from exc


def save_checkpoint(
    directory: str | Path, step: int, trainable: Trainable, extra: dict | None = None, keep_last: int = 2
) -> Path:
    """Collective: every rank of the model calls it. Returns the complete step directory."""

    final = _step_dir(Path(directory), step)
    meta = {
        "step": step,
        "world_size": dist.get_world_size(),
        "scheduler": trainable.scheduler.state_dict(),
        "extra": extra or {},
    }

    def finish(partial: Path) -> None:  # rank 0, after every rank wrote its shards
        (partial / "meta.json").write_text(json.dumps(meta, indent=2))

    with atomic_dir.collective_write(
        final.parent, final.name, keep_last, "checkpoint.written", finish, subdirs=("dist", "rng")
    ) as partial:
        unify_adam_steps(trainable)  # one step count per optimizer, as megatron checkpoints it
        model = trainable.model[0].module
        model_state = model.sharded_state_dict()
        state = {
            "model": model_state,
            "optimizer": trainable.optimizer.sharded_state_dict(model_state, metadata=_OPTIMIZER_FORMAT),
        }
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
    `HEAD_GROUP_KEY`, so a resumed critic got the head flag on a backbone group (head-only
    phases and snapshot loads then treated the wrong parameters as the head). The run's config
    decides the settings; the checkpoint decides the state."""
    for opt, saved in zip(torch_optimizers(trainable.optimizer), settings, strict=True):
        for group, own in zip(opt.param_groups, saved, strict=True):
            for key in [k for k in group if k not in ("params", "step") and k not in own]:
                del group[key]
            group.update(own)


def load_checkpoint(directory: str | Path, trainable: Trainable, step: int | None = None) -> dict | None:
    """Collective: restores checkpoint `step` (default: the latest) into `trainable`; returns
    its meta ({"step", "extra", ...}) or None when there is none."""

    if step is None:
        path = latest_checkpoint(directory)
    else:
        path = atomic_dir.resolve(Path(directory), _step_dir(Path(directory), step).name, "meta.json")
        if path is None:
            raise FileNotFoundError(f"{_step_dir(Path(directory), step)}: no complete checkpoint of step {step}")
    if path is None:
        return None
    meta = json.loads((path / "meta.json").read_text())
    settings = group_settings(trainable)  # before megatron's sharded_state_dict / load touch them
    unify_adam_steps(trainable)  # one step count per optimizer, as megatron checkpoints it
    model = trainable.model[0].module
    model_state = model.sharded_state_dict()
    template = {
        "model": model_state,
        "optimizer": trainable.optimizer.sharded_state_dict(
            model_state, is_loading=True, metadata=_OPTIMIZER_FORMAT
        ),
    }
    loaded = dist_checkpointing.load(template, str(path / "dist"))
    model.load_state_dict(loaded["model"])
    trainable.optimizer.load_state_dict(loaded["optimizer"])
    restore_group_settings(trainable, settings)
    trainable.scheduler.load_state_dict(meta["scheduler"])
    rng_file = path / "rng" / f"rank{dist.get_rank():05d}.pt"
    if meta["world_size"] == dist.get_world_size() and rng_file.is_file():
        _set_rng_state(load_rng_file(rng_file))
    return meta
