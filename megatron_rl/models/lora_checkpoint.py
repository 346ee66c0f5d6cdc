"""LoRA training checkpoints: the trainable tensors and the base model's identity, not a copy of
the base; their export as a PEFT adapter directory or as merged HF weights.

A LoRA role's checkpoint (the policy's `lora`, the critic's `value.lora`; trainer/checkpoint.py)
writes only what trains: every adapter (`*.lora_a`, `*.lora_b`) and, for the critic, its value
head (`value_head.*`), beside the optimizer state (which holds only those anyway). The frozen
base is not written; meta.json's `lora` names it instead:

    {"rank", "alpha", "target_modules", "key": "lora" | "value.lora",
     "base": {"where": "model.checkpoint", "checkpoint": "/abs/path" | null,
              "fingerprint": "sha256:..." | null, "seed": int}}

On resume the base is what the config's `model.checkpoint` (`value.model.checkpoint`) loaded
before LoRA wrapped the model, and the checkpoint gives the adapters; `check_base` refuses a
base whose fingerprint differs from the saved one, or a base where the checkpoint had none (or
the reverse), naming both paths. A moved copy of the same base (same fingerprint) resumes.

The fingerprint (`fingerprint`) is sha256 over every weight file under the base directory
(`WEIGHT_SUFFIXES`: safetensors, torch files, megatron's `.distcp` shards and its
`.metadata`), sorted by relative path: the path, the file's size, and its first and last MiB.
A safetensors file starts with its header (each tensor's name, dtype, shape and offsets) and
its first and last MiB hold the first and last tensors' bytes; a dist checkpoint's `.metadata`
holds the layout of every tensor. So it reads at most 2 MiB a file (about 60 MiB for a 60 GB
checkpoint in 30 shards: well under a second), and sees another architecture, dtype, sharding,
a truncated or re-saved file, or a fine-tuned model (whose first and last tensors differ), but
not an edit confined to the middle of a file with its size unchanged. Config and tokenizer
files are not weights and are not part of it. A random base (`checkpoint` null) is identified
by the role's seed: it is rebuilt from that seed at the layout the checkpoint resumes at.

Export: `trainable_tensors` loads a step's adapters (and head) as full tensors at TP = 1 (under
the names `gather_full_parameters` gives), `export_peft` writes them in PEFT's format
(models/peft.py), `export_merged` writes the base's HF tensors with each adapter folded in,
W + (alpha / rank) B A, one decoder layer at a time, plus the HF side files.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path

import megatron_rl.compat  # noqa: F401  (megatron-core on CPU needs its patches first)

import torch

from megatron_rl.config import Architecture
from megatron_rl.models import checkpoint_io as io

FINGERPRINT_BYTES = 1 << 20
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".distcp", ".metadata")
TRAINING_META = "meta.json"


class BaseMismatch(ValueError):
    """A LoRA checkpoint and the base model it is asked to resume (or export) on differ."""


def is_trainable_key(name: str) -> bool:
    """Whether a state-dict (or sharded state dict) entry is one a LoRA checkpoint writes: an
    adapter or the critic's value head."""
    return name.endswith((".lora_a", ".lora_b")) or name.startswith("value_head.")


def _weight_files(directory: Path) -> list[Path]:
    return sorted(
        (p for p in directory.rglob("*") if p.is_file() and (p.suffix in WEIGHT_SUFFIXES or p.name in WEIGHT_SUFFIXES)),
        key=lambda p: p.relative_to(directory).as_posix(),
    )


def fingerprint(directory: str | Path, where: str = "model.checkpoint") -> str:
    """sha256 (as "sha256:HEX") over the relative path, size and first and last MiB of every
    weight file under `directory` (see the module's docstring for what it sees)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"{where}: {directory} is not a directory (the LoRA base model)")
    files = _weight_files(directory)
    if not files:
        raise FileNotFoundError(f"{where}: {directory} holds no weight files ({', '.join(WEIGHT_SUFFIXES)})")
    digest = hashlib.sha256()
    for path in files:
        size = path.stat().st_size
        digest.update(f"{path.relative_to(directory).as_posix()}\0{size}\0".encode())
        with path.open("rb") as f:
            digest.update(f.read(FINGERPRINT_BYTES))
            if size > FINGERPRINT_BYTES:
                f.seek(max(FINGERPRINT_BYTES, size - FINGERPRINT_BYTES))
                digest.update(f.read(FINGERPRINT_BYTES))
    return f"sha256:{digest.hexdigest()}"


def base_identity(checkpoint: str | None, where: str, seed: int) -> dict:
    """The base model's identity for a LoRA checkpoint's meta: its path (absolute) and
    fingerprint, or for a random base (`checkpoint` None) the seed it is drawn from."""
    if not checkpoint:
        return {"where": where, "checkpoint": None, "fingerprint": None, "seed": seed}
    path = Path(checkpoint).absolute()
    return {"where": where, "checkpoint": str(path), "fingerprint": fingerprint(path, where), "seed": seed}


def lora_meta(lora, key: str, base: dict) -> dict:
    """meta.json's `lora` of a LoRA role: its config section `key` (`lora` / `value.lora`) and base."""
    return {"key": key, "rank": lora.rank, "alpha": lora.alpha, "target_modules": list(lora.target_modules),
            "base": base}  # fmt: skip


def _describe(base: dict) -> str:
    if base.get("checkpoint") is None:
        return f"a random initialisation (seed {base.get('seed')}, {base.get('where')} null)"
    return f"{base['checkpoint']} ({base.get('fingerprint')})"


def check_base(saved: Mapping, current: Mapping, checkpoint: str | Path) -> None:
    """Refuses (BaseMismatch, naming both) a base other than the one the LoRA checkpoint at
    `checkpoint` was trained on: another fingerprint, a base where there was none or the
    reverse, another seed of a random base. The same files elsewhere (a moved copy) pass."""
    where = current.get("where") or saved.get("where") or "model.checkpoint"
    same = (
        saved.get("fingerprint") == current.get("fingerprint")
        if saved.get("checkpoint") and current.get("checkpoint")
        else saved.get("checkpoint") is None and current.get("checkpoint") is None
        and saved.get("seed") == current.get("seed")
    )
    if not same:
        raise BaseMismatch(
            f"{checkpoint}: its LoRA adapters were trained on the base {_describe(saved)}, but {where} is now "
            f"{_describe(current)}; adapters on another base would compute another model, so this is refused. "
            f"Set {where} to the base the checkpoint was trained on (a copy with the same files passes), or start "
            "a new run (another checkpoint.dir)"
        )


def check_settings(saved: Mapping, current: Mapping, checkpoint: str | Path) -> None:
    """Refuses to resume adapters under other LoRA settings (rank, alpha, targets), naming the key."""
    differ = [k for k in ("rank", "alpha", "target_modules") if saved.get(k) != current.get(k)]
    if differ:
        key = current.get("key", "lora")
        raise ValueError(
            f"{checkpoint}: its adapters were trained with "
            + ", ".join(f"{key}.{k} {saved.get(k)}" for k in differ) + "; this run has "
            + ", ".join(f"{key}.{k} {current.get(k)}" for k in differ) + ": a LoRA checkpoint resumes with its own settings"
        )  # fmt: skip


def read_lora_meta(step_dir: str | Path) -> dict | None:
    """meta.json's `lora` of a training checkpoint step (None: a checkpoint with every tensor)."""
    path = Path(step_dir) / TRAINING_META
    if not path.is_file():
        raise io.CheckpointError(f"{step_dir}: not a training checkpoint step directory (no {TRAINING_META})")
    return json.loads(path.read_text()).get("lora")


# -- export ------------------------------------------------------------------------------------


def _adapted_structure(arch: Architecture, lora: Mapping, value_model: bool) -> dict:
    """The trainable entries of the sharded state dict of the LoRA-wrapped local-spec model at
    TP = PP = EP = 1 on the meta device (the names of `gather_full_parameters`)."""
    from megatron_rl.config.model import EXPERT_LORA_TARGETS
    from megatron_rl.models.builder import build_gpt_model
    from megatron_rl.models.lora import apply_lora
    from megatron_rl.models.value_model import build_value_model

    experts = bool(arch.num_experts) and any(t in EXPERT_LORA_TARGETS for t in lora["target_modules"])
    builder = build_value_model if value_model else build_gpt_model
    with torch.device("meta"):
        model = builder(arch, transformer_engine=False, device="meta", use_cpu_initialization=True,
                        perform_initialization=False, **({"moe_grouped_gemm": False} if experts else {}))  # fmt: skip
        apply_lora(model, lora["rank"], lora["alpha"], tuple(lora["target_modules"]))
    return {k: v for k, v in model.sharded_state_dict().items() if is_trainable_key(k)}


def trainable_tensors(step_dir: str | Path, arch: Architecture, value_model: bool = False) -> dict[str, torch.Tensor]:
    """The full (TP = 1) adapters, and a critic's value head, of a LoRA training checkpoint step
    written at any layout, in their saved dtypes: `decoder.layers.0.self_attention.linear_qkv.lora_a`, ..."""
    from megatron_rl.models.convert import _single_process_group, load_structure_tensors

    lora = read_lora_meta(step_dir)
    if lora is None:
        raise io.CheckpointError(f"{step_dir}: not a LoRA checkpoint (its meta.json has no lora section)")
    _single_process_group()
    structure = _adapted_structure(arch, lora, value_model)
    return load_structure_tensors(Path(step_dir) / "dist", structure)


def hf_base_dir(base: str | Path | None, fallback: str | Path | None = None) -> str | None:
    """The HF directory (config.json and safetensors) of a base: the base itself, or the HF
    directory a converted checkpoint was made from, or `fallback`, when it holds weights."""

    def has_weights(directory) -> bool:
        d = Path(directory)
        return (d / "config.json").is_file() and any(d.glob("*.safetensors"))

    candidates = []
    if base:
        candidates.append(base)
        if (Path(base) / io.META_FILE).is_file():
            candidates.append(json.loads((Path(base) / io.META_FILE).read_text()).get("source"))
    candidates.append(fallback)
    for candidate in candidates:
        if candidate and has_weights(candidate):
            return str(Path(candidate).absolute())
    return None


def export_peft(step_dir: str | Path, out: str | Path, arch: Architecture, base_model: str | None) -> list[str]:
    """Writes a policy checkpoint step's adapters as a PEFT adapter directory (adapter_config.json,
    adapter_model.safetensors) with `base_model` as base_model_name_or_path."""
    from megatron_rl.models.peft import megatron_adapters_to_peft, write_peft_adapter

    lora = read_lora_meta(step_dir)
    if lora is not None and lora.get("key") == "value.lora":
        raise io.CheckpointError(
            f"{step_dir}: a critic checkpoint (value.lora): its value head has no place in a PEFT causal-LM "
            "adapter; export it merged (--merged)"
        )
    adapters = trainable_tensors(step_dir, arch)
    tensors = megatron_adapters_to_peft(adapters, arch)
    write_peft_adapter(out, tensors, lora["rank"], lora["alpha"], base_model=base_model)
    size = sum(t.nbytes for t in tensors.values())
    return [f"wrote {Path(out)} (PEFT adapter: {len(tensors)} tensors, {size:,} bytes; base {base_model})"]


def _base_megatron_tensors(base: Path, arch: Architecture) -> tuple[Mapping[str, torch.Tensor], bool]:
    """(the base's full megatron tensors, whether it is a value model): a converted checkpoint
    loaded in its dtype, or an HF directory's tensors mapped lazily."""
    from megatron_rl.models.convert import load_checkpoint_tensors
    from megatron_rl.models.hf_mapping import MegatronStateFromHF

    if (base / io.META_FILE).is_file():
        value_model = bool(io.read_meta(base)["value_model"])
        return load_checkpoint_tensors(base, arch, value_model), value_model
    if (base / "config.json").is_file():
        return MegatronStateFromHF(io.read_hf_state_dict(base), arch, value_model=False), False
    raise io.CheckpointError(f"{base}: neither a converted checkpoint nor an HF directory (the LoRA base)")


def export_merged(step_dir: str | Path, out: str | Path, hf_config_dir: str | Path, base: str | Path | None = None,
                  value_model: bool | None = None) -> list[str]:  # fmt: skip
    """Writes HF safetensors of a LoRA checkpoint step merged into its base (`base`, default the
    one its meta.json names; checked against the saved fingerprint): W + (alpha / rank) B A in
    W's dtype (computed in float32), plain HF names, one decoder layer at a time, with the config
    and tokenizer files of `hf_config_dir`. A critic's (`value.lora`) gets its trained value head."""
    from megatron_rl.models.convert import _group_of, _single_process_group, write_hf_by_layer
    from megatron_rl.models.lora import merge_adapter_tensors

    lora = read_lora_meta(step_dir)
    if lora is None:
        raise io.CheckpointError(f"{step_dir}: not a LoRA checkpoint (its meta.json has no lora section)")
    saved = lora["base"]
    where = saved.get("where", "model.checkpoint")
    base = base or saved.get("checkpoint")
    if not base:
        raise BaseMismatch(
            f"{step_dir}: its adapters were trained on a random initialisation ({where} null): there are no base "
            "weights to merge them into; export the adapters alone"
        )
    check_base(saved, base_identity(str(base), where, saved.get("seed")), step_dir)
    if value_model is None:
        value_model = lora.get("key") == "value.lora"
    arch = io.read_architecture(Path(hf_config_dir))
    _single_process_group()
    trained = trainable_tensors(step_dir, arch, value_model)
    base_tensors, _ = _base_megatron_tensors(Path(base), arch)
    names = sorted({n for n in base_tensors if value_model or not n.startswith("value_head.")}
                   | {n for n in trained if not n.endswith((".lora_a", ".lora_b"))})  # fmt: skip

    def layers():
        for group in sorted({_group_of(n) for n in names}):
            layer = {n: trained[n] if n in trained else base_tensors[n] for n in names if _group_of(n) == group}
            layer.update({n: t for n, t in trained.items() if _group_of(n) == group and n.endswith((".lora_a", ".lora_b"))})
            yield merge_adapter_tensors(layer, lora["alpha"])

    paths = write_hf_by_layer(layers(), arch, value_model, Path(out), f"{step_dir}: the checkpoint and its base give")
    copied = io.copy_hf_side_files(Path(hf_config_dir), Path(out))
    adapters = sum(n.endswith(".lora_a") for n in trained)
    return [
        f"merged {adapters} adapters (alpha {lora['alpha']:g}, rank {lora['rank']}) into the base {base}",
        f"wrote {', '.join(str(p) for p in paths)}",
        f"copied {', '.join(copied)} from {hf_config_dir}",
    ]


def export_lora(resolved, step_dir: str | Path, out: str | Path, merged: bool = False) -> list[str]:
    """`megatron-rl export-lora`: a LoRA checkpoint step of the run `resolved` (the policy's, or
    the critic's with `value.lora`: meta.json says which) as a PEFT adapter directory, or with
    `merged` as merged HF weights with the config and tokenizer files. The base is the config's
    (`model.checkpoint` / `value.model.checkpoint`), checked against the one the checkpoint
    names. `out` is written as `out.partial` and renamed when complete; an existing non-empty
    `out` is refused."""
    step_dir, out = Path(step_dir), Path(out)
    lora = read_lora_meta(step_dir)
    if lora is None:
        raise io.CheckpointError(
            f"{step_dir}: its meta.json has no lora section: a full fine-tuning checkpoint (every tensor), not "
            "LoRA adapters; convert it with tools/convert_megatron_to_hf.py"
        )
    critic = lora.get("key") == "value.lora"
    if critic and resolved.value is None:
        raise ValueError(f"{step_dir}: a critic checkpoint (value.lora), and the config has no value section")
    model_config = resolved.value.model if critic else resolved.model
    where = "value.model.checkpoint" if critic else "model.checkpoint"
    base = model_config.checkpoint
    check_base(lora["base"], base_identity(base, where, lora["base"].get("seed")), step_dir)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"--out {out}: not empty; refusing to overwrite it")
    served = None if critic else resolved.inference.model_dir
    hf_dir = hf_base_dir(base, served or model_config.hf_config)
    partial = out.with_name(out.name + ".partial")
    if partial.exists():
        import shutil

        shutil.rmtree(partial)
    if merged:
        config_dir = served or model_config.hf_config or hf_dir
        if not config_dir or not (Path(config_dir) / "config.json").is_file():
            raise io.CheckpointError(
                f"{'inference.model_dir / ' if not critic else ''}{where.replace('checkpoint', 'hf_config')}: no HF "
                "directory with config.json to take the merged model's config and tokenizer from"
            )
        lines = export_merged(step_dir, partial, config_dir, base=base, value_model=critic)
    else:
        arch = resolved.layout.critic_architecture if critic else resolved.layout.policy_architecture
        lines = export_peft(step_dir, partial, arch, hf_dir)
    if out.exists():
        out.rmdir()
    partial.rename(out)
    return [line.replace(str(partial), str(out)) for line in lines]
