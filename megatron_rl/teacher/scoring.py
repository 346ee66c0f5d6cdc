"""The Megatron teacher's collective scoring passes (behind `POST /logprobs`).

`score_logprobs(model, request, seq_len, request_sizes)` and `score_top_k(..., k)` are called by
every teacher rank; global rank 0 passes the request (a list of token-id lists), the others None.
The sequences are broadcast, packed and run on every replica exactly as the critic's are
(critic/scoring.py `per_token_outputs`: complete sequences up to seq_len, each merged request in
bins of its own with `request_sizes`, CP slices gathered, DP and PP reduced to rank 0). Both
work on the softmax at temperature 1, vocab-parallel from this rank's slice of the logits: the
[T, V] logits are never gathered over TP.

`score_logprobs`: each position's output is the log-probability of the next token
(models/logprobs.py through the policy's `forward_logprobs`, what pi_old and the KL reference
use). Rank 0 gets, per sequence in request order, float32 [T]:

    logprobs[i][0] = nan                       (no token before it)
    logprobs[i][t] = log p(token t | tokens 0..t-1)   = output at position t - 1

`score_top_k`: one forward gives, per sequence, a TeacherTopK (data/types.py): the same
`logprobs` and at every position t >= 1 the k most likely tokens given tokens 0..t-1 with their
log-probabilities, most likely first (row 0: ids 0, log-probabilities nan). Each position's
output is one float32 row [1 + 2k] (`vocab_parallel_top_k`): the next token's log-probability,
the k token ids as float32 (exact: the vocabulary is below 2**24 ids), their log-probabilities.
Per position only [k] candidates per TP rank and three [n] statistics cross the TP group.
"""

from __future__ import annotations

import megatron_rl.compat  # noqa: F401  (megatron-core on CPU needs its patches first)

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_rl.critic.scoring import per_token_outputs
from megatron_rl.data.types import TeacherTopK
from megatron_rl.models.logprobs import CHUNK_ELEMENTS
from megatron_rl.policy.loss import forward_logprobs, policy_batch
from megatron_rl.trainer.forward import forward_only

# Token ids travel as float32 in the per-position rows: exact below this.
EXACT_FLOAT32_IDS = 1 << 24


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


def vocab_parallel_top_k(
    logits: torch.Tensor,
    targets: torch.Tensor,
    k: int,
    vocab_start: int = 0,
    vocab_size: int | None = None,
    group=None,
    chunk_tokens: int | None = None,
) -> torch.Tensor:
    """[n, 1 + 2k] float32 rows of softmax(logits) at temperature 1 over the real vocabulary
    (ids below `vocab_size`; None: every column of every rank), per position:

        [log p(targets), ids of the k most likely tokens (float32), their log p]

    `logits` [n, V_local] (any float dtype; not copied whole) is this rank's vocabulary slice
    starting at global id `vocab_start`; `group` the tensor-parallel group (None: the whole
    vocabulary). log Z = M + log sum_ranks S_r exp(m_r - M) from each rank's max m_r and sum
    S_r = sum exp(z - m_r) (M the max over ranks); each rank's top min(k, V_local) candidates
    are all-gathered and the top k of them kept. `chunk_tokens` rows at a time (default about
    CHUNK_ELEMENTS logits)."""
    num_tokens, vocab_local = logits.shape
    local_k = min(k, vocab_local)
    chunk_tokens = chunk_tokens or max(1, CHUNK_ELEMENTS // vocab_local)
    real_columns = vocab_local if vocab_size is None else max(0, min(vocab_local, vocab_size - vocab_start))
    device = logits.device
    maxes = torch.empty(num_tokens, dtype=torch.float32, device=device)
    sums = torch.empty(num_tokens, dtype=torch.float32, device=device)
    picked = torch.empty(num_tokens, dtype=torch.float32, device=device)
    candidates = torch.empty(num_tokens, 2 * local_k, dtype=torch.float32, device=device)  # logits, then ids
    local_targets = targets - vocab_start
    in_range = (local_targets >= 0) & (local_targets < real_columns)
    clamped = local_targets.clamp(0, vocab_local - 1)
    for start in range(0, num_tokens, chunk_tokens):
        rows = slice(start, min(num_tokens, start + chunk_tokens))
        z = logits[rows].float()
        if real_columns < vocab_local:  # megatron's padding of the vocabulary: never a token
            z = z.masked_fill(torch.arange(vocab_local, device=device) >= real_columns, float("-inf"))
        row_max = z.max(dim=-1).values  # -inf where this slice holds padding only
        maxes[rows] = row_max
        finite_max = torch.where(torch.isfinite(row_max), row_max, 0.0)
        sums[rows] = (z - finite_max[:, None]).exp().sum(dim=-1)
        target_logits = torch.gather(z, -1, clamped[rows, None])[:, 0]
        picked[rows] = torch.where(in_range[rows], target_logits, 0.0)
        values, ids = z.topk(local_k, dim=-1)
        candidates[rows, :local_k] = values
        candidates[rows, local_k:] = (ids + vocab_start).float()
    global_max = maxes.clone()
    if group is not None:
        dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
    stats = torch.stack([sums * torch.exp(maxes - global_max), picked])
    if group is not None:
        dist.all_reduce(stats, group=group)
        parts = [torch.empty_like(candidates) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, candidates, group=group)
        candidates = torch.cat([torch.cat([p[:, :local_k] for p in parts], 1),
                                torch.cat([p[:, local_k:] for p in parts], 1)], 1)  # fmt: skip
    log_z = global_max + stats[0].log()
    width = candidates.shape[1] // 2
    top_logits, positions = candidates[:, :width].topk(k, dim=-1)
    top_ids = torch.gather(candidates[:, width:], -1, positions)
    return torch.cat([(stats[1] - log_z)[:, None], top_ids, top_logits - log_z[:, None]], dim=1)


def megatron_vocab_parallel_top_k(logits, targets, k: int, vocab_size: int | None) -> torch.Tensor:
    """`vocab_parallel_top_k` over megatron's tensor-parallel group and vocabulary split."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    group = parallel_state.get_tensor_model_parallel_group() if tp > 1 else None
    return vocab_parallel_top_k(logits, targets, k, rank * logits.shape[-1], vocab_size, group)


def _next_token_top_k(model, batches, k: int, vocab_size: int | None):
    return forward_only(
        model, batches, lambda logits, batch: megatron_vocab_parallel_top_k(logits[0], batch.targets, k, vocab_size)
    )


def score_top_k(
    model,
    request: list[list[int]] | None,
    seq_len: int,
    request_sizes: list[int] | None,
    k: int,
    vocab_size: int | None = None,
) -> list[TeacherTopK] | None:
    """Collective over all teacher ranks (`k` the same on every rank, 1 <= k <= the vocabulary):
    rank 0 gets each sequence's TeacherTopK, the others None. `vocab_size`: the real vocabulary
    (`arch.vocab_size`); ids at or above it (megatron's padding) are never candidates and are
    left out of the softmax; None: every column of the logits."""
    if vocab_size is not None and vocab_size > EXACT_FLOAT32_IDS:
        raise ValueError(f"score_top_k: a vocabulary of {vocab_size} ids is over the 2**24 that float32 holds exactly")

    def forward(model, batches):
        return _next_token_top_k(model, batches, k, vocab_size)

    outputs = per_token_outputs(model, request, seq_len, request_sizes, policy_batch, forward, columns=1 + 2 * k)
    if outputs is None:
        return None
    flat, offsets = outputs
    results = []
    for start, end in zip(offsets[:-1], offsets[1:]):
        rows = flat[start : end - 1]  # position t's distribution is the output at t - 1
        results.append(
            TeacherTopK(
                logprobs=np.concatenate([[np.nan], rows[:, 0]]).astype(np.float32),
                top_ids=np.concatenate([np.zeros((1, k)), rows[:, 1 : 1 + k]]).astype(np.int32),
                top_logprobs=np.concatenate([np.full((1, k), np.nan), rows[:, 1 + k :]]).astype(np.float32),
            )
        )
    return results
