"""A MicroBatch as the tensors one rank feeds its model: next-token aligned, CP-sliced.

Output position p of a causal model predicts token p + 1, and a value head at p gives the value
of the state before token p + 1. So every per-token target is shifted left by one on the full
packed row (the last position of each sequence gets no target), then this CP rank takes its
contiguous slice. Losses are sums over these tokens; megatron divides the gradients by the
global sum of each micro-batch's `loss_normaliser()` (the action-token count unless the role's
batch says otherwise; `calculate_per_token_loss`).

`RankBatch` holds what every role's model and the shared step read; each role extends it with
the fields only its loss reads (policy/loss.py `PolicyBatch`, critic/loss.py `CriticBatch`),
built from the same MicroBatch with `RowSlice`, so one packed grid can serve both roles.

A position p belongs to the sequence holding p (its target p + 1 is in the same sequence: the
last position of a sequence has no target). `RowSlice.sequence_of_token` numbers the row's
sequences 0..S-1, with the padding tail as sequence S-1 when there is one;
`RowSlice.owned_sequences` marks those whose first token lies in this CP rank's slice, so
per-sequence counts summed over ranks count each sequence once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from megatron_rl import compat
from megatron_rl.data.types import MicroBatch


@dataclass(kw_only=True)
class RankBatch:
    """The fields every role reads: the model's inputs and which next tokens are actions."""

    input_ids: torch.Tensor  # [1, n] this CP rank's slice
    position_ids: torch.Tensor  # [1, n]
    cu_seqlens: torch.Tensor  # [S + 1] of the full row (padding tail included as a segment)
    total_tokens: int
    loss_mask: torch.Tensor  # [n] bool: the next token is an action
    # Routing replay (the policy's grid only): the sampler's experts of each token of this slice
    # ([n, moe_layers, top_k], uint8 or int32: not shifted, a token is routed where it is the
    # input) and which tokens it routed ([n] bool); None without.
    routes: torch.Tensor | None = None
    routed: torch.Tensor | None = None

    def loss_normaliser(self) -> torch.Tensor:
        """This micro-batch's share of the global normaliser (0-d int tensor): its action tokens."""
        return self.loss_mask.sum().to(torch.int)


def _shift(array: np.ndarray, sequence_ends: np.ndarray, fill) -> np.ndarray:
    """`array` ([N] or [N, ...]) moved one token earlier along axis 0: row p gets row p + 1's,
    `fill` on the last row and at every sequence's end."""
    shifted = np.empty_like(array)
    shifted[:-1] = array[1:]
    shifted[-1] = fill
    shifted[sequence_ends] = fill  # never predict across a sequence boundary
    return shifted


class RowSlice:
    """One CP rank's view of a MicroBatch's packed row: per-token arrays shifted to the next token
    and sliced, and the row's sequences, as tensors on the device the model lives on
    (compat.device(): CUDA under NCCL, the CPU under gloo)."""

    def __init__(self, mb: MicroBatch, cp_rank: int = 0, cp_size: int = 1):
        total = mb.num_tokens
        if total % cp_size:
            raise ValueError(f"micro-batch of {total} tokens is not divisible by cp {cp_size} (packer bug)")
        cu = mb.cu_seqlens.astype(np.int64)
        ends = cu[1:] - 1
        if cu[-1] < total:
            ends = np.append(ends, total - 1)
            cu = np.append(cu, total)
        self.mb, self.device, self.total = mb, compat.device(), total
        self.cu, self.ends = cu, ends
        self.start, self.end = cp_rank * total // cp_size, (cp_rank + 1) * total // cp_size

    def tensor(self, array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        """This rank's slice of a per-token array of the row, as is."""
        return torch.as_tensor(
            np.ascontiguousarray(array[self.start : self.end]), dtype=dtype, device=self.device
        )

    def next_token(self, array: np.ndarray, dtype: torch.dtype, fill=0) -> torch.Tensor:
        """This rank's slice of a per-token array ([N] or [N, ...]: a row per token, such as the
        teacher's top k) shifted to the next token along axis 0 (`fill` where a position has
        none)."""
        return self.tensor(_shift(array, self.ends, fill), dtype)

    def sequence_of_token(self) -> torch.Tensor:
        """[n] int64: the sequence (of the full row) each of this rank's positions is in."""
        return self.tensor(np.repeat(np.arange(len(self.cu) - 1), np.diff(self.cu)), torch.long)

    def owned_sequences(self) -> torch.Tensor:
        """[S] bool: the sequence's first token is on this CP rank."""
        firsts = self.cu[:-1]
        return torch.as_tensor(
            (firsts >= self.start) & (firsts < self.end), dtype=torch.bool, device=self.device
        )

    def shared_fields(self) -> dict:
        """The fields of `RankBatch`, for a role's batch to extend."""
        mb = self.mb
        routes = {}
        if mb.routes is not None:
            compact = mb.routes if mb.routes.dtype == np.uint8 else mb.routes.astype(np.int32)
            routes = dict(routes=self.tensor(compact, None), routed=self.tensor(mb.routed, torch.bool))
        return dict(
            **routes,
            input_ids=self.tensor(mb.input_ids, torch.long)[None],
            position_ids=self.tensor(mb.position_ids, torch.long)[None],
            cu_seqlens=torch.as_tensor(self.cu, dtype=torch.int32, device=self.device),
            total_tokens=self.total,
            loss_mask=self.next_token(mb.loss_mask, torch.bool, False),
        )


def rank_batch(mb: MicroBatch, cp_rank: int = 0, cp_size: int = 1) -> RankBatch:
    """The next-token-aligned slice of `mb` for one CP rank, with the fields every role reads
    (forward passes: critic scoring)."""
    return RankBatch(**RowSlice(mb, cp_rank, cp_size).shared_fields())
