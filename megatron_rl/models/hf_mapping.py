"""Hugging Face <-> Megatron state dicts: one declarative table per family plus named transforms.

Names are HF's on-disk safetensors names (per-expert tensors, as released checkpoints store
them) and megatron's local-spec GPTModel names, for full (unsharded) tensors. `{L}` is a layer
index, `{E}` an expert index. Fused tensors are built by small transforms:

- `fuse_qkv` / `split_qkv`: megatron's linear_qkv stacks, per query group, that group's query
  heads, then its key head, then its value head (GQA interleaving);
- `fuse_gate_up` / `split_gate_up`: linear_fc1 is [gate; up].

A value model (critic) has no lm_head; its head is `value_head.weight` / `value_head.bias` on
both sides so it round-trips. `MegatronStateFromHF` is the same conversion done lazily, a tensor
when it is asked for (loading and converting without a copy of the model).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from megatron_rl.config import Architecture

# One-to-one renames, per layer.
LAYER_RENAMES = {
    "model.layers.{L}.input_layernorm.weight": "decoder.layers.{L}.input_layernorm.weight",
    "model.layers.{L}.self_attn.o_proj.weight": "decoder.layers.{L}.self_attention.linear_proj.weight",
    "model.layers.{L}.post_attention_layernorm.weight": "decoder.layers.{L}.pre_mlp_layernorm.weight",
}
QK_NORM_RENAMES = {
    "model.layers.{L}.self_attn.q_norm.weight": "decoder.layers.{L}.self_attention.q_layernorm.weight",
    "model.layers.{L}.self_attn.k_norm.weight": "decoder.layers.{L}.self_attention.k_layernorm.weight",
}
DENSE_MLP_RENAMES = {"model.layers.{L}.mlp.down_proj.weight": "decoder.layers.{L}.mlp.linear_fc2.weight"}
MOE_RENAMES = {
    "model.layers.{L}.mlp.gate.weight": "decoder.layers.{L}.mlp.router.weight",
    "model.layers.{L}.mlp.experts.{E}.down_proj.weight": "decoder.layers.{L}.mlp.experts.local_experts.{E}.linear_fc2.weight",
}
GLOBAL_RENAMES = {
    "model.embed_tokens.weight": "embedding.word_embeddings.weight",
    "model.norm.weight": "decoder.final_layernorm.weight",
}
OUTPUT_RENAMES = {"lm_head.weight": "output_layer.weight"}
VALUE_HEAD_RENAMES = {"value_head.weight": "value_head.weight", "value_head.bias": "value_head.bias"}

# Fused tensors: megatron name <- HF names, with the transform pair that joins and splits them.
QKV = (
    "decoder.layers.{L}.self_attention.linear_qkv.weight",
    (
        "model.layers.{L}.self_attn.q_proj.weight",
        "model.layers.{L}.self_attn.k_proj.weight",
        "model.layers.{L}.self_attn.v_proj.weight",
    ),
)
DENSE_FC1 = (
    "decoder.layers.{L}.mlp.linear_fc1.weight",
    ("model.layers.{L}.mlp.gate_proj.weight", "model.layers.{L}.mlp.up_proj.weight"),
)
EXPERT_FC1 = (
    "decoder.layers.{L}.mlp.experts.local_experts.{E}.linear_fc1.weight",
    ("model.layers.{L}.mlp.experts.{E}.gate_proj.weight", "model.layers.{L}.mlp.experts.{E}.up_proj.weight"),
)


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, arch: Architecture) -> torch.Tensor:
    """[q heads of group g; k_g; v_g] for each query group g -> [(H + 2G) * d, hidden]."""
    groups, d = arch.num_key_value_heads, arch.kv_channels
    per_group = arch.num_attention_heads // groups
    hidden = q.shape[-1]
    fused = torch.cat(
        [
            q.reshape(groups, per_group * d, hidden),
            k.reshape(groups, d, hidden),
            v.reshape(groups, d, hidden),
        ],
        dim=1,
    )
    return fused.reshape(-1, hidden)


def split_qkv(qkv: torch.Tensor, arch: Architecture) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    groups, d = arch.num_key_value_heads, arch.kv_channels
    per_group = arch.num_attention_heads // groups
    hidden = qkv.shape[-1]
    q, k, v = qkv.reshape(groups, (per_group + 2) * d, hidden).split([per_group * d, d, d], dim=1)
    return q.reshape(-1, hidden), k.reshape(-1, hidden), v.reshape(-1, hidden)


def fuse_gate_up(gate: torch.Tensor, up: torch.Tensor, arch: Architecture | None = None) -> torch.Tensor:
    return torch.cat([gate, up], dim=0)


def split_gate_up(fc1: torch.Tensor, arch: Architecture | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    gate, up = fc1.chunk(2, dim=0)
    return gate, up


@dataclass(frozen=True)
class FamilyMapping:
    """Everything needed to convert one family, expanded for one architecture."""

    renames: dict[str, str]  # HF name -> megatron name
    fused: list[tuple[str, tuple[str, ...], object, object]]  # (megatron, HF names, fuse, split)


def family_mapping(arch: Architecture, value_model: bool = False) -> FamilyMapping:
    """The name table for `arch` with every {L} and {E} filled in."""
    renames: dict[str, str] = dict(GLOBAL_RENAMES)
    if value_model:
        renames.update(VALUE_HEAD_RENAMES)
    elif not arch.tie_word_embeddings:
        renames.update(OUTPUT_RENAMES)
    layer_tables = [LAYER_RENAMES] + ([QK_NORM_RENAMES] if arch.qk_norm else [])
    layer_tables.append(MOE_RENAMES if arch.num_experts else DENSE_MLP_RENAMES)
    fused_templates = [(QKV, fuse_qkv, split_qkv)]
    fused_templates.append(
        (EXPERT_FC1, fuse_gate_up, split_gate_up)
        if arch.num_experts
        else (DENSE_FC1, fuse_gate_up, split_gate_up)
    )
    experts = range(arch.num_experts) if arch.num_experts else [None]
    fused = []
    for layer in range(arch.num_layers):
        for table in layer_tables:
            for hf, mg in table.items():
                for expert in experts if "{E}" in hf else [None]:
                    renames[_fill(hf, layer, expert)] = _fill(mg, layer, expert)
        for (mg, hf_names), fuse, split in fused_templates:
            for expert in experts if "{E}" in mg else [None]:
                fused.append(
                    (_fill(mg, layer, expert), tuple(_fill(h, layer, expert) for h in hf_names), fuse, split)
                )
    return FamilyMapping(renames, fused)


def _fill(template: str, layer: int, expert: int | None) -> str:
    name = template.replace("{L}", str(layer))
    return name.replace("{E}", str(expert)) if expert is not None else name


class ConversionError(ValueError):
    """A tensor is missing, unexpected or of the wrong shape; the message names it."""


class MegatronStateFromHF(Mapping):
    """The full megatron state dict of an HF state dict, one tensor at a time, when asked: a
    renamed tensor is the HF tensor itself (no copy), a fused one (qkv, gate/up) is built then.
    `hf` may be lazy (memory-mapped safetensors): a reader touches only what it asks for.
    Raises at construction when the HF checkpoint holds tensors the mapping does not use, and on
    access when a tensor it needs is missing."""

    def __init__(self, hf: Mapping[str, torch.Tensor], arch: Architecture, value_model: bool = False):
        self._hf, self._arch = hf, arch
        mapping = family_mapping(arch, value_model)
        self._sources: dict[str, tuple[tuple[str, ...], object]] = {}
        for hf_name, mg_name in mapping.renames.items():
            if hf_name in VALUE_HEAD_RENAMES and hf_name not in hf:
                continue  # a backbone without a head: the value head keeps its initialisation
            self._sources[mg_name] = ((hf_name,), None)
        for mg_name, hf_names, fuse, _ in mapping.fused:
            self._sources[mg_name] = (hf_names, fuse)
        used = {name for names, _ in self._sources.values() for name in names}
        ignorable = {"lm_head.weight"} if value_model or arch.tie_word_embeddings else set()
        unused = sorted(set(hf) - used - ignorable)
        if unused:
            raise ConversionError(
                f"HF checkpoint has tensors the {arch.family} mapping does not use: {unused[:5]}"
            )

    def _take(self, name: str) -> torch.Tensor:
        if name not in self._hf:
            raise ConversionError(
                f"HF checkpoint has no tensor {name!r} (needed for a {self._arch.family} model)"
            )
        return self._hf[name]

    def __getitem__(self, name: str) -> torch.Tensor:
        hf_names, fuse = self._sources[name]
        tensors = [self._take(n) for n in hf_names]
        return tensors[0] if fuse is None else fuse(*tensors, self._arch)

    def concatenated_parts(self, name: str) -> list[torch.Tensor] | None:
        """The HF tensors whose concatenation along axis 0 is megatron tensor `name` (gate and
        up for a gated linear_fc1), or None when it is not such a concatenation."""
        hf_names, fuse = self._sources[name]
        return [self._take(n) for n in hf_names] if fuse is fuse_gate_up else None

    def __iter__(self) -> Iterator[str]:
        return iter(self._sources)

    def __len__(self) -> int:
        return len(self._sources)

    def __contains__(self, name) -> bool:
        return name in self._sources


def hf_to_megatron(
    hf: Mapping[str, torch.Tensor], arch: Architecture, value_model: bool = False
) -> dict[str, torch.Tensor]:
    """Full megatron state dict from a full HF state dict (every HF tensor must be used)."""
    lazy = MegatronStateFromHF(hf, arch, value_model)
    return {name: lazy[name] for name in lazy}


def megatron_to_hf(
    mg: dict[str, torch.Tensor], arch: Architecture, value_model: bool = False, partial: bool = False
) -> dict[str, torch.Tensor]:
    """HF state dict (on-disk names) from a full megatron state dict. With `partial`, tensors
    absent from `mg` are skipped (one pipeline stage's or expert rank's share)."""
    mapping = family_mapping(arch, value_model)
    out: dict[str, torch.Tensor] = {}
    for hf_name, mg_name in mapping.renames.items():
        if mg_name not in mg:
            if partial:
                continue
            raise ConversionError(
                f"megatron checkpoint has no tensor {mg_name!r} (needed for HF {hf_name!r})"
            )
        out[hf_name] = mg[mg_name]
    for mg_name, hf_names, _, split in mapping.fused:
        if mg_name not in mg:
            if partial:
                continue
            raise ConversionError(f"megatron checkpoint has no tensor {mg_name!r}")
        for name, tensor in zip(hf_names, split(mg[mg_name], arch)):
            out[name] = tensor.contiguous()
    return out
