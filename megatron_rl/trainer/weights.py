"""Initial weights for a trainer's model, and loading a backbone from a reshardable checkpoint.

`load_initial_weights` takes `model.checkpoint` / `value.model.checkpoint`: a converted
checkpoint (tools/convert_hf_to_megatron.py, with or without a value head) or an HF directory.
`load_backbone` loads every tensor of the model except its value head and LoRA adapters from a
megatron dist_checkpointing directory (a converted checkpoint, a training checkpoint's `dist/`,
or a policy snapshot), resharding to this process's TP/EP layout; the critic uses it to start
from a policy checkpoint and for policy snapshots. Checkpoints written with the local or the
TransformerEngine layer spec load into a model of either (`conversion/spec_keys.py`).

An HF directory is loaded without copies of the model: its safetensors are memory-mapped, each
rank computes (and fuses) only the tensors of its own parameters, one at a time, and copies its
slice into the parameter.
"""

from __future__ import annotations

import json
from pathlib import Path

import megatron_rl.compat  # noqa: F401  (megatron-core on CPU needs its patches first)

import torch
from megatron.core import dist_checkpointing

from megatron_rl.config import Architecture
from megatron_rl.conversion.checkpoint_io import read_hf_state_dict
from megatron_rl.conversion.hf_mapping import MegatronStateFromHF
from megatron_rl.conversion.spec_keys import checkpoint_keys, plan_load
from megatron_rl.models.sharding import global_parameter_names, load_full_state_dict


def _is_own_tensor(key: str) -> bool:
    """Tensors a backbone checkpoint cannot provide: the value head and LoRA adapters."""
    return key.startswith("value_head.") or ".lora_a" in key or ".lora_b" in key


def load_backbone(model: torch.nn.Module, dist_dir: str | Path, include_head: bool = False) -> list[str]:
    """Collective over the model's ranks. Loads the backbone (and the value head when
    `include_head`) from the dist_checkpointing directory `dist_dir`; returns the loaded keys."""

    dist_dir = Path(dist_dir)
    if not (dist_dir / "metadata.json").is_file():
        raise FileNotFoundError(f"{dist_dir}: not a megatron dist_checkpointing directory (no metadata.json)")
    template = {
        key: value
        for key, value in model.sharded_state_dict().items()
        if not _is_own_tensor(key) or (include_head and key.startswith("value_head."))
    }
    plan = plan_load(template, checkpoint_keys(dist_dir))
    try:
        loaded = dist_checkpointing.load(plan.state_dict, str(dist_dir))
    except Exception as exc:  # megatron's message lists keys; say which checkpoint and model
        raise RuntimeError(
            f"{dist_dir}: cannot load this model's backbone from it (architectures must match): {exc}"
        ) from exc
    missing, _ = model.load_state_dict(loaded, strict=False)
    absent = [k for k in missing if k in plan.state_dict]
    if absent:
        raise RuntimeError(f"{dist_dir}: loaded state lacks {absent[:5]}")
    return sorted(plan.state_dict)


def load_initial_weights(
    model: torch.nn.Module,
    checkpoint: str | None,
    arch: Architecture,
    value_model: bool = False,
    where: str = "model.checkpoint",
) -> str:
    """Loads `checkpoint` into `model`; returns a description of what was loaded. A value model
    takes the backbone of a GPT checkpoint (its head keeps its initialisation) or all of a
    converted value-model checkpoint; a GPT model cannot load a value-model checkpoint. Call it
    before LoRA wraps the model."""
    if not checkpoint:
        return "random initialisation"
    path = Path(checkpoint)
    meta_file = path / "megatron_rl.json"
    if meta_file.is_file():
        saved_value_model = bool(json.loads(meta_file.read_text()).get("value_model", False))
        if saved_value_model and not value_model:
            raise ValueError(
                f"{where}: {path} is a value-model checkpoint; the policy needs a GPT checkpoint"
            )
        load_backbone(model, path / "model", include_head=saved_value_model)
        what = "value model" if saved_value_model else "GPT backbone"
        return f"converted checkpoint {path} ({what})"
    if (path / "config.json").is_file():
        full = MegatronStateFromHF(read_hf_state_dict(path), arch, value_model=value_model)
        # Parameters an HF checkpoint does not hold (a value head) keep their initialisation.
        global_names = global_parameter_names(model).values()
        keep = frozenset(n for n in global_names if _is_own_tensor(n) and n not in full)
        load_full_state_dict(model, full, keep=keep)
        return f"HF weights {path}"
    raise FileNotFoundError(f"{where}: {path} is neither a converted checkpoint nor an HF directory")
