"""Vocab-parallel log-probabilities and entropy at TP=2 equal a full-softmax reference."""

from __future__ import annotations

import torch

from megatron_rl import parallel
from megatron_rl.models.logprobs import vocab_parallel_logprobs
from megatron_rl.testing.spawn import run_ranks


def reference(logits, targets, weights):
    logits = logits.clone().requires_grad_()
    log_p = torch.log_softmax(logits, dim=-1)
    logprobs = log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    (weights[0] * logprobs + weights[1] * entropy).sum().backward()
    return logprobs.detach(), entropy.detach(), logits.grad


def test_single_rank_matches_full_softmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 17, 50, generator=g) * 4
    targets = torch.randint(0, 50, (3, 17), generator=g)
    weights = torch.randn(2, 3, 17, generator=g)
    ref = reference(logits, targets, weights)
    x = logits.clone().requires_grad_()
    logprobs, entropy = vocab_parallel_logprobs(x, targets)
    (weights[0] * logprobs + weights[1] * entropy).sum().backward()
    for got, want in zip((logprobs, entropy, x.grad), ref):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_tp2_matches_full_softmax():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(40, 64, generator=g) * 5  # [packed tokens, vocab]
    targets = torch.randint(0, 64, (40,), generator=g)
    targets[:5] = torch.tensor([0, 31, 32, 63, 33])  # both shards' edges
    weights = torch.randn(2, 40, generator=g)
    ref_logprobs, ref_entropy, ref_grad = reference(logits, targets, weights)
    ranks = run_ranks(vocab_parallel_logprob_grads, 2, logits, targets, weights)
    for rank, (logprobs, entropy, grad) in enumerate(ranks):
        torch.testing.assert_close(logprobs, ref_logprobs, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(entropy, ref_entropy, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(grad, ref_grad.chunk(2, dim=-1)[rank], atol=1e-5, rtol=1e-5)


# Rank functions: module-level, so that the spawned ranks can import them.


def vocab_parallel_logprob_grads(rank, world_size, logits_full, targets, weights):
    """Log-probs, entropy and the gradient of sum(w1*logp + w2*H) w.r.t. this rank's logits."""
    from megatron_rl.models.logprobs import megatron_vocab_parallel_logprobs

    parallel.initialize_model_parallel(tp=world_size)
    local = logits_full.chunk(world_size, dim=-1)[rank].clone().requires_grad_()
    logprobs, entropy = megatron_vocab_parallel_logprobs(local, targets)
    (weights[0] * logprobs + weights[1] * entropy).sum().backward()
    return logprobs.detach(), entropy.detach(), local.grad
