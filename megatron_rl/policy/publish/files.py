"""Path (a), `inference.weight_update: safetensors` (`SafetensorsPublisher`): HF safetensors +
manifest in a directory that vLLM loads with `collective_rpc reload_weights`
(`publish_hf_weights`).

Publishing is collective over the policy's ranks. TP shards are gathered; then one rank per
pipeline stage writes that stage's non-expert tensors, and one rank per (stage, expert-parallel
rank) writes its experts, each into its own safetensors file (ownership.py), so nothing else
crosses processes. Global rank 0 then writes the safetensors index, config/tokenizer files and
`manifest.json` (step, files, sha256 of each), renames `version_{step:08d}.partial` to
`version_{step:08d}` and points `latest` at it atomically. A publish interrupted midway leaves
the previous version current and intact.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

from megatron_rl.config import Architecture
from megatron_rl.conversion.checkpoint_io import copy_hf_side_files
from megatron_rl.policy.publish.ownership import owned_hf_tensors, writer_roles
from megatron_rl.trainer import atomic_dir


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def publish_hf_weights(
    model,
    arch: Architecture,
    directory: str | Path,
    step: int,
    hf_side_files: Path | None = None,
    keep_last: int = 2,
    merge: Callable[[dict], dict] | None = None,
) -> Path:
    """Writes version `step` under `directory`; returns its path (on every rank). A transformed
    policy's weights are merged with `merge` (`owned_hf_tensors`)."""
    root = Path(directory)
    version = atomic_dir.name("version", step)

    def finish(partial: Path) -> None:  # rank 0: index, side files, manifest
        files = sorted(p.name for p in partial.glob("model-*.safetensors"))
        weight_map = {}
        for name in files:
            with safe_open(str(partial / name), framework="pt") as f:
                weight_map.update({key: name for key in f.keys()})
        (partial / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2)
        )
        if hf_side_files is not None:
            copy_hf_side_files(Path(hf_side_files), partial)
        manifest = {
            "step": step,
            "files": {name: sha256_of(partial / name) for name in files},
            "num_tensors": len(weight_map),
        }
        (partial / "manifest.json").write_text(json.dumps(manifest, indent=2))

    with atomic_dir.collective_write(root, version, keep_last, "publish.written", finish) as partial:
        hf = owned_hf_tensors(model, arch, merge)
        _, _, tag = writer_roles()
        if hf:
            save_file(
                {k: v.contiguous() for k, v in hf.items()},
                str(partial / f"model-{tag}.safetensors"),
                metadata={"format": "pt"},
            )
    return root / version


def latest_published(directory: str | Path) -> Path | None:
    """The newest complete published version, or None."""
    return atomic_dir.latest(Path(directory), "manifest.json")


def verify_published(path: str | Path) -> dict:
    """Checks every file's sha256 against the manifest; returns the manifest."""
    path = Path(path)
    manifest = json.loads((path / "manifest.json").read_text())
    for name, digest in manifest["files"].items():
        if sha256_of(path / name) != digest:
            raise ValueError(f"{path / name}: sha256 does not match manifest.json")
    return manifest


class SafetensorsPublisher:
    """Path (a): `publish_hf_weights` into `directory`, with the HF side files (config.json,
    tokenizer) from `side_files` so that each version loads on its own; a transformed policy's
    weights merged with `merge` (its transforms', transforms/base.merged)."""

    def __init__(
        self,
        arch: Architecture,
        directory: str | Path,
        side_files: Path | None = None,
        keep_last: int = 2,
        merge: Callable[[dict], dict] | None = None,
    ):
        self.arch, self.directory = arch, Path(directory)
        self.side_files, self.keep_last, self.merge = side_files, keep_last, merge

    def publish(self, model, version: int) -> Path:
        return publish_hf_weights(
            model, self.arch, self.directory, version, hf_side_files=self.side_files, keep_last=self.keep_last,
            merge=self.merge,
        )  # fmt: skip

    def close(self) -> None:
        pass
