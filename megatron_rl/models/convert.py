"""HF <-> converted megatron checkpoints, in one process (TP=PP=EP=1; the saved
dist_checkpointing checkpoint reshards to any layout on load). Used by tools/convert_*.py."""

from __future__ import annotations

import os
from pathlib import Path

import megatron_rl.compat  # noqa: F401  (megatron-core on CPU needs its patches first)

import torch
from megatron.core import dist_checkpointing

from megatron_rl import parallel
from megatron_rl.models import checkpoint_io as io
from megatron_rl.models.builder import build_gpt_model
from megatron_rl.models.hf_mapping import ConversionError, hf_to_megatron, megatron_to_hf
from megatron_rl.models.sharding import full_parameters, load_full_state_dict
from megatron_rl.models.value_model import build_value_model


def _single_process_group() -> None:
    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(parallel.free_port()))
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        parallel.initialize_distributed()
    parallel.initialize_model_parallel()


def _build(arch, value_model: bool, head_init_std: float = 0.0):
    if value_model:
        return build_value_model(arch, head_init_std=head_init_std)
    return build_gpt_model(arch)


def hf_to_checkpoint(
    hf_dir: Path, out_dir: Path, value_model: bool = False, head_init_std: float = 0.0
) -> list[str]:
    """Converts an HF directory; returns the lines describing what was written."""

    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    arch = io.read_architecture(hf_dir)
    hf_state = io.read_hf_state_dict(hf_dir)
    full = hf_to_megatron(hf_state, arch, value_model=value_model)
    _single_process_group()
    model = _build(arch, value_model, head_init_std)
    expected = full_parameters(model)
    missing = sorted(set(expected) - set(full) - {"value_head.weight", "value_head.bias"})
    if missing:
        raise ConversionError(f"converted state has no tensor for {missing[:5]}")
    load_full_state_dict(model, {**expected, **full})  # the value head keeps its initialisation
    if (out_dir / io.MODEL_DIR).exists() and any((out_dir / io.MODEL_DIR).iterdir()):
        raise io.CheckpointError(f"{out_dir / io.MODEL_DIR}: not empty; refusing to overwrite a checkpoint")
    (out_dir / io.MODEL_DIR).mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save(model.sharded_state_dict(), str(out_dir / io.MODEL_DIR))
    copied = io.copy_hf_side_files(hf_dir, out_dir / io.HF_DIR)
    io.write_meta(out_dir, arch, value_model, str(hf_dir))
    kind = "value model" if value_model else "GPT model"
    head = ""
    if value_model:
        head = (
            " (value head from the HF checkpoint)"
            if "value_head.weight" in hf_state
            else f" (value head initialised, std {head_init_std})"
        )
    return [
        f"{kind} {arch.family}: {len(list(model.parameters()))} tensors, {sum(p.numel() for p in model.parameters()):,} parameters{head}",
        f"wrote {out_dir / io.MODEL_DIR} (megatron dist_checkpointing), {out_dir / io.META_FILE}",
        f"copied {', '.join(copied)} to {out_dir / io.HF_DIR}",
    ]


def load_checkpoint_full(checkpoint_dir: Path, hf_config_dir: Path | None = None):
    """(arch, value_model, full megatron state dict) of a converted checkpoint."""

    checkpoint_dir = Path(checkpoint_dir)
    meta = io.read_meta(checkpoint_dir)
    arch = io.read_architecture(hf_config_dir) if hf_config_dir else io.Architecture(**meta["architecture"])
    _single_process_group()
    model = _build(arch, meta["value_model"])
    state = dist_checkpointing.load(model.sharded_state_dict(), str(checkpoint_dir / io.MODEL_DIR))
    model.load_state_dict(state)
    return arch, meta["value_model"], full_parameters(model)


def checkpoint_to_hf(checkpoint_dir: Path, out_dir: Path, hf_config_dir: Path) -> list[str]:
    arch, value_model, full = load_checkpoint_full(checkpoint_dir, hf_config_dir)
    paths = io.write_hf_state_dict(megatron_to_hf(full, arch, value_model), Path(out_dir))
    copied = io.copy_hf_side_files(Path(hf_config_dir), Path(out_dir))
    return [f"wrote {', '.join(str(p) for p in paths)}", f"copied {', '.join(copied)} from {hf_config_dir}"]
