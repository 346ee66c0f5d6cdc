"""Per-token log-probabilities and entropy of the tempered policy softmax(logits / T) from
vocabulary-sharded logits, never gathering the full vocabulary and never copying it whole.

Each TP rank holds logits for a contiguous vocabulary slice; only [tokens]-sized statistics cross
the TP group (max, sum of exp, target logit, sum of p * logit). T is the temperature the training
samples were drawn with (`orchestrator.temperature`): vLLM samples from softmax(logits / T), so
the ratio, the entropy and every KL are of that distribution.

Memory: the forward pass works on chunks of `chunk_tokens` rows (about CHUNK_ELEMENTS logits) and
keeps only [tokens] statistics and a reference to the logits themselves; the backward pass
recomputes the probabilities chunk by chunk and writes one gradient tensor in the logits' dtype.
So the peak beyond the logits is one logits-sized gradient plus a few chunk-sized fp32
temporaries (measured in tests/distributed/test_logprobs.py). The entropy's gradient is computed
only when something differentiates the entropy (an entropy bonus); otherwise that branch is
skipped.

`vocab_parallel_top_k_kl` is on-policy distillation's `top_k_kl` term in the same style: the
forward KL of a teacher's top k tokens (ids and log-probabilities per token) from the student's
softmax, with [tokens, K + 3] statistics crossing the TP group and the same chunked memory; it is
the KL of `vocab_parallel_logprobs_and_top_k_kl`, which the policy's loss calls to get the
log-probabilities, the entropy and the KL with one logits-sized gradient.

`vocab_parallel_logprobs_and_top_k_kl` computes all four (log p(target), entropy, top-k KL, mass)
in one pass over the chunks, and its backward writes ONE logits-sized gradient for whichever of
them are differentiated: the policy loss uses it when distillation's top_k_kl is on, so the term
adds no second logits-sized gradient (two separate functions on the same logits make autograd
materialise one each and sum them: 6.0 instead of 3.5 bytes a bf16 logit at the backward's peak;
the fused kernel's peak is measured in tests/distributed/test_logprobs.py).
"""

from __future__ import annotations

import megatron_rl.compat  # noqa: F401  (megatron-core on CPU needs its patches first)

import torch
import torch.distributed as dist
from megatron.core import parallel_state

# fp32 temporaries of one chunk hold about this many logits (64 MiB each).
CHUNK_ELEMENTS = 1 << 24


def _chunks(num_tokens: int, chunk_tokens: int):
    for start in range(0, num_tokens, chunk_tokens):
        yield slice(start, min(num_tokens, start + chunk_tokens))


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    z = logits.float()
    return z / temperature if temperature != 1.0 else z


def _row_maxes(logits: torch.Tensor, group, temperature: float, chunk_tokens: int) -> torch.Tensor:
    """[N] float32: each row's largest logit / T over the whole vocabulary (maximised over `group`)."""
    maxes = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    for rows in _chunks(logits.shape[0], chunk_tokens):
        maxes[rows] = _scaled(logits[rows].max(dim=-1).values, temperature)
    if group is not None:
        dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=group)
    return maxes


def _local_ids(ids: torch.Tensor, vocab_start: int, vocab_local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(in this rank's vocabulary slice, the slice index clamped into it) of global token ids."""
    local = ids - vocab_start
    return (local >= 0) & (local < vocab_local), local.clamp(0, vocab_local - 1)


class _VocabParallelLogProbs(torch.autograd.Function):
    """log p(target) and entropy of softmax(logits / T); logits [N, V/tp], targets [N] global ids."""

    @staticmethod
    def forward(ctx, logits, targets, vocab_start, group, temperature, chunk_tokens):
        ctx.set_materialize_grads(False)
        num_tokens, vocab_local = logits.shape
        maxes = _row_maxes(logits, group, temperature, chunk_tokens)
        in_range, clamped = _local_ids(targets, vocab_start, vocab_local)
        stats = torch.empty(3, num_tokens, dtype=torch.float32, device=logits.device)
        for rows in _chunks(num_tokens, chunk_tokens):
            shifted = _scaled(logits[rows], temperature) - maxes[rows].unsqueeze(-1)
            exp = shifted.exp()
            stats[0, rows] = exp.sum(dim=-1)
            picked = torch.gather(shifted, -1, clamped[rows].unsqueeze(-1)).squeeze(-1)
            stats[1, rows] = torch.where(in_range[rows], picked, 0.0)
            stats[2, rows] = (exp * shifted).sum(dim=-1)
        if group is not None:
            dist.all_reduce(stats, group=group)
        sum_exp, picked, weighted = stats
        log_z = sum_exp.log()
        logprobs = picked - log_z
        entropy = log_z - weighted / sum_exp
        ctx.save_for_backward(logits, clamped, in_range, maxes, sum_exp, log_z, entropy)
        ctx.temperature, ctx.chunk_tokens = temperature, chunk_tokens
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        logits, clamped, in_range, maxes, sum_exp, log_z, entropy = ctx.saved_tensors
        temperature = ctx.temperature
        grad = torch.empty_like(logits)
        if grad_logprobs is None and grad_entropy is None:
            return grad.zero_(), None, None, None, None, None
        for rows in _chunks(logits.shape[0], ctx.chunk_tokens):
            shifted = _scaled(logits[rows], temperature) - maxes[rows].unsqueeze(-1)
            probs = shifted.exp() / sum_exp[rows].unsqueeze(-1)
            # d logp / d z = onehot - p ;  d H / d z = -p * (log p + H) ;  d z / d logits = 1 / T
            if grad_logprobs is not None:
                g = grad_logprobs[rows]
                chunk = -probs * g.unsqueeze(-1)
                chunk.scatter_add_(-1, clamped[rows].unsqueeze(-1), (in_range[rows] * g).unsqueeze(-1))
            else:
                chunk = torch.zeros_like(probs)
            if grad_entropy is not None:
                log_p = shifted - log_z[rows].unsqueeze(-1)
                chunk = chunk - probs * (log_p + entropy[rows].unsqueeze(-1)) * grad_entropy[rows].unsqueeze(-1)
            if temperature != 1.0:
                chunk = chunk / temperature
            grad[rows] = chunk
        return grad, None, None, None, None, None


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    vocab_start: int = 0,
    group=None,
    temperature: float = 1.0,
    chunk_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(targets), entropy) of softmax(logits / temperature), both shaped like `targets`,
    float32, differentiable (the entropy only when its gradient is needed).

    `logits` [..., V_local] (any float dtype; not copied) is this rank's vocabulary slice starting
    at global id `vocab_start`; `group` is the tensor-parallel group (None: the logits hold the
    whole vocabulary); `chunk_tokens` rows are processed at a time (default: CHUNK_ELEMENTS logits).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probabilities, got {temperature}")
    vocab_local = logits.shape[-1]
    rows = logits.reshape(-1, vocab_local)
    chunk_tokens = chunk_tokens or max(1, CHUNK_ELEMENTS // vocab_local)
    logprobs, entropy = _VocabParallelLogProbs.apply(
        rows, targets.reshape(-1), vocab_start, group, float(temperature), int(chunk_tokens)
    )
    return logprobs.view(targets.shape), entropy.view(targets.shape)


def megatron_vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0):
    """vocab_parallel_logprobs over megatron's tensor-parallel group and vocabulary split."""
    vocab_start, group = _megatron_vocab_slice(logits)
    return vocab_parallel_logprobs(logits, targets, vocab_start, group, temperature)


def _check_top_k(logits: torch.Tensor, top_ids: torch.Tensor, top_logprobs: torch.Tensor, temperature: float):
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for the top-k KL, got {temperature}")
    if top_ids.shape != top_logprobs.shape or top_ids.shape[:-1] != logits.shape[:-1]:
        raise ValueError(
            f"top-k KL: top_ids {tuple(top_ids.shape)} and top_logprobs {tuple(top_logprobs.shape)} must both be "
            f"[..., K] over the logits' tokens {tuple(logits.shape[:-1])}"
        )


def vocab_parallel_top_k_kl(
    logits: torch.Tensor,
    top_ids: torch.Tensor,
    top_logprobs: torch.Tensor,
    vocab_start: int = 0,
    group=None,
    temperature: float = 1.0,
    chunk_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(KL, mass) per token, both shaped like `top_ids` without its last axis, float32:

        KL_t   = sum_j p_T(j) * (log p_T(j) - log q(j))     (differentiable w.r.t. `logits`)
        mass_t = sum_j p_T(j)                                 (not differentiable)

    over the teacher's K ids j at t (`top_ids` [..., K], global ids), p_T = exp(`top_logprobs`)
    as given (not renormalised), q = softmax(logits / temperature) over the whole vocabulary: the
    forward KL of the teacher's top k from the student, truncated to those k. Its gradient w.r.t.
    z = logits / T is mass_t * q - p_T at the ids. The teacher's log-probabilities are constants.

    `logits` [..., V_local] (any float dtype; not copied) is this rank's vocabulary slice starting
    at global id `vocab_start` (megatron's padded vocabulary: padded logits count in the softmax,
    as in `vocab_parallel_logprobs`); `group` is the tensor-parallel group (None: the logits hold
    the whole vocabulary); only [tokens, K + 3] statistics cross it. `chunk_tokens` rows at a
    time (default: CHUNK_ELEMENTS logits); the backward pass recomputes q chunk by chunk.
    """
    _check_top_k(logits, top_ids, top_logprobs, temperature)
    # The combined kernel with the teacher's first ids as targets: the log-probabilities and the
    # entropy it also returns are left undifferentiated, so its backward computes the KL's part only.
    _, _, kl, mass = vocab_parallel_logprobs_and_top_k_kl(logits, top_ids[..., 0], top_ids, top_logprobs, vocab_start,
                                                         group, temperature, chunk_tokens)  # fmt: skip
    return kl, mass


def megatron_vocab_parallel_top_k_kl(
    logits: torch.Tensor, top_ids: torch.Tensor, top_logprobs: torch.Tensor, temperature: float = 1.0
):
    """vocab_parallel_top_k_kl over megatron's tensor-parallel group and vocabulary split."""
    vocab_start, group = _megatron_vocab_slice(logits)
    return vocab_parallel_top_k_kl(logits, top_ids, top_logprobs, vocab_start, group, temperature)


class _VocabParallelLogProbsAndTopKKL(torch.autograd.Function):
    """log p(target), entropy, top-k KL and mass of softmax(logits / T) in one pass; logits
    [N, V/tp], targets [N] and top_ids [N, K] global ids, top_logprobs [N, K] (constants)."""

    @staticmethod
    def forward(ctx, logits, targets, top_ids, top_logprobs, vocab_start, group, temperature, chunk_tokens):
        ctx.set_materialize_grads(False)
        num_tokens, vocab_local = logits.shape
        maxes = _row_maxes(logits, group, temperature, chunk_tokens)
        target_in_range, target_clamped = _local_ids(targets, vocab_start, vocab_local)
        ids_in_range, ids_clamped = _local_ids(top_ids, vocab_start, vocab_local)
        # Columns: sum of exp, the shifted target logit, sum of exp * shifted, then the shifted
        # logit at each teacher id (only its owner's is non-zero): one all-reduce of [N, 3 + K].
        stats = torch.empty(num_tokens, 3 + top_ids.shape[-1], dtype=torch.float32, device=logits.device)
        for rows in _chunks(num_tokens, chunk_tokens):
            shifted = _scaled(logits[rows], temperature) - maxes[rows].unsqueeze(-1)
            exp = shifted.exp()
            stats[rows, 0] = exp.sum(dim=-1)
            picked = torch.gather(shifted, -1, target_clamped[rows].unsqueeze(-1)).squeeze(-1)
            stats[rows, 1] = torch.where(target_in_range[rows], picked, 0.0)
            stats[rows, 2] = (exp * shifted).sum(dim=-1)
            stats[rows, 3:] = torch.where(ids_in_range[rows], torch.gather(shifted, -1, ids_clamped[rows]), 0.0)
        if group is not None:
            dist.all_reduce(stats, group=group)
        sum_exp = stats[:, 0].contiguous()
        log_z = sum_exp.log()
        logprobs = stats[:, 1] - log_z
        entropy = log_z - stats[:, 2] / sum_exp
        teacher_logprobs = top_logprobs.float()
        teacher_probs = teacher_logprobs.exp()
        kl = (teacher_probs * (teacher_logprobs - (stats[:, 3:] - log_z.unsqueeze(-1)))).sum(dim=-1)
        mass = teacher_probs.sum(dim=-1)
        ctx.mark_non_differentiable(mass)
        ctx.save_for_backward(logits, target_clamped, target_in_range, ids_clamped, ids_in_range, maxes, sum_exp,
                              log_z, entropy, teacher_probs, mass)  # fmt: skip
        ctx.temperature, ctx.chunk_tokens = temperature, chunk_tokens
        return logprobs, entropy, kl, mass

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy, grad_kl, grad_mass):
        (logits, target_clamped, target_in_range, ids_clamped, ids_in_range, maxes, sum_exp, log_z, entropy,
         teacher_probs, mass) = ctx.saved_tensors  # fmt: skip
        temperature = ctx.temperature
        grad = torch.empty_like(logits)
        if grad_logprobs is None and grad_entropy is None and grad_kl is None:
            return grad.zero_(), None, None, None, None, None, None, None
        # With p = softmax(z), z = logits / T (d z / d logits = 1 / T):
        #   d logp / d z = onehot(target) - p ;  d H / d z = -p (log p + H) ;  d KL / d z = m p - p_T at the ids.
        # The terms in p share one per-row factor: (m g_KL - g_logp) / sum_exp.
        per_row = torch.zeros_like(sum_exp)
        if grad_logprobs is not None:
            per_row = per_row - grad_logprobs
            at_target = (target_in_range * grad_logprobs).unsqueeze(-1)
        if grad_kl is not None:
            per_row = per_row + mass * grad_kl
            at_ids = torch.where(ids_in_range, -teacher_probs * grad_kl.unsqueeze(-1), 0.0)
        per_row = per_row / sum_exp
        if grad_entropy is not None:
            log_z_minus_entropy = log_z - entropy
        for rows in _chunks(logits.shape[0], ctx.chunk_tokens):
            shifted = _scaled(logits[rows], temperature) - maxes[rows].unsqueeze(-1)
            exp = shifted.exp()
            chunk = exp * per_row[rows].unsqueeze(-1)
            if grad_entropy is not None:
                # -p (log p + H) g_H, with log p + H = shifted - (log Z - H); in place on this chunk's own temporaries.
                weight = (grad_entropy[rows] / sum_exp[rows]).unsqueeze(-1)
                chunk -= exp.mul_(shifted.sub_(log_z_minus_entropy[rows].unsqueeze(-1))).mul_(weight)
            if grad_logprobs is not None:
                chunk.scatter_add_(-1, target_clamped[rows].unsqueeze(-1), at_target[rows])
            if grad_kl is not None:
                chunk.scatter_add_(-1, ids_clamped[rows], at_ids[rows])
            if temperature != 1.0:
                chunk /= temperature
            grad[rows] = chunk
        return grad, None, None, None, None, None, None, None


def vocab_parallel_logprobs_and_top_k_kl(
    logits: torch.Tensor,
    targets: torch.Tensor,
    top_ids: torch.Tensor,
    top_logprobs: torch.Tensor,
    vocab_start: int = 0,
    group=None,
    temperature: float = 1.0,
    chunk_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log p(targets), entropy, KL, mass), each shaped like `targets`, float32: the results of
    `vocab_parallel_logprobs(logits, targets, ...)` and `vocab_parallel_top_k_kl(logits, top_ids,
    top_logprobs, ...)` (same arguments, same meaning) from one pass over the chunks, with one
    all-reduce of the [N] row maxima and one of [N, 3 + K] statistics over `group`. Its backward
    writes one logits-sized gradient for the sum of whichever of log p, entropy and KL are
    differentiated (mass is not differentiable), where the two separate functions would write one
    each and autograd would add them.
    """
    _check_top_k(logits, top_ids, top_logprobs, temperature)
    if targets.shape != logits.shape[:-1]:
        raise ValueError(f"targets {tuple(targets.shape)} must be the logits' tokens {tuple(logits.shape[:-1])}")
    vocab_local, k = logits.shape[-1], top_ids.shape[-1]
    chunk_tokens = chunk_tokens or max(1, CHUNK_ELEMENTS // vocab_local)
    outputs = _VocabParallelLogProbsAndTopKKL.apply(
        logits.reshape(-1, vocab_local), targets.reshape(-1), top_ids.reshape(-1, k).long(),
        top_logprobs.reshape(-1, k), vocab_start, group, float(temperature), int(chunk_tokens),
    )  # fmt: skip
    return tuple(output.view(targets.shape) for output in outputs)


def megatron_vocab_parallel_logprobs_and_top_k_kl(
    logits: torch.Tensor,
    targets: torch.Tensor,
    top_ids: torch.Tensor,
    top_logprobs: torch.Tensor,
    temperature: float = 1.0,
):
    """vocab_parallel_logprobs_and_top_k_kl over megatron's tensor-parallel group and vocabulary split."""
    vocab_start, group = _megatron_vocab_slice(logits)
    return vocab_parallel_logprobs_and_top_k_kl(logits, targets, top_ids, top_logprobs, vocab_start, group,
                                                temperature)  # fmt: skip


def _megatron_vocab_slice(logits: torch.Tensor) -> tuple[int, object]:
    """(this TP rank's first vocabulary id, the TP group or None at TP 1) for its logits' slice."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    return rank * logits.shape[-1], parallel_state.get_tensor_model_parallel_group() if tp > 1 else None
