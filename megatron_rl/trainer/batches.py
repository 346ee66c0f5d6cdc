"""A MicroBatch as the tensors one rank feeds its model: next-token aligned, CP-sliced.

Output position p of a causal model predicts token p + 1, and a value head at p gives the value
of the state before token p + 1. So every per-token target is shifted left by one on the full
packed row (the last position of each sequence gets no target), then this CP rank takes its
contiguous slice. Losses are sums over these tokens; megatron divides the gradients by the
global action-token count (`calculate_per_token_loss`).
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
    old_logprobs: torch.Tensor
    ref_logprobs: torch.Tensor | None = None  # the reference policy's, when KL is configured


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
    local = slice(cp_rank * total // cp_size, (cp_rank + 1) * total // cp_size)

    def tensor(array, dtype):
        return torch.as_tensor(np.ascontiguousarray(array[local]), dtype=dtype, device=device)

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
        old_logprobs=tensor(_shift(mb.inference_logprobs, ends, 0.0), torch.float32),
    )
