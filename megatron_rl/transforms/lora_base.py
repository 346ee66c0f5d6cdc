"""What every save and resume of a LoRA role runs: its checkpoint holds the trainable tensors and
the base model's identity, not a copy of the base (the export tool: transforms/lora_export.py).

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

"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path

from megatron_rl.conversion import checkpoint_io as io

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
