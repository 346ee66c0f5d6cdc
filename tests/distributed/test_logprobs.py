"""Vocab-parallel log-probabilities and entropy (of softmax(logits / T)) at TP=1 and TP=2 equal a
full-softmax reference, in chunks, from bf16 logits, and within the measured memory bound; the
top-k KL of distillation's top_k_kl at TP=2 equals the naive formula (one process:
tests/unit/test_top_k_kl.py)."""

from __future__ import annotations

import torch

from megatron_rl import parallel
from megatron_rl.models.logprobs import (
    vocab_parallel_logprobs,
    vocab_parallel_logprobs_and_top_k_kl,
    vocab_parallel_top_k_kl,
)
from tests.support.memory import AllocationTracker
from tests.support.spawn import run_ranks


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


def vocab_parallel_logprob_grads(rank, world_size, logits_full, targets, weights, temperature=1.0):
    """Log-probs, entropy and the gradient of sum(w1*logp + w2*H) w.r.t. this rank's logits."""
    from megatron_rl.models.logprobs import megatron_vocab_parallel_logprobs

    parallel.initialize_model_parallel(tp=world_size)
    local = logits_full.chunk(world_size, dim=-1)[rank].clone().requires_grad_()
    logprobs, entropy = megatron_vocab_parallel_logprobs(local, targets, temperature)
    (weights[0] * logprobs + weights[1] * entropy).sum().backward()
    return logprobs.detach(), entropy.detach(), local.grad


def test_temperature_chunks_and_dtype():
    """softmax(logits / T) at T = 0.7, in chunks of 3 rows, from bf16 logits (the gradient comes
    back in bf16, computed in fp32) equals the full-softmax reference on the same values."""
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(23, 40, generator=g) * 3).to(torch.bfloat16)
    targets = torch.randint(0, 40, (23,), generator=g)
    weights = torch.randn(2, 23, generator=g)
    ref = reference(logits.float() / 0.7, targets, weights)
    x = logits.clone().requires_grad_()
    logprobs, entropy = vocab_parallel_logprobs(x, targets, temperature=0.7, chunk_tokens=3)
    (weights[0] * logprobs + weights[1] * entropy).sum().backward()
    assert x.grad.dtype == torch.bfloat16
    torch.testing.assert_close(logprobs, ref[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy, ref[1], atol=1e-5, rtol=1e-5)
    # d/dlogits = d/dz / T; bf16 rounding of the gradient is the only difference.
    torch.testing.assert_close(x.grad.float(), (ref[2] / 0.7).to(torch.bfloat16).float(), atol=1e-2, rtol=1e-2)
    untempered, _ = vocab_parallel_logprobs(logits, targets)
    assert (untempered - logprobs).abs().max() > 0.05


def test_the_entropy_gradient_is_skipped_when_nothing_differentiates_it():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(30, 50, generator=g, dtype=torch.float64).float()
    targets = torch.randint(0, 50, (30,), generator=g)
    x = logits.clone().requires_grad_()
    logprobs, entropy = vocab_parallel_logprobs(x, targets, chunk_tokens=7)
    (logprobs.sum() + 0.0 * entropy.detach().sum()).backward()
    torch.testing.assert_close(x.grad, reference(logits, targets, torch.stack([torch.ones(30), torch.zeros(30)]))[2])


def test_tp2_tempered_matches_full_softmax():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(40, 64, generator=g) * 5
    targets = torch.randint(0, 64, (40,), generator=g)
    weights = torch.randn(2, 40, generator=g)
    ref_logprobs, ref_entropy, ref_grad = reference(logits / 1.6, targets, weights)
    ranks = run_ranks(vocab_parallel_logprob_grads, 2, logits, targets, weights, 1.6)
    for rank, (logprobs, entropy, grad) in enumerate(ranks):
        torch.testing.assert_close(logprobs, ref_logprobs, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(entropy, ref_entropy, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(grad, (ref_grad / 1.6).chunk(2, dim=-1)[rank], atol=1e-5, rtol=1e-5)


def test_tp2_top_k_kl_matches_full_softmax():
    """Distillation top_k_kl's term at TP = 2 (each rank's vocabulary half, the teacher's ids on
    both sides of the split and at its edges, 8 of the 64 columns megatron's padding the ids never
    reach but the softmax counts) equals the naive formula on the full log-softmax: KL, mass and
    each rank's half of the gradient of sum_t w_t KL_t, at T = 1 and T = 0.8 in chunks of 7 rows.
    The fused kernel (log p, entropy, KL and mass in one pass) at TP = 2 equals it on one process:
    the four outputs and each rank's half of the gradient of sum_t (u_t log p_t + v_t H_t + w_t KL_t)."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(40, 64, generator=g) * 5
    teacher = torch.log_softmax(torch.randn(40, 56, generator=g) * 3, dim=-1)
    top_logprobs, top_ids = teacher.topk(6, dim=-1)
    top_ids[:4, 0] = torch.tensor([0, 31, 32, 55])
    top_ids[:4, 1] = torch.tensor([33, 30, 1, 54])
    weights = torch.randn(40, generator=g)
    targets = torch.randint(0, 64, (40,), generator=g)
    targets[:5] = torch.tensor([0, 31, 32, 63, 33])  # both shards' edges
    upstream = torch.randn(3, 40, generator=g)
    temperatures = (1.0, 0.8)
    ranks = run_ranks(vocab_parallel_top_k_kl_grads, 2, logits, top_ids, top_logprobs, weights, temperatures,
                      targets, upstream)  # fmt: skip
    for temperature, results in zip(temperatures, zip(*ranks)):
        x = (logits / temperature).clone().requires_grad_()
        log_q = torch.log_softmax(x, dim=-1)
        p = top_logprobs.exp()
        want_kl = (p * (top_logprobs - log_q.gather(-1, top_ids))).sum(-1)
        (weights * want_kl).sum().backward()
        one = logits.clone().requires_grad_()
        want_fused = vocab_parallel_logprobs_and_top_k_kl(one, targets, top_ids, top_logprobs, temperature=temperature)
        sum((u * out).sum() for u, out in zip(upstream, want_fused[:3])).backward()
        for rank, ((kl, mass, grad), (fused, fused_grad)) in enumerate(results):
            torch.testing.assert_close(kl, want_kl.detach(), atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(mass, p.sum(-1), atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(grad, (x.grad / temperature).chunk(2, dim=-1)[rank], atol=1e-6, rtol=1e-5)
            for got, want in zip(fused, want_fused):
                torch.testing.assert_close(got, want.detach(), atol=1e-5, rtol=1e-6)
            torch.testing.assert_close(fused_grad, one.grad.chunk(2, dim=-1)[rank], atol=1e-6, rtol=1e-5)
        assert float(want_kl.min()) > 1e-2 and float(one.grad.abs().max()) > 1e-2


def vocab_parallel_top_k_kl_grads(rank, world_size, logits_full, top_ids, top_logprobs, weights, temperatures,
                                  targets, upstream):  # fmt: skip
    """Per temperature: (KL, mass and the gradient of sum(w * KL) w.r.t. this rank's logits, in
    chunks of 7 rows (megatron_vocab_parallel_top_k_kl, in one chunk, gives the same KL)), and
    (the fused kernel's log p, entropy, KL and mass, the gradient of sum(u1 log p + u2 H + u3 KL)),
    the fused kernel through megatron's wrapper, in one chunk."""
    from megatron.core import parallel_state

    from megatron_rl.models.logprobs import (
        megatron_vocab_parallel_logprobs_and_top_k_kl,
        megatron_vocab_parallel_top_k_kl,
    )

    parallel.initialize_model_parallel(tp=world_size)
    results = []
    for temperature in temperatures:
        local = logits_full.chunk(world_size, dim=-1)[rank].clone().requires_grad_()
        kl, mass = vocab_parallel_top_k_kl(local, top_ids, top_logprobs, rank * local.shape[-1],
                                           parallel_state.get_tensor_model_parallel_group(), temperature, 7)  # fmt: skip
        (weights * kl).sum().backward()
        whole, _ = megatron_vocab_parallel_top_k_kl(local.detach(), top_ids, top_logprobs, temperature)
        torch.testing.assert_close(whole, kl.detach(), atol=0, rtol=0)  # row chunks do not change a row's sums
        fused_local = logits_full.chunk(world_size, dim=-1)[rank].clone().requires_grad_()
        fused = megatron_vocab_parallel_logprobs_and_top_k_kl(fused_local, targets, top_ids, top_logprobs, temperature)
        sum((u * out).sum() for u, out in zip(upstream, fused[:3])).backward()
        results.append(((kl.detach(), mass, local.grad), (tuple(out.detach() for out in fused), fused_local.grad)))
    return results


def test_memory_beyond_the_logits_is_one_gradient_plus_chunks():
    """Measured allocation (every tensor the forward and backward create, by storage): the peak
    beyond the bf16 logits is the bf16 gradient (2 B per logit) plus chunk-sized fp32
    temporaries, and nothing logits-sized survives the forward pass: the figures the memory plan
    uses (config/memory_plan.py). (Before this kernel: 8 B per logit saved for backward and 28 B
    per logit at the peak.)"""
    from megatron_rl.config import memory_plan
    from megatron_rl.models.logprobs import CHUNK_ELEMENTS

    assert memory_plan.LOGPROB_CHUNK_ELEMENTS == CHUNK_ELEMENTS
    tokens, vocab, chunk = 1024, 4096, 64
    logits = torch.randn(tokens, vocab, dtype=torch.bfloat16).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,))
    tracker = AllocationTracker()
    with tracker:
        logprobs, entropy = vocab_parallel_logprobs(logits, targets, temperature=0.7, chunk_tokens=chunk)
        saved = tracker.current
        (logprobs.sum() - entropy.sum()).backward()
    per_logit = tokens * vocab
    gradient = (memory_plan.LOGITS_PER_LOGIT - 1) * 2 * per_logit  # the logits themselves predate the block
    chunk_bytes = memory_plan.LOGPROB_CHUNK_BYTES_PER_ELEMENT * chunk * vocab
    assert saved < 64 * tokens  # [tokens]-sized statistics only
    assert tracker.peak <= gradient + chunk_bytes + 64 * tokens, tracker.peak / per_logit
    assert tracker.peak >= 2 * per_logit  # the gradient itself was seen: the tracker measures


def test_the_top_k_kl_adds_no_second_gradient_when_fused():
    """Measured allocation, as above (1024 tokens x 4096 bf16 logits, chunks of 64 rows, T = 0.7,
    teacher top 64 given before the block as the micro-batch holds it): the backward peak of log p,
    entropy and top-k KL from the fused kernel is the plain log-prob kernel's plus the teacher
    entries' own bytes (memory_plan.TOP_K_KL_BYTES_PER_ENTRY less the micro-batch's 12), with no
    second logits-sized gradient; the two separate functions add one (2 B a logit). Measured:
    plain 3.51, fused 3.53, separate 6.00 bytes a logit."""
    from megatron_rl.config import memory_plan

    tokens, vocab, chunk, k = 1024, 4096, 64, 64
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(tokens, vocab, generator=g).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), generator=g)
    top_logprobs, top_ids = torch.log_softmax(torch.randn(tokens, vocab, generator=g) * 3, dim=-1).topk(k, dim=-1)

    def backward_peak(kernel: str) -> int:
        logits.grad = None
        tracker = AllocationTracker()
        with tracker:
            if kernel == "fused":
                logprobs, entropy, kl, _ = vocab_parallel_logprobs_and_top_k_kl(
                    logits, targets, top_ids, top_logprobs, temperature=0.7, chunk_tokens=chunk
                )
            else:
                logprobs, entropy = vocab_parallel_logprobs(logits, targets, temperature=0.7, chunk_tokens=chunk)
                kl = torch.zeros(()) if kernel == "plain" else vocab_parallel_top_k_kl(
                    logits, top_ids, top_logprobs, temperature=0.7, chunk_tokens=chunk)[0]  # fmt: skip
            (logprobs.sum() - entropy.sum() + kl.sum()).backward()
        return tracker.peak

    plain, fused, separate = backward_peak("plain"), backward_peak("fused"), backward_peak("separate")
    per_logit = tokens * vocab
    entries = tokens * k * (memory_plan.TOP_K_KL_BYTES_PER_ENTRY - 12)
    assert fused <= plain + entries, (plain / per_logit, fused / per_logit)
    assert separate >= plain + 2 * per_logit, (plain / per_logit, separate / per_logit)  # what fusing saves


class LogitsSizedTensors(AllocationTracker):
    """An AllocationTracker that also records the most storages of exactly `nbytes` alive at once."""

    def __init__(self, nbytes: int):
        super().__init__()
        self.nbytes, self.most = nbytes, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self.most = max(self.most, sum(size == self.nbytes for size in self.live.values()))
        return out


def test_the_policy_loss_with_top_k_kl_holds_one_logits_gradient():
    """policy_loss_func with distillation's top_k_kl (coef 0.5, an entropy bonus, bf16 logits over
    a packed row of 8 samples, teacher top 16) holds at most one bf16 logits-sized tensor at a time
    in its forward and backward passes, as without the term; the two separate kernels on the same
    logits hold three (each one's gradient and autograd's sum of them: the counter sees them).
    (With `logits[0]` for the [1, n, V] -> [n, V] step instead of a squeeze, the policy loss held
    two: select's backward writes zeros and copies the kernel's gradient in.)"""
    (without, with_top_k, separate), metrics = run_ranks(policy_loss_logits_gradients, 1, 2048)[0]
    assert without == with_top_k == 1 and separate >= 2  # measured: 3 (each kernel's and their sum)
    assert metrics["teacher_top_k_kl_sum"] > 1.0 and metrics["teacher_top_k_mass_sum"] > 1.0


def policy_loss_logits_gradients(rank, world_size, vocab):
    """(the most bf16 logits-sized storages alive at once: the policy loss without and with top-k KL,
    the separate log-prob and top-k KL kernels), the top-k metrics; at TP = 1."""
    from megatron_rl.config import AlgorithmConfig
    from megatron_rl.data.packing import pack_into_grid
    from megatron_rl.policy.loss import policy_batch, policy_loss_func
    from tests.support.samples import training_samples
    from tests.support.top_k import add_teacher_top_k

    parallel.initialize_model_parallel()
    samples = add_teacher_top_k(training_samples(8, vocab, seed=7), vocab, 16, seed=7)
    (mb,) = pack_into_grid(samples, 1024, 1, 1, teacher_top_k=True)[0]
    batch = policy_batch(mb)
    logits = torch.randn(1, mb.num_tokens, vocab, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    logits.requires_grad_()
    counts, metrics = [], {}
    for coef in (0.0, 0.5, None):
        logits.grad = None
        tracker = LogitsSizedTensors(logits.numel() * logits.element_size())
        with tracker:
            if coef is None:
                logprobs, entropy = vocab_parallel_logprobs(logits.squeeze(0), batch.targets)
                kl, _ = vocab_parallel_top_k_kl(logits.squeeze(0), batch.teacher_top_ids, batch.teacher_top_logprobs)
                (logprobs.sum() + 0.01 * entropy.sum() + kl.sum()).backward()
            else:
                loss = policy_loss_func(AlgorithmConfig(type="ppo", entropy_coef=0.01), 1.0, teacher_top_k_coef=coef)
                loss_sum, metrics = loss.loss(logits, batch)
                loss_sum.backward()
        counts.append(tracker.most)
    return counts, {name: float(value) for name, value in metrics.items() if name.startswith("teacher_top_k")}
