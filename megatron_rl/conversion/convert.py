"""HF <-> converted megatron checkpoints, in one process, without building the model's weights.

The structure of the checkpoint (keys, global shapes, layer and expert offsets, the gate/up
pieces of gated `linear_fc1`) is that of the local-spec model at TP = PP = EP = 1, read from the
model's own `sharded_state_dict()` on a model built on the meta device (no storage). Its data are
the HF tensors themselves, in the checkpoint's dtype:

- HF -> megatron: the safetensors are memory-mapped; renamed tensors are saved straight from
  the mapping and gate/up are saved as the two pieces megatron's checkpoint stores anyway, so the
  only new memory is the fused `linear_qkv` of each layer (q, k, v interleaved per group).
- megatron -> HF: the checkpoint is loaded once, in its dtype, into buffers of its size (no
  model, no fp32 copy, no clones), and written one decoder layer at a time to safetensors shards
  of at most 4 GiB.

The saved dist_checkpointing checkpoint reshards to any layout on load, and loads into the local
or the TE spec (`spec_keys.py`). Used by tools/convert_*.py.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import megatron_rl.compat  # noqa: F401  (megatron-core on CPU needs its patches first)

import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory

from megatron_rl import parallel
from megatron_rl.config import Architecture
from megatron_rl.conversion import checkpoint_io as io
from megatron_rl.conversion.hf_mapping import (
    ConversionError,
    MegatronStateFromHF,
    family_mapping,
    megatron_to_hf,
)
from megatron_rl.conversion.spec_keys import checkpoint_keys, plan_load
from megatron_rl.models.builder import build_gpt_model
from megatron_rl.models.sharding import named_weights
from megatron_rl.models.value_model import build_value_model, initial_value_head

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_HEAD = ("value_head.weight", "value_head.bias")


def single_process_group() -> None:
    """A one-rank default group for megatron's checkpointing, unless one exists. Its store lives in
    this process (a HashStore): a converter listens on no port (the TCPStore server that
    `env://` starts listens on every interface)."""
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(
            megatron_rl.compat.distributed_backend(), store=torch.distributed.HashStore(), rank=0, world_size=1
        )
    parallel.initialize_model_parallel()


def checkpoint_structure(arch: Architecture, value_model: bool) -> tuple[dict, dict[str, tuple[int, ...]]]:
    """(The sharded state dict of the local-spec model at TP = PP = EP = 1 on the meta device,
    each parameter's and weight buffer's (a router's expert bias) shape by name). Collective-free; needs megatron's parallel state."""
    builder = build_value_model if value_model else build_gpt_model
    with torch.device("meta"):
        model = builder(
            arch,
            transformer_engine=False,
            device="meta",
            use_cpu_initialization=True,
            perform_initialization=False,
        )
    shapes = {name: tuple(p.shape) for name, p in named_weights(model)}
    return model.sharded_state_dict(), shapes


def _pieces(factory: ShardedTensorFactory, data: torch.Tensor) -> list[ShardedTensor]:
    """The ShardedTensors a gated-fc1 factory saves, built on `data` (views of it)."""
    return factory.build_fn(factory.key, data, factory.replica_id, factory.flattened_range)


def _with_data(entry: ShardedTensor, data: torch.Tensor) -> ShardedTensor:
    return dataclasses.replace(entry, data=data, dtype=data.dtype)


def hf_to_checkpoint(
    hf_dir: Path, out_dir: Path, value_model: bool = False, head_init_std: float = 0.0
) -> list[str]:
    """Converts an HF directory; returns the lines describing what was written."""

    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    arch = io.read_architecture(hf_dir)
    hf_state = io.read_hf_state_dict(hf_dir)
    full = MegatronStateFromHF(hf_state, arch, value_model=value_model)
    if (out_dir / io.MODEL_DIR).exists() and any((out_dir / io.MODEL_DIR).iterdir()):
        raise io.CheckpointError(f"{out_dir / io.MODEL_DIR}: not empty; refusing to overwrite a checkpoint")
    single_process_group()
    structure, shapes = checkpoint_structure(arch, value_model)
    missing = sorted(set(shapes) - set(full) - set(_HEAD))
    if missing:
        raise ConversionError(f"converted state has no tensor for {missing[:5]}")
    head = {}
    if value_model and "value_head.weight" not in full:
        head = initial_value_head(shapes["value_head.weight"][1], head_init_std)

    state = {}
    for name, entry in structure.items():
        if isinstance(entry, ShardedObject):
            state[name] = entry
            continue
        if name.startswith("value_head.") and name not in full:
            tensor = head[name.removeprefix("value_head.")]
        else:
            tensor = full[name]
        if tuple(tensor.shape) != shapes[name]:
            raise ConversionError(
                f"{name}: converted shape {tuple(tensor.shape)} != model shape {shapes[name]}"
            )
        if isinstance(entry, ShardedTensorFactory):
            parts = full.concatenated_parts(name)
            if parts is None:
                raise ConversionError(f"{name}: a factory-saved tensor that is not gate/up")
            state[name] = [_with_data(piece, part) for piece, part in zip(_pieces(entry, entry.data), parts)]
        else:
            state[name] = _with_data(entry, tensor)
    (out_dir / io.MODEL_DIR).mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save(state, str(out_dir / io.MODEL_DIR))
    copied = io.copy_hf_side_files(hf_dir, out_dir / io.HF_DIR)
    io.write_meta(out_dir, arch, value_model, str(hf_dir))
    kind = "value model" if value_model else "GPT model"
    described = ""
    if value_model:
        described = (
            " (value head from the HF checkpoint)"
            if "value_head.weight" in hf_state
            else f" (value head initialised, std {head_init_std})"
        )
    parameters = sum(torch.Size(shape).numel() for shape in shapes.values())
    return [
        f"{kind} {arch.family}: {len(shapes)} tensors, {parameters:,} parameters{described}",
        f"wrote {out_dir / io.MODEL_DIR} (megatron dist_checkpointing), {out_dir / io.META_FILE}",
        f"copied {', '.join(copied)} to {out_dir / io.HF_DIR}",
    ]


def layer_of(name: str) -> int:
    """The decoder layer a state-dict entry belongs to; -1 for the rest (embeddings, heads)."""
    match = _LAYER.match(name)
    return int(match[1]) if match else -1


TRAINING_DIST_DIR = "dist"  # a training checkpoint's step directory (trainer/checkpoint.py)


def model_dist_dir(checkpoint_dir: Path) -> Path:
    """The dist_checkpointing directory of a converted checkpoint (`model/`) or of one step of a
    training checkpoint (`dist/`, the model's tensors beside the optimizer's)."""
    for name in (io.MODEL_DIR, TRAINING_DIST_DIR):
        if (Path(checkpoint_dir) / name / "metadata.json").is_file():
            return Path(checkpoint_dir) / name
    raise io.CheckpointError(
        f"{checkpoint_dir}: neither a converted checkpoint ({io.MODEL_DIR}/) nor a training checkpoint's step "
        f"directory ({TRAINING_DIST_DIR}/), with megatron's metadata.json"
    )


def load_checkpoint_tensors(
    checkpoint_dir: Path, arch: Architecture, value_model: bool
) -> dict[str, torch.Tensor]:
    """The full megatron tensors of a converted (or training) checkpoint written with either
    layer spec, in the checkpoint's dtypes, loaded into buffers of exactly that size (gate/up
    loaded in place into their fused tensor)."""
    dist_dir = model_dist_dir(checkpoint_dir)
    structure, _ = checkpoint_structure(arch, value_model)
    return load_structure_tensors(dist_dir, structure)


def load_structure_tensors(dist_dir: Path, structure: dict) -> dict[str, torch.Tensor]:
    """The full tensors of the entries of a sharded state dict at TP = PP = EP = 1 (`structure`,
    its objects skipped) from the dist_checkpointing directory `dist_dir`, in the saved dtypes."""
    tensors = {k: v for k, v in structure.items() if not isinstance(v, ShardedObject)}
    plan = plan_load(tensors, checkpoint_keys(dist_dir))
    dtypes = {
        key: meta.dtype for key, meta in dist_checkpointing.load_tensors_metadata(str(dist_dir)).items()
    }
    template, fused = {}, {}
    for name, entry in plan.state_dict.items():
        if entry.key not in dtypes:
            raise ConversionError(f"{dist_dir}: no tensor {entry.key!r} (for {name})")
        dtype = dtypes[entry.key]
        if isinstance(entry, ShardedTensorFactory):
            fused[name] = torch.empty(entry.data.shape, dtype=dtype)
            template[name] = _pieces(entry, fused[name])
        else:
            template[name] = _with_data(entry, torch.empty(entry.local_shape, dtype=dtype))
    loaded = dist_checkpointing.load(template, str(dist_dir))
    for name, pieces in list(loaded.items()):
        if name in fused:
            in_place = all(p.data_ptr() == v.data_ptr() for p, v in zip(fused[name].chunk(2), pieces))
            loaded[name] = fused[name] if in_place else torch.cat(pieces)
    return loaded


def load_checkpoint_full(checkpoint_dir: Path, hf_config_dir: Path | None = None):
    """(arch, value_model, full megatron state dict) of a converted checkpoint, in its dtypes."""

    checkpoint_dir = Path(checkpoint_dir)
    meta = io.read_meta(checkpoint_dir)
    arch = io.read_architecture(hf_config_dir) if hf_config_dir else io.Architecture(**meta["architecture"])
    single_process_group()
    return arch, meta["value_model"], load_checkpoint_tensors(checkpoint_dir, arch, meta["value_model"])


def checkpoint_to_hf(checkpoint_dir: Path, out_dir: Path, hf_config_dir: Path, value_model: bool | None = None) -> list[str]:
    """Writes the HF safetensors of a converted checkpoint, or of one step of a training
    checkpoint (whose meta.json does not say whether it is a value model: `value_model` does),
    loaded once in its dtype, written one decoder layer at a time. A LoRA training checkpoint
    holds adapters only: transforms/lora_export.export_hf merges it into its base."""
    checkpoint_dir = Path(checkpoint_dir)
    training_meta = checkpoint_dir / "meta.json"
    if training_meta.is_file() and json.loads(training_meta.read_text()).get("lora") is not None:
        raise ConversionError(
            f"{checkpoint_dir}: a LoRA training checkpoint (adapters only, no base weights): write it as HF "
            "weights with transforms/lora_export.export_hf (the base merged in) or megatron-rl export-lora"
        )
    if value_model is None:
        value_model = io.read_meta(checkpoint_dir)["value_model"]
    arch = io.read_architecture(hf_config_dir)
    single_process_group()
    full = load_checkpoint_tensors(checkpoint_dir, arch, value_model)

    def layers():
        for group in sorted({layer_of(name) for name in full}):
            # Each layer's tensors are dropped once written (the writer holds at most one shard).
            yield {name: full.pop(name) for name in [n for n in full if layer_of(n) == group]}

    paths = write_hf_by_layer(layers(), arch, value_model, out_dir, f"{checkpoint_dir}: the checkpoint gives")
    copied = io.copy_hf_side_files(Path(hf_config_dir), Path(out_dir))
    return [f"wrote {', '.join(str(p) for p in paths)}", f"copied {', '.join(copied)} from {hf_config_dir}"]


def write_hf_by_layer(layers, arch: io.Architecture, value_model: bool, out_dir: Path, what: str) -> list[Path]:
    """Writes megatron tensors given one layer (a `layer_of` group) at a time as HF safetensors
    shards in `out_dir`; every HF tensor of the architecture must come (ConversionError naming
    `what` and the absent ones otherwise). The shard paths."""
    mapping = family_mapping(arch, value_model)
    expected = set(mapping.renames) | {name for _, hf_names, _, _ in mapping.fused for name in hf_names}
    writer = io.HFShardWriter(Path(out_dir))
    written: set[str] = set()
    for layer in layers:
        hf = megatron_to_hf(layer, arch, value_model, partial=True)
        writer.add(hf)
        written |= set(hf)
    absent = sorted(expected - written)
    if absent:
        raise ConversionError(f"{what} no tensor for HF {absent[:5]}")
    return writer.close()
