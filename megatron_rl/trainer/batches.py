"""A MicroBatch as the tensors one rank feeds its model: next-token aligned, CP-sliced.

Output position p of a causal model predicts token p + 1, and a value head at p gives the value
of the state before token p + 1. So every per-token target is shifted left by one on the full
packed row (the last position of each sequence gets no target), then this CP rank takes its
contiguous slice. Losses are sums over these tokens; megatron divides the gradients by the
global sum of each micro-batch's `normaliser` (the action-token count unless a loss
aggregation sets it; `calculate_per_token_loss`).

A position p belongs to the sequence holding p (its target p + 1 is in the same sequence: the
last position of a sequence has no target). `sequence_of_token` numbers the row's sequences
0..S-1, with the padding tail as sequence S-1 when there is one; `owned_sequences` marks those
whose first token lies in this CP rank's slice, so per-sequence counts summed over ranks count
each sequence once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from megatron_rl import compat
from megatron_rl.data.types import MicroBatch


@dataclass
class RankBatch:
    input_ids: torch.Tensor  # [1, n] this CP rank's slice
    position_ids: torch.Tensor  # [1, n]
    cu_seqlens: torch.Tensor  # [S + 1] of the full row (padding tail included as a segment)
    total_tokens: int
    targets: torch.Tensor  # [n] next token
    loss_mask: torch.Tensor  # [n] bool: the next token is an action
    advantages: torch.Tensor  # [n] of the next token
    returns: torch.Tensor
    old_values: torch.Tensor
    old_logprobs: torch.Tensor  # the ratio's denominator: the sampler's, or recomputed (policy/update.py)
    sampler_logprobs: torch.Tensor  # [n] the sampler's log-prob of the next token
    sequence_of_token: torch.Tensor  # [n] int64: the sequence (of the full row) each position is in
    owned_sequences: torch.Tensor  # [S] bool: the sequence's first token is on this CP rank
    minibatch: int = 0
    ref_logprobs: torch.Tensor | None = None  # the reference policy's, when KL is configured
    # Per-token factors of the loss (None: 1): the loss aggregation's, and the rollout correction's
    # importance weights (policy loss only).
    aggregation_weights: torch.Tensor | None = None
    correction_weights: torch.Tensor | None = None
    normaliser: int | None = None  # this micro-batch's share of the global normaliser (None: action tokens)

    @property
    def num_sequences(self) -> int:
        return int(self.owned_sequences.shape[0])

    def loss_normaliser(self) -> int:
        return int(self.loss_mask.sum()) if self.normaliser is None else self.normaliser


def _shift(array: np.ndarray, sequence_ends: np.ndarray, fill) -> np.ndarray:
    shifted = np.empty_like(array)
    shifted[:-1] = array[1:]
    shifted[-1] = fill
    shifted[sequence_ends] = fill  # never predict across a sequence boundary
    return shifted


def rank_batch(mb: MicroBatch, cp_rank: int = 0, cp_size: int = 1) -> RankBatch:
    """The next-token-aligned slice of `mb` for one CP rank, on the device the model lives on
    (compat.device(): CUDA under NCCL, the CPU under gloo)."""
    device = compat.device()
    total = mb.num_tokens
    if total % cp_size:
        raise ValueError(f"micro-batch of {total} tokens is not divisible by cp {cp_size} (packer bug)")
    cu = mb.cu_seqlens.astype(np.int64)
    ends = cu[1:] - 1
    if cu[-1] < total:
        ends = np.append(ends, total - 1)
        cu = np.append(cu, total)
    start, end = cp_rank * total // cp_size, (cp_rank + 1) * total // cp_size
    local = slice(start, end)

    def tensor(array, dtype):
        return torch.as_tensor(np.ascontiguousarray(array[local]), dtype=dtype, device=device)

    sequence_of_token = np.repeat(np.arange(len(cu) - 1), np.diff(cu))
    firsts = cu[:-1]
    old_logprobs = tensor(_shift(mb.inference_logprobs, ends, 0.0), torch.float32)
    return RankBatch(
        input_ids=tensor(mb.input_ids, torch.long)[None],
        position_ids=tensor(mb.position_ids, torch.long)[None],
        cu_seqlens=torch.as_tensor(cu, dtype=torch.int32, device=device),
        total_tokens=total,
        targets=tensor(_shift(mb.input_ids, ends, 0), torch.long),
        loss_mask=tensor(_shift(mb.loss_mask, ends, False), torch.bool),
        advantages=tensor(_shift(mb.advantages, ends, 0.0), torch.float32),
        returns=tensor(_shift(mb.returns, ends, 0.0), torch.float32),
        old_values=tensor(_shift(mb.old_values, ends, 0.0), torch.float32),
        old_logprobs=old_logprobs,
        sampler_logprobs=old_logprobs,
        sequence_of_token=tensor(sequence_of_token, torch.long),
        owned_sequences=torch.as_tensor((firsts >= start) & (firsts < end), dtype=torch.bool, device=device),
        minibatch=mb.minibatch,
    )
