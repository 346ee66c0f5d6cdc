"""The Megatron teacher's collective scoring pass (behind `POST /logprobs`).

`score_logprobs(model, request, seq_len, request_sizes)` is called by every teacher rank; global
rank 0 passes the request (a list of token-id lists), the others None. The sequences are
broadcast, packed and run on every replica exactly as the critic's are (critic/scoring.py
`per_token_outputs`: complete sequences up to seq_len, each merged request in bins of its own
with `request_sizes`, CP slices gathered, DP and PP reduced to rank 0). Each position's output
is the log-probability of the next token under the model's softmax at temperature 1, computed
vocab-parallel from this rank's slice of the logits (models/logprobs.py through the policy's
`forward_logprobs`, what pi_old and the KL reference use): the [T, V] logits are never
gathered over TP. Rank 0 gets, per sequence in request order, float32 [T]:

    logprobs[i][0] = nan                       (no token before it)
    logprobs[i][t] = log p(token t | tokens 0..t-1)   = output at position t - 1
"""

from __future__ import annotations

import numpy as np

from megatron_rl.critic.scoring import per_token_outputs
from megatron_rl.policy.loss import forward_logprobs, policy_batch


def _next_token_logprobs(model, batches):
    return forward_logprobs(model, batches, temperature=1.0)


def score_logprobs(
    model, request: list[list[int]] | None, seq_len: int, request_sizes: list[int] | None = None
) -> list[np.ndarray] | None:
    """Collective over all teacher ranks: rank 0 gets each sequence's [T] float32 log-probabilities
    (nan at 0), the others None."""
    outputs = per_token_outputs(model, request, seq_len, request_sizes, policy_batch, _next_token_logprobs)
    if outputs is None:
        return None
    flat, offsets = outputs
    return [np.concatenate([[np.nan], flat[start : end - 1]]).astype(np.float32)
            for start, end in zip(offsets[:-1], offsets[1:])]  # fmt: skip
