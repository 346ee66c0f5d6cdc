"""Core attention for the local (non-TransformerEngine) layer spec that accepts packed THD input.

Megatron's local DotProductAttention refuses packed sequences. PackedDotProductAttention runs
causal SDPA per `cu_seqlens` segment (a loop over sequences, never over tokens), with GQA, and
also serves plain [seq, batch] input. UlyssesAttention adds context parallelism over megatron's
CP group (parallel/ulysses.py) and applies RoPE itself. `packed_seq_params(cu_seqlens, total)` builds the THD parameters; padding
after the last sequence becomes its own segment so RoPE and attention keep every position.
"""

from __future__ import annotations

import math

import megatron_rl.compat  # noqa: F401  (megatron-core on CPU needs its patches first)

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.module import MegatronModule

from megatron_rl.parallel import ulysses


def packed_seq_params(cu_seqlens: torch.Tensor, total_tokens: int | None = None) -> PackedSeqParams:
    """THD parameters for sequences packed end to end; a tail of padding becomes a segment."""
    cu = torch.as_tensor(cu_seqlens, dtype=torch.int32)
    if total_tokens is not None and int(cu[-1]) < total_tokens:
        cu = torch.cat([cu, cu.new_tensor([total_tokens])])
    longest = int((cu[1:] - cu[:-1]).max())
    return PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest
    )


class PackedDotProductAttention(MegatronModule):
    """Causal attention over [seq, batch, heads, dim] or packed [tokens, heads, dim] input; the
    value heads may have another size than the query/key heads (multi-latent attention), the
    output then has the value's."""

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type=None,
        attention_type: str = "self",
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
        **kwargs,
    ):
        super().__init__(config=config)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.softmax_scale = softmax_scale or config.softmax_scale or 1.0 / math.sqrt(config.kv_channels)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [b, heads, s, d], k/v [b, groups, s, d] -> [b, heads, s, d], causal."""
        repeat = q.shape[1] // k.shape[1]
        if repeat > 1:
            k = k.repeat_interleave(repeat, dim=1)
            v = v.repeat_interleave(repeat, dim=1)
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            is_causal=True,
            dropout_p=self.dropout if self.training else 0.0,
            scale=self.softmax_scale,
        )

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):  # fmt: skip  (megatron's core-attention signature)
        if attention_bias is not None:
            raise ValueError("PackedDotProductAttention: attention_bias is not supported")
        if packed_seq_params is None:  # [s, b, h, d]
            out = self._attend(query.permute(1, 2, 0, 3), key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3))
            s, b = query.shape[0], query.shape[1]
            return out.permute(2, 0, 1, 3).reshape(s, b, -1)
        cu = packed_seq_params.cu_seqlens_q.tolist()
        # [tokens, heads, v head dim]: multi-latent attention's v heads differ from its q/k heads
        out = query.new_empty((*query.shape[:-1], value.shape[-1]))
        for start, end in zip(cu[:-1], cu[1:]):  # one causal block per packed sequence
            seg = slice(start, end)
            out[seg] = self._attend(
                query[seg].transpose(0, 1)[None],
                key[seg].transpose(0, 1)[None],
                value[seg].transpose(0, 1)[None],
            )[0].transpose(0, 1)
        return out.reshape(out.shape[0], -1)


class UlyssesAttention(PackedDotProductAttention):
    """Core attention over the CP group for packed THD input; RoPE applied here (see module doc)."""

    def __init__(self, config, layer_number: int, *args, rotary_base: float = 10000.0, **kwargs):
        super().__init__(config, layer_number, *args, **kwargs)
        self.rotary_base = rotary_base

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):  # fmt: skip  (megatron's core-attention signature)
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            raise ValueError("UlyssesAttention (context parallel) needs packed THD input with cu_seqlens")
        group = parallel_state.get_context_parallel_group()
        cp = torch.distributed.get_world_size(group)
        heads, groups = query.shape[1], key.shape[1]
        if heads % cp:
            raise ValueError(f"{heads} attention heads per TP rank are not divisible by cp {cp}")
        if groups % cp:
            if cp % groups:
                raise ValueError(f"{groups} KV heads per TP rank and cp {cp}: one must divide the other")
            # Fewer KV heads than CP ranks: repeat so each rank gets the group its queries use.
            key = key.repeat_interleave(cp // groups, dim=1)
            value = value.repeat_interleave(cp // groups, dim=1)
        q = ulysses.sequence_to_heads(query, group)
        k = ulysses.sequence_to_heads(key, group)
        v = ulysses.sequence_to_heads(value, group)
        cu = packed_seq_params.cu_seqlens_q
        if int(cu[-1]) != q.shape[0]:
            raise ValueError(
                f"cu_seqlens cover {int(cu[-1])} tokens but the CP-gathered sequence has {q.shape[0]}"
            )
        positions = ulysses.sequence_positions(cu, q.device)
        q, k = (
            ulysses.apply_rope(q, positions, self.rotary_base),
            ulysses.apply_rope(k, positions, self.rotary_base),
        )
        out = super().forward(q, k, v, packed_seq_params=packed_seq_params)  # [T, heads/cp * d]
        out = ulysses.heads_to_sequence(out.reshape(q.shape[0], q.shape[1], -1), group)
        return out.reshape(out.shape[0], -1)
