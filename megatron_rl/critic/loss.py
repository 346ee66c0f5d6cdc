"""The critic's loss on one rank: its batch (`CriticBatch`: the value targets and the old values,
next to the fields every role shares) and `value_loss_func`, 0.5 * (V - returns)^2 on action
tokens, optionally clipped around the old values (algorithms/losses.py `value_loss`).

`train_step` (trainer/step.py) builds each micro-batch's `CriticBatch` with the loss's `batch`
builder.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_rl.algorithms.losses import value_loss
from megatron_rl.data.types import MicroBatch
from megatron_rl.trainer.batches import RankBatch, RowSlice
from megatron_rl.trainer.step import RoleLoss


@dataclass(kw_only=True)
class CriticBatch(RankBatch):
    """A RankBatch with what the value loss reads, per next token ([n] this CP rank's slice)."""

    returns: torch.Tensor  # [n] the value target of the state before the next token
    old_values: torch.Tensor  # [n] the values the orchestrator scored (value clipping's centre)


def critic_batch(mb: MicroBatch, cp_rank: int = 0, cp_size: int = 1) -> CriticBatch:
    """The next-token-aligned slice of `mb` for one CP rank, with the critic's fields."""
    row = RowSlice(mb, cp_rank, cp_size)
    return CriticBatch(
        **row.shared_fields(),
        returns=row.next_token(mb.returns, torch.float32, 0.0),
        old_values=row.next_token(mb.old_values, torch.float32, 0.0),
    )


def value_loss_func(value_clip: float | None = None) -> RoleLoss:
    """0.5 * (V - returns)^2 on action tokens, optionally clipped around the old values; on
    `CriticBatch`es (`critic_batch`)."""

    def loss(values: torch.Tensor, batch: CriticBatch):
        loss_sum, metrics = value_loss(
            values[0], batch.returns, batch.loss_mask, batch.old_values, value_clip
        )
        return loss_sum, {k: v for k, v in metrics.items() if k.endswith("_sum")}

    return RoleLoss(batch=critic_batch, loss=loss)
