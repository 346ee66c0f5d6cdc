"""Per-token log-probabilities and entropy from vocabulary-sharded logits, never gathering the
full vocabulary: each TP rank holds logits for a contiguous vocabulary slice, and only [tokens]
sized statistics cross the TP group (max, sum of exp, target logit, sum of p * logit).
"""

from __future__ import annotations

import megatron_rl.compat  # noqa: F401  (megatron-core on CPU needs its patches first)

import torch
import torch.distributed as dist
from megatron.core import parallel_state


class _VocabParallelLogProbs(torch.autograd.Function):
    """log p(target) and entropy; logits [..., V/tp] float32, targets [...] global ids."""

    @staticmethod
    def forward(ctx, logits, targets, vocab_start, group):
        logits = logits.float()
        local_max = logits.max(dim=-1).values
        if group is not None:
            dist.all_reduce(local_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - local_max.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        vocab_local = logits.shape[-1]
        local_targets = targets - vocab_start
        in_range = (local_targets >= 0) & (local_targets < vocab_local)
        picked = torch.gather(shifted, -1, local_targets.clamp(0, vocab_local - 1).unsqueeze(-1)).squeeze(-1)
        picked = torch.where(in_range, picked, 0.0)
        weighted = (exp * shifted).sum(dim=-1)
        if group is not None:
            stats = torch.stack([sum_exp, picked, weighted])
            dist.all_reduce(stats, group=group)
            sum_exp, picked, weighted = stats
        log_z = sum_exp.log()
        logprobs = picked - log_z
        entropy = log_z - weighted / sum_exp
        probs = exp / sum_exp.unsqueeze(-1)
        ctx.save_for_backward(probs, shifted, local_targets, in_range, log_z, entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        probs, shifted, local_targets, in_range, log_z, entropy = ctx.saved_tensors
        # d logp / d z = onehot - p ;  d H / d z = -p * (log p + H)
        grad = -probs * grad_logprobs.unsqueeze(-1)
        one_hot = torch.zeros_like(probs)
        one_hot.scatter_(-1, local_targets.clamp(0, probs.shape[-1] - 1).unsqueeze(-1), 1.0)
        grad = grad + one_hot * (in_range * grad_logprobs).unsqueeze(-1)
        log_p = shifted - log_z.unsqueeze(-1)
        grad = grad - probs * (log_p + entropy.unsqueeze(-1)) * grad_entropy.unsqueeze(-1)
        return grad, None, None, None


def vocab_parallel_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, vocab_start: int = 0, group=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(targets), entropy), both shaped like `targets`, float32, differentiable.

    `logits` [..., V_local] is this rank's vocabulary slice starting at global id `vocab_start`;
    `group` is the tensor-parallel group (None: the logits hold the whole vocabulary).
    """
    return _VocabParallelLogProbs.apply(logits, targets, vocab_start, group)


def megatron_vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor):
    """vocab_parallel_logprobs over megatron's tensor-parallel group and vocabulary split."""

    tp = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    group = parallel_state.get_tensor_model_parallel_group() if tp > 1 else None
    return vocab_parallel_logprobs(logits, targets, rank * logits.shape[-1], group)
