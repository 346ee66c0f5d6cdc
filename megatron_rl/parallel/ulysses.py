"""Ulysses context parallelism for packed (THD) sequences, on any backend (gloo or NCCL).

Each CP rank holds a contiguous slice of the packed row (bins are padded to a multiple of CP).
Attention all-to-alls over megatron's CP group: sequence-sharded, all heads in ->
full sequence, heads/cp out; attention runs per packed sequence over the full sequence; a second
all-to-all returns to sequence shards. Megatron's own RoPE assumes its zigzag CP layout, so with
CP > 1 the model is built without position embeddings and RoPE is applied after the all-to-all
with per-sequence positions from the global `cu_seqlens` (models.attention.UlyssesAttention).
This module holds the differentiable all-to-alls and that RoPE.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def sequence_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """Differentiable [t, H, d] per CP rank -> [cp * t, H / cp, d]."""
    return _SequenceToHeads.apply(x.contiguous(), group)


def heads_to_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """Differentiable inverse of sequence_to_heads."""
    return _HeadsToSequence.apply(x.contiguous(), group)


class _SequenceToHeads(torch.autograd.Function):
    """[t, H, d] on each of cp ranks -> [cp * t, H / cp, d] (full sequence, a slice of heads)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _seq_to_heads(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad.contiguous(), ctx.group), None


class _HeadsToSequence(torch.autograd.Function):
    """Inverse of _SequenceToHeads."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _heads_to_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad.contiguous(), ctx.group), None


def _seq_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    cp = dist.get_world_size(group)
    t, heads, d = x.shape
    # chunk j (sent to rank j) = my tokens, head slice j
    send = x.reshape(t, cp, heads // cp, d).transpose(0, 1).contiguous().reshape(cp * t, heads // cp, d)
    out = torch.empty_like(send)
    dist.all_to_all_single(out, send, group=group)
    return out  # chunk j (from rank j) = rank j's tokens, my head slice: the sequence in order


def _heads_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    cp = dist.get_world_size(group)
    total, heads_local, d = x.shape
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x.contiguous(), group=group)
    t = total // cp
    return out.reshape(cp, t, heads_local, d).transpose(0, 1).reshape(t, cp * heads_local, d)


def sequence_positions(cu_seqlens: torch.Tensor, device=None) -> torch.Tensor:
    """Position of every token within its packed sequence, [cu_seqlens[-1]] int64."""
    cu = cu_seqlens.to(torch.int64)
    lengths = cu[1:] - cu[:-1]
    starts = torch.repeat_interleave(cu[:-1], lengths)
    return (torch.arange(int(cu[-1]), device=device) - starts.to(device)).to(torch.int64)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Non-interleaved (rotate-half) RoPE on [t, heads, d] with integer positions [t]."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d))
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)[:, None, :]
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    first, second = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-second, first], dim=-1) * sin
