"""Loss aggregation: how per-token losses become one number per (mini-)batch, with verl's meaning
(`verl.trainer.ppo.core_algos.agg_loss`), computed over the whole global batch.

The trainer's losses are sums over masked tokens; megatron divides the summed gradient by a
global integer normaliser (the sum over every micro-batch of every DP and CP rank). Each mode is
therefore a per-token weight w_t and a per-micro-batch normaliser contribution D:

    loss = sum over all tokens of w_t * l_t / sum over all micro-batches of D

    token-mean               w_t = 1               D = action tokens          (every token alike)
    seq-mean-token-sum       w_t = 1               D = sequences              (sum per sequence, mean over sequences)
    seq-mean-token-mean      w_t = 1 / L_s         D = sequences              (mean per sequence, mean over sequences)
    seq-mean-token-sum-norm  w_t = 1               D = sequences * C          (Dr. GRPO: a constant C per sequence)

L_s is the number of action tokens of the token's sequence s over the whole packed row (all CP
ranks), "sequences" counts sequences with at least one action token, each once: on the CP rank
that holds its first token. The masks are those left after rollout rejection, so a rejected
sequence leaves the seq-mean denominators as a rejected token leaves token-mean's. verl's
agg_loss does the same when it counts the sequences itself (global_batch_size None), but its
trainer passes the mini-batch size (ppo_mini_batch_size x n), rejected and empty sequences
included: there, rejecting a fraction f of the sequences scales the step's loss by (1 - f). Ours
keeps the step's scale whatever the rejection rate, like token-mean in both. C is `algorithm.loss_scale_factor` (default the configured maximum
completion length). verl divides by the global batch size and then by C for the -norm mode; the
product is the same number. Because every count is global, the result does not depend on DP, CP
or how sequences were packed.
"""

from __future__ import annotations

import torch

MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def token_weights(
    mode: str, mask: torch.Tensor, sequence_of_token: torch.Tensor, sequence_tokens: torch.Tensor
) -> torch.Tensor | None:
    """Per-token weight w_t [n] float32 for `mode` (None: all ones). `sequence_of_token` [n] is
    the index of each token's sequence, `sequence_tokens` [S] the action tokens of each sequence
    over the whole row."""
    if mode not in MODES:
        raise ValueError(f"algorithm.loss_aggregation: unknown {mode!r}; choose from {list(MODES)}")
    if mode != "seq-mean-token-mean":
        return None
    per_token = sequence_tokens.to(torch.float32)[sequence_of_token]
    return torch.where(mask.bool(), 1.0 / per_token.clamp(min=1.0), 0.0)


def normaliser(
    mode: str, mask: torch.Tensor, owned_sequences_with_actions: int, scale: int | None = None
) -> int:
    """This micro-batch's contribution D to the global normaliser (an integer: megatron sums it
    in an int tensor). `owned_sequences_with_actions`: sequences with at least one action token
    left after rollout rejection whose first token lies on this CP rank (verl's trainer counts
    every sequence of the mini-batch instead: the module docstring says why not here)."""
    if mode == "token-mean":
        return int(mask.sum())
    if mode in ("seq-mean-token-sum", "seq-mean-token-mean"):
        return owned_sequences_with_actions
    if mode == "seq-mean-token-sum-norm":
        if scale is None or scale < 1:
            raise ValueError(f"seq-mean-token-sum-norm needs a positive loss_scale_factor, got {scale}")
        return owned_sequences_with_actions * scale
    raise ValueError(f"algorithm.loss_aggregation: unknown {mode!r}; choose from {list(MODES)}")
