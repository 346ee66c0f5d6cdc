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

import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch

from megatron_rl.config import Architecture

# One-to-one renames, per layer.
INPUT_NORM_RENAMES = {"model.layers.{L}.input_layernorm.weight": "decoder.layers.{L}.input_layernorm.weight"}
ATTENTION_OUTPUT_RENAMES = {
    "model.layers.{L}.self_attn.o_proj.weight": "decoder.layers.{L}.self_attention.linear_proj.weight",
    "model.layers.{L}.post_attention_layernorm.weight": "decoder.layers.{L}.pre_mlp_layernorm.weight",
}
QK_NORM_RENAMES = {
    "model.layers.{L}.self_attn.q_norm.weight": "decoder.layers.{L}.self_attention.q_layernorm.weight",
    "model.layers.{L}.self_attn.k_norm.weight": "decoder.layers.{L}.self_attention.k_layernorm.weight",
}
# Multi-latent attention (DeepSeek-V3): the low-rank query (q_a/q_b, or one q_proj without
# q_lora_rank) and key/value projections and their latents' norms. The q projections' and kv_a's
# rows hold RoPE channels (`ROPE_ROWS`), reordered when the checkpoint interleaves them.
LATENT_QUERY_RENAMES = {
    "model.layers.{L}.self_attn.q_a_proj.weight": "decoder.layers.{L}.self_attention.linear_q_down_proj.weight",
    "model.layers.{L}.self_attn.q_a_layernorm.weight": "decoder.layers.{L}.self_attention.q_layernorm.weight",
}
LATENT_KV_RENAMES = {
    "model.layers.{L}.self_attn.kv_a_layernorm.weight": "decoder.layers.{L}.self_attention.kv_layernorm.weight",
    "model.layers.{L}.self_attn.kv_b_proj.weight": "decoder.layers.{L}.self_attention.linear_kv_up_proj.weight",
}
LATENT_Q_UP = ("model.layers.{L}.self_attn.q_b_proj.weight", "decoder.layers.{L}.self_attention.linear_q_up_proj.weight")
LATENT_Q = ("model.layers.{L}.self_attn.q_proj.weight", "decoder.layers.{L}.self_attention.linear_q_proj.weight")
LATENT_KV_DOWN = (
    "model.layers.{L}.self_attn.kv_a_proj_with_mqa.weight",
    "decoder.layers.{L}.self_attention.linear_kv_down_proj.weight",
)
DENSE_MLP_RENAMES = {"model.layers.{L}.mlp.down_proj.weight": "decoder.layers.{L}.mlp.linear_fc2.weight"}
ROUTER_RENAMES = {"model.layers.{L}.mlp.gate.weight": "decoder.layers.{L}.mlp.router.weight"}
# The sigmoid router's per-expert bias: a buffer on both sides (a walk over parameters misses it).
EXPERT_BIAS_RENAMES = {
    "model.layers.{L}.mlp.gate.e_score_correction_bias": "decoder.layers.{L}.mlp.router.expert_bias"
}
SHARED_EXPERT_RENAMES = {
    "model.layers.{L}.mlp.shared_experts.down_proj.weight": "decoder.layers.{L}.mlp.shared_experts.linear_fc2.weight"
}
EXPERT_RENAMES = {
    "model.layers.{L}.mlp.experts.{E}.down_proj.weight": "decoder.layers.{L}.mlp.experts.local_experts.{E}.linear_fc2.weight",
}
EMBEDDING_RENAMES = {"model.embed_tokens.weight": "embedding.word_embeddings.weight"}
FINAL_NORM_RENAMES = {"model.norm.weight": "decoder.final_layernorm.weight"}
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
QKV_BIAS = (
    "decoder.layers.{L}.self_attention.linear_qkv.bias",
    (
        "model.layers.{L}.self_attn.q_proj.bias",
        "model.layers.{L}.self_attn.k_proj.bias",
        "model.layers.{L}.self_attn.v_proj.bias",
    ),
)
DENSE_FC1 = (
    "decoder.layers.{L}.mlp.linear_fc1.weight",
    ("model.layers.{L}.mlp.gate_proj.weight", "model.layers.{L}.mlp.up_proj.weight"),
)
SHARED_EXPERT_FC1 = (
    "decoder.layers.{L}.mlp.shared_experts.linear_fc1.weight",
    ("model.layers.{L}.mlp.shared_experts.gate_proj.weight", "model.layers.{L}.mlp.shared_experts.up_proj.weight"),
)
EXPERT_FC1 = (
    "decoder.layers.{L}.mlp.experts.local_experts.{E}.linear_fc1.weight",
    ("model.layers.{L}.mlp.experts.{E}.gate_proj.weight", "model.layers.{L}.mlp.experts.{E}.up_proj.weight"),
)


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, arch: Architecture) -> torch.Tensor:
    """[q heads of group g; k_g; v_g] for each query group g -> [(H + 2G) * d, hidden] (weights),
    [(H + 2G) * d] (biases)."""
    if q.dim() == 1:
        return fuse_qkv(q[:, None], k[:, None], v[:, None], arch)[:, 0]
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
    if qkv.dim() == 1:
        return tuple(part[:, 0] for part in split_qkv(qkv[:, None], arch))
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


def _pairs_to_halves(rows: int, arch: Architecture, per_head: bool) -> torch.Tensor:
    """Row indices that put each head's RoPE channels (the last qk_rope_head_dim of a query head,
    or of kv_a's rows when not `per_head`) from interleaved pairs (x0, x1), (x2, x3), ... into
    halves (x0, x2, ... | x1, x3, ...)."""
    rope = arch.qk_rope_head_dim
    block = arch.kv_channels if per_head else rows
    order = torch.arange(rows).reshape(-1, block)
    tail = order[:, block - rope :]
    order[:, block - rope :] = torch.cat([tail[:, 0::2], tail[:, 1::2]], dim=1)
    return order.reshape(-1)


# megatron's MLA rotates RoPE channels stored as interleaved pairs (it takes x[0::2] and x[1::2]
# as the halves it rotates: rope_utils._apply_rotary_pos_emb_bshd), as DeepSeek's checkpoints
# store them (HF rope_interleave). A checkpoint whose RoPE channels are halves (rope_interleave
# false, transformers' rotate_half) has them interleaved on the way in and taken apart on the way out.
def rope_halves_to_pairs_per_head(weight: torch.Tensor, arch: Architecture) -> torch.Tensor:
    """A query projection's rows [heads * (nope + rope), in] with each head's RoPE channels
    reordered from halves to interleaved pairs (an HF q_b_proj / q_proj -> megatron)."""
    return weight[torch.argsort(_pairs_to_halves(weight.shape[0], arch, per_head=True))]


def rope_pairs_to_halves_per_head(weight: torch.Tensor, arch: Architecture) -> tuple[torch.Tensor]:
    """The inverse of `rope_halves_to_pairs_per_head`."""
    return (weight[_pairs_to_halves(weight.shape[0], arch, per_head=True)],)


def rope_halves_to_pairs_in_latent(weight: torch.Tensor, arch: Architecture) -> torch.Tensor:
    """kv_a_proj_with_mqa's rows [kv_lora_rank + rope, in] with the shared key's RoPE channels
    (the last ones) reordered from halves to interleaved pairs."""
    return weight[torch.argsort(_pairs_to_halves(weight.shape[0], arch, per_head=False))]


def rope_pairs_to_halves_in_latent(weight: torch.Tensor, arch: Architecture) -> tuple[torch.Tensor]:
    """The inverse of `rope_halves_to_pairs_in_latent`."""
    return (weight[_pairs_to_halves(weight.shape[0], arch, per_head=False)],)


@dataclass(frozen=True)
class MappedTensor:
    """One megatron tensor and the HF tensors it is made of: one (a rename), or several joined
    by `fuse(*hf_tensors, arch)` and taken apart by `split(megatron_tensor, arch)`."""

    megatron: str
    hf: tuple[str, ...]
    fuse: Callable | None = None
    split: Callable | None = None


def _renamed(table: dict[str, str]) -> list[MappedTensor]:
    return [MappedTensor(mg, (hf,)) for hf, mg in table.items()]


def layer_templates(arch: Architecture, layer: int) -> tuple[list[MappedTensor], list[MappedTensor]]:
    """(decoder layer `layer`'s tensors except experts, one expert's tensors) with `{L}` and `{E}`
    unfilled, in the order a layer is published: a module of vLLM's processes its tensors only
    once it has all of them (q/k/v, gate/up, and every expert of a fused MoE layer), so each
    module's tensors travel together and each expert's gate, up and down together. An MoE
    model's first `first_k_dense_layers` layers are dense."""
    attention = [
        *_renamed(INPUT_NORM_RENAMES),
        *(latent_attention_templates(arch) if arch.multi_latent_attention else [
            MappedTensor(*QKV, fuse_qkv, split_qkv),
            *([MappedTensor(*QKV_BIAS, fuse_qkv, split_qkv)] if arch.attention_bias else []),
            *(_renamed(QK_NORM_RENAMES) if arch.qk_norm else []),
        ]),
        *_renamed(ATTENTION_OUTPUT_RENAMES),
    ]  # fmt: skip
    if layer not in arch.moe_layers:
        return [
            *attention,
            MappedTensor(*DENSE_FC1, fuse_gate_up, split_gate_up),
            *_renamed(DENSE_MLP_RENAMES),
        ], []
    router = [*_renamed(ROUTER_RENAMES), *(_renamed(EXPERT_BIAS_RENAMES) if arch.moe_expert_bias else [])]
    shared = []
    if arch.shared_expert_intermediate_size:
        shared = [MappedTensor(*SHARED_EXPERT_FC1, fuse_gate_up, split_gate_up), *_renamed(SHARED_EXPERT_RENAMES)]
    expert = [MappedTensor(*EXPERT_FC1, fuse_gate_up, split_gate_up), *_renamed(EXPERT_RENAMES)]
    return [*attention, *router, *shared], expert


def latent_attention_templates(arch: Architecture) -> list[MappedTensor]:
    """Multi-latent attention's tensors of a layer (`{L}` unfilled): renames, except the
    projections holding RoPE rows when the checkpoint stores them as halves (`rope_halves`)."""

    def rows(hf_and_megatron: tuple[str, str], to_pairs, to_halves) -> MappedTensor:
        hf, megatron = hf_and_megatron
        return MappedTensor(megatron, (hf,), to_pairs, to_halves) if arch.rope_halves else MappedTensor(megatron, (hf,))

    query_up = (rope_halves_to_pairs_per_head, rope_pairs_to_halves_per_head)
    if arch.q_lora_rank is None:
        query = [rows(LATENT_Q, *query_up)]
    else:
        query = [*_renamed(LATENT_QUERY_RENAMES), rows(LATENT_Q_UP, *query_up)]
    kv_down = rows(LATENT_KV_DOWN, rope_halves_to_pairs_in_latent, rope_pairs_to_halves_in_latent)
    return [*query, kv_down, *_renamed(LATENT_KV_RENAMES)]


@dataclass(frozen=True)
class FamilyMapping:
    """Everything needed to convert one family, expanded for one architecture: `tensors` in
    publishing order (the embeddings, each decoder layer in turn, with each expert's tensors
    together, then the final norm and the output layer or value head)."""

    tensors: list[MappedTensor]

    @property
    def renames(self) -> dict[str, str]:
        """HF name -> megatron name of the one-to-one tensors."""
        return {t.hf[0]: t.megatron for t in self.tensors if t.fuse is None}

    @property
    def fused(self) -> list[tuple[str, tuple[str, ...], Callable, Callable]]:
        """(megatron name, HF names, fuse, split) of the fused tensors."""
        return [(t.megatron, t.hf, t.fuse, t.split) for t in self.tensors if t.fuse is not None]


def family_mapping(arch: Architecture, value_model: bool = False) -> FamilyMapping:
    """The name table for `arch` with every {L} and {E} filled in, in publishing order."""
    tensors = _renamed(EMBEDDING_RENAMES)
    for layer in range(arch.num_layers):
        per_layer, per_expert = layer_templates(arch, layer)
        tensors += [_filled(t, layer, None) for t in per_layer]
        for expert in range(arch.num_experts if per_expert else 0):
            tensors += [_filled(t, layer, expert) for t in per_expert]
    tensors += _renamed(FINAL_NORM_RENAMES)
    if value_model:
        tensors += _renamed(VALUE_HEAD_RENAMES)
    elif not arch.tie_word_embeddings:
        tensors += _renamed(OUTPUT_RENAMES)
    return FamilyMapping(tensors)


def _filled(template: MappedTensor, layer: int, expert: int | None) -> MappedTensor:
    return MappedTensor(
        _fill(template.megatron, layer, expert),
        tuple(_fill(h, layer, expert) for h in template.hf),
        template.fuse,
        template.split,
    )


def decoder_layer_of(hf_name: str) -> int | None:
    """The decoder layer `L` of an HF tensor named `model.layers.{L}.…`; None for the others
    (embeddings, final norm, output layer, value head)."""
    match = _LAYER_NAME.match(hf_name)
    return int(match.group(1)) if match else None


_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.")


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
        for tensor in mapping.tensors:
            if tensor.hf[0] in VALUE_HEAD_RENAMES and tensor.hf[0] not in hf:
                continue  # a backbone without a head: the value head keeps its initialisation
            self._sources[tensor.megatron] = (tensor.hf, tensor.fuse)
        used = {name for names, _ in self._sources.values() for name in names}
        ignorable = {"lm_head.weight"} if value_model or arch.tie_word_embeddings else set()
        # multi-token-prediction layers after the decoder's (released GLM-4.5 checkpoints) are dropped
        mtp = range(arch.num_layers, arch.num_layers + arch.mtp_layers)
        ignorable |= {name for name in hf if decoder_layer_of(name) in mtp}
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
    """HF state dict (on-disk names) from a full megatron state dict, in publishing order
    (`family_mapping`). With `partial`, tensors absent from `mg` are skipped (one pipeline stage's
    or expert rank's share)."""
    out: dict[str, torch.Tensor] = {}
    for mapped in family_mapping(arch, value_model).tensors:
        if mapped.megatron not in mg:
            if partial:
                continue
            raise ConversionError(
                f"megatron checkpoint has no tensor {mapped.megatron!r} (needed for HF {list(mapped.hf)})"
            )
        tensor = mg[mapped.megatron]
        if mapped.split is None:
            out[mapped.hf[0]] = tensor
            continue
        for name, part in zip(mapped.hf, mapped.split(tensor, arch), strict=True):
            out[name] = part.contiguous()
    return out
