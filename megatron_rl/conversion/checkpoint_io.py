"""Reading and writing HF safetensors directories and megatron_rl's converted checkpoints.

A converted checkpoint directory holds:
    megatron_rl.json   {"format": 1, "architecture": {...}, "value_model": bool, "source": str}
    model/             a megatron dist_checkpointing checkpoint (reshardable to any TP/PP/EP)
    hf/                config.json and tokenizer files of the source, for the way back
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megatron_rl.config import Architecture

META_FILE = "megatron_rl.json"
MODEL_DIR = "model"
HF_DIR = "hf"
FORMAT = 1
_HF_SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)


class CheckpointError(ValueError):
    """A checkpoint or HF directory that cannot be read; the message names the file."""


def read_architecture(hf_directory: Path) -> Architecture:
    path = Path(hf_directory) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: missing (an HF model directory needs config.json)")
    return Architecture.from_hf_config(json.loads(path.read_text()), str(path))


def read_hf_state_dict(directory: Path) -> dict[str, torch.Tensor]:
    """All tensors of an HF directory (model.safetensors or an index of shards), memory-mapped:
    safetensors maps each file, so a tensor's bytes are read (into the page cache, not the
    process's own memory) only when it is used."""
    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (directory / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise CheckpointError(f"{directory}: no model.safetensors or model.safetensors.index.json")
    state: dict[str, torch.Tensor] = {}
    for name in files:
        path = directory / name
        if not path.is_file():
            raise CheckpointError(f"{path}: listed in the index but missing")
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                state[key] = f.get_tensor(key)
    return state


class HFShardWriter:
    """Writes HF safetensors shards as tensors arrive, holding at most one shard in memory:
    `add` groups of tensors, then `close` names the files (`model.safetensors` when one shard,
    `model-0000i-of-0000n.safetensors` plus the index otherwise) and returns their paths."""

    def __init__(self, directory: Path, max_shard_bytes: int = 4 << 30):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._written: list[tuple[Path, list[str]]] = []
        self.total_bytes = 0

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        for name in sorted(tensors):
            tensor = tensors[name].contiguous()
            if self._pending and self._pending_bytes + tensor.nbytes > self.max_shard_bytes:
                self._flush()
            self._pending[name] = tensor
            self._pending_bytes += tensor.nbytes
            self.total_bytes += tensor.nbytes

    def _flush(self) -> None:
        path = self.directory / f"model-{len(self._written) + 1:05d}.safetensors.partial"
        save_file(self._pending, str(path), metadata={"format": "pt"})
        self._written.append((path, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> list[Path]:
        if self._pending or not self._written:
            self._flush()
        count = len(self._written)
        if count == 1:
            names = ["model.safetensors"]
        else:
            names = [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
        paths, weight_map = [], {}
        for (partial, tensor_names), name in zip(self._written, names):
            partial.rename(self.directory / name)
            paths.append(self.directory / name)
            weight_map.update({tensor: name for tensor in tensor_names})
        if count > 1:
            (self.directory / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}, indent=2)
            )
        return paths


def write_hf_state_dict(
    state: dict[str, torch.Tensor], directory: Path, max_shard_bytes: int = 4 << 30
) -> list[Path]:
    """Writes safetensors shards (with an index when more than one) and returns their paths."""
    writer = HFShardWriter(directory, max_shard_bytes)
    writer.add(state)
    return writer.close()


def copy_hf_side_files(source: Path, destination: Path) -> list[str]:
    """Copies config and tokenizer files that exist in `source`."""
    destination.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in _HF_SIDE_FILES:
        if (Path(source) / name).is_file():
            shutil.copy2(Path(source) / name, destination / name)
            copied.append(name)
    return copied


def write_meta(directory: Path, arch: Architecture, value_model: bool, source: str) -> None:
    meta = {"format": FORMAT, "architecture": arch.model_dump(), "value_model": value_model, "source": source}
    (Path(directory) / META_FILE).write_text(json.dumps(meta, indent=2))


def read_meta(directory: Path) -> dict:
    path = Path(directory) / META_FILE
    if not path.is_file():
        raise CheckpointError(f"{path}: missing; not a checkpoint written by tools/convert_hf_to_megatron.py")
    meta = json.loads(path.read_text())
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {meta.get('format')!r}, expected {FORMAT}")
    return meta
