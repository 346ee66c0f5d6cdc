"""Distillation top_k_kl on one process: `vocab_parallel_top_k_kl` (value, mass and gradient equal
a plain loop and autograd of the naive formula on the full log-softmax, in chunks, tempered, from
bf16 logits), the fused `vocab_parallel_logprobs_and_top_k_kl` (outputs and the gradient of any
combination of them equal the two separate functions'), the loss term `top_k_distillation_loss`, the teacher's [N, K] rows shifted to the
next token and split over CP ranks by `policy_batch`, and the policy loss's refusal of a batch
without them. TP = 2 against one process: tests/distributed/test_logprobs.py; the policy step
across layouts: tests/distributed/test_policy_update.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_rl.algorithms.losses import top_k_distillation_loss
from megatron_rl.config import AlgorithmConfig
from megatron_rl.data.packing import dummy_micro_batch, pack_into_grid
from megatron_rl.models.logprobs import (
    vocab_parallel_logprobs,
    vocab_parallel_logprobs_and_top_k_kl,
    vocab_parallel_top_k_kl,
)
from megatron_rl.policy.loss import policy_batch, policy_loss_func
from tests.support.samples import training_samples
from tests.support.top_k import add_teacher_top_k


def random_case(tokens: int, vocab: int, k: int, seed: int):
    """Student logits [tokens, vocab], the teacher's top k ids (distinct per row) and
    log-probabilities of a random teacher distribution (mass below 1), weights [tokens]."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, vocab, generator=g) * 4
    teacher = torch.log_softmax(torch.randn(tokens, vocab, generator=g) * 3, dim=-1)
    top_logprobs, top_ids = teacher.topk(k, dim=-1)
    weights = torch.randn(tokens, generator=g)
    return logits, top_ids, top_logprobs, weights


def naive(logits, top_ids, top_logprobs, weights, temperature=1.0):
    """KL_t and m_t by a plain loop over tokens and ids (float64), and the gradient of
    sum_t w_t KL_t w.r.t. the logits by autograd of the formula on the full log-softmax."""
    z = logits.double().clone().requires_grad_()
    log_q = torch.log_softmax(z / temperature, dim=-1)
    kl, mass = [], []
    for t in range(top_ids.shape[0]):
        total, m = 0.0, 0.0
        for j in range(top_ids.shape[1]):
            p = torch.exp(top_logprobs[t, j].double())
            total = total + p * (top_logprobs[t, j].double() - log_q[t, top_ids[t, j]])
            m += float(p)
        kl.append(total)
        mass.append(m)
    kl = torch.stack(kl)
    (weights.double() * kl).sum().backward()
    return kl.detach(), torch.tensor(mass, dtype=torch.float64), z.grad


@pytest.mark.parametrize(
    "tokens, vocab, k, chunk, temperature, seed",
    [(17, 50, 5, None, 1.0, 0), (23, 64, 8, 3, 1.0, 1), (9, 40, 1, 2, 0.7, 2), (30, 33, 33, 7, 1.3, 3)],
)
def test_value_mass_and_gradient_equal_the_naive_formula(tokens, vocab, k, chunk, temperature, seed):
    logits, top_ids, top_logprobs, weights = random_case(tokens, vocab, k, seed)
    want_kl, want_mass, want_grad = naive(logits, top_ids, top_logprobs, weights, temperature)
    x = logits.clone().requires_grad_()
    kl, mass = vocab_parallel_top_k_kl(x, top_ids, top_logprobs, temperature=temperature, chunk_tokens=chunk)
    (weights * kl).sum().backward()
    assert kl.dtype == mass.dtype == torch.float32 and kl.shape == mass.shape == (tokens,)
    torch.testing.assert_close(kl.double(), want_kl, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(mass.double(), want_mass, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(x.grad.double(), want_grad, atol=1e-6, rtol=1e-6)
    assert float(want_kl.abs().min()) > 1e-3 and float(want_grad.abs().max()) > 1e-2
    if k < vocab:
        assert float(mass.max()) < 1.0  # not renormalised
    else:  # the whole vocabulary: the top k is the teacher itself and KL its full forward KL >= 0
        torch.testing.assert_close(mass, torch.ones(tokens), atol=1e-5, rtol=0)
        assert float(kl.detach().min()) > 0


def test_the_gradient_is_mass_times_softmax_minus_the_teachers_probabilities():
    logits, top_ids, top_logprobs, _ = random_case(12, 30, 4, 5)
    x = logits.clone().requires_grad_()
    kl, mass = vocab_parallel_top_k_kl(x, top_ids, top_logprobs, chunk_tokens=5)
    kl.sum().backward()
    expected = mass.unsqueeze(-1) * torch.softmax(logits, dim=-1)
    expected.scatter_add_(-1, top_ids, -top_logprobs.exp())
    torch.testing.assert_close(x.grad, expected, atol=1e-6, rtol=1e-6)
    assert not mass.requires_grad


def test_leading_dims_bf16_logits_and_a_teacher_equal_to_the_student():
    """[1, n, V] bf16 logits give [1, n] results and a bf16 gradient (computed in fp32); a teacher
    whose top k is the student's own distribution on the whole vocabulary has KL 0 and gradient 0."""
    logits, top_ids, top_logprobs, weights = random_case(11, 24, 6, 6)
    low = logits.to(torch.bfloat16)
    x = low[None].clone().requires_grad_()
    kl, mass = vocab_parallel_top_k_kl(x, top_ids[None], top_logprobs[None], chunk_tokens=4)
    (weights * kl[0]).sum().backward()
    assert kl.shape == (1, 11) and x.grad.dtype == torch.bfloat16
    want_kl, _, want_grad = naive(low.float(), top_ids, top_logprobs, weights)
    torch.testing.assert_close(kl[0].double(), want_kl, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(x.grad[0].float(), want_grad.float().to(torch.bfloat16).float(), atol=1e-2, rtol=1e-2)
    own_logprobs, own_ids = torch.log_softmax(logits, dim=-1).sort(dim=-1, descending=True)
    y = logits.clone().requires_grad_()
    kl, mass = vocab_parallel_top_k_kl(y, own_ids, own_logprobs, chunk_tokens=3)
    kl.sum().backward()
    torch.testing.assert_close(kl, torch.zeros(11), atol=1e-5, rtol=0)
    torch.testing.assert_close(y.grad, torch.zeros_like(logits), atol=1e-6, rtol=0)


def test_shapes_and_temperature_are_checked():
    logits, top_ids, top_logprobs, _ = random_case(5, 20, 3, 7)
    with pytest.raises(ValueError, match=r"top_ids \(5, 3\) and top_logprobs \(5, 2\)"):
        vocab_parallel_top_k_kl(logits, top_ids, top_logprobs[:, :2])
    with pytest.raises(ValueError, match=r"top_ids \(4, 3\)"):
        vocab_parallel_top_k_kl(logits, top_ids[:4], top_logprobs[:4])
    with pytest.raises(ValueError, match="temperature must be > 0"):
        vocab_parallel_top_k_kl(logits, top_ids, top_logprobs, temperature=0.0)


# Which outputs the upstream loss differentiates: (log p, entropy, KL).
DIFFERENTIATED = [(True, False, False), (True, True, False), (True, False, True), (True, True, True),
                  (False, True, False), (False, False, True), (False, True, True)]  # fmt: skip


@pytest.mark.parametrize("used", DIFFERENTIATED)
@pytest.mark.parametrize(
    "tokens, vocab, k, chunk, temperature, seed",
    [(17, 50, 5, None, 1.0, 10), (23, 64, 8, 3, 0.7, 11), (30, 33, 33, 7, 1.3, 12)],
)
def test_the_fused_kernel_equals_the_separate_functions(used, tokens, vocab, k, chunk, temperature, seed):
    """log p, entropy, KL and mass equal `vocab_parallel_logprobs`' and `vocab_parallel_top_k_kl`'s,
    and the one gradient it writes equals the sum autograd makes of theirs, for random upstream
    gradients on the differentiated outputs (float32, 1e-6), in chunks, at T != 1 too."""
    logits, top_ids, top_logprobs, _ = random_case(tokens, vocab, k, seed)
    g = torch.Generator().manual_seed(seed + 100)
    targets = torch.randint(0, vocab, (tokens,), generator=g)
    upstream = torch.randn(3, tokens, generator=g)
    separate_x, fused_x = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    logprobs, entropy = vocab_parallel_logprobs(separate_x, targets, temperature=temperature, chunk_tokens=chunk)
    kl, mass = vocab_parallel_top_k_kl(separate_x, top_ids, top_logprobs, temperature=temperature, chunk_tokens=chunk)
    separate = (logprobs, entropy, kl, mass)
    fused = vocab_parallel_logprobs_and_top_k_kl(fused_x, targets, top_ids, top_logprobs,
                                                 temperature=temperature, chunk_tokens=chunk)  # fmt: skip
    for got, want in zip(fused, separate):
        assert got.dtype == torch.float32 and got.shape == (tokens,)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    assert not fused[3].requires_grad

    def upstream_loss(outputs):
        return sum((w * out).sum() for w, out, use in zip(upstream, outputs[:3], used) if use)

    upstream_loss(separate).backward()
    upstream_loss(fused).backward()
    torch.testing.assert_close(fused_x.grad, separate_x.grad, atol=1e-6, rtol=1e-6)
    assert float(separate_x.grad.abs().max()) > 1e-2


def test_the_fused_kernel_from_bf16_logits_with_leading_dims_equals_the_separate_functions():
    """[1, n, V] bf16 logits: [1, n] results equal the separate functions' exactly (the same fp32
    sums), and the bf16 gradient equals theirs up to bf16 rounding of their two gradients' sum."""
    logits, top_ids, top_logprobs, weights = random_case(11, 24, 6, 13)
    low = logits.to(torch.bfloat16)[None]
    targets = torch.randint(0, 24, (1, 11), generator=torch.Generator().manual_seed(13))
    separate_x, fused_x = low.clone().requires_grad_(), low.clone().requires_grad_()
    logprobs, entropy = vocab_parallel_logprobs(separate_x, targets, temperature=0.8, chunk_tokens=4)
    kl, mass = vocab_parallel_top_k_kl(separate_x, top_ids[None], top_logprobs[None], temperature=0.8, chunk_tokens=4)
    fused = vocab_parallel_logprobs_and_top_k_kl(fused_x, targets, top_ids[None], top_logprobs[None],
                                                 temperature=0.8, chunk_tokens=4)  # fmt: skip
    for got, want in zip(fused, (logprobs, entropy, kl, mass)):
        assert got.shape == (1, 11)
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    (weights * (logprobs - 0.1 * entropy + kl)[0]).sum().backward()
    (weights * (fused[0] - 0.1 * fused[1] + fused[2])[0]).sum().backward()
    assert fused_x.grad.dtype == torch.bfloat16
    torch.testing.assert_close(fused_x.grad.float(), separate_x.grad.float(), atol=1e-2, rtol=1e-2)


def test_the_fused_kernel_checks_shapes_and_temperature():
    logits, top_ids, top_logprobs, _ = random_case(5, 20, 3, 7)
    targets = torch.zeros(5, dtype=torch.long)
    with pytest.raises(ValueError, match=r"top_ids \(5, 3\) and top_logprobs \(5, 2\)"):
        vocab_parallel_logprobs_and_top_k_kl(logits, targets, top_ids, top_logprobs[:, :2])
    with pytest.raises(ValueError, match=r"targets \(4,\) must be the logits' tokens \(5,\)"):
        vocab_parallel_logprobs_and_top_k_kl(logits, targets[:4], top_ids, top_logprobs)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        vocab_parallel_logprobs_and_top_k_kl(logits, targets, top_ids, top_logprobs, temperature=0.0)


def test_the_loss_term_weights_masked_tokens_and_reports_unweighted_sums():
    g = torch.Generator().manual_seed(8)
    kl = torch.rand(40, generator=g, dtype=torch.float64).requires_grad_()
    mass = torch.rand(40, generator=g, dtype=torch.float64)
    mask = torch.rand(40, generator=g) < 0.6
    weights = torch.rand(40, generator=g, dtype=torch.float64)
    loss, metrics = top_k_distillation_loss(kl, mass, mask, weights)
    loss.backward()
    expected = sum(float(weights[t] * kl[t]) for t in range(40) if mask[t])
    assert float(loss) == pytest.approx(expected, rel=1e-12)
    assert float(metrics["teacher_top_k_kl_sum"]) == pytest.approx(sum(float(kl[t]) for t in range(40) if mask[t]))
    assert float(metrics["teacher_top_k_mass_sum"]) == pytest.approx(sum(float(mass[t]) for t in range(40) if mask[t]))
    torch.testing.assert_close(kl.grad, torch.where(mask, weights, 0.0))
    unweighted, _ = top_k_distillation_loss(kl, mass, mask)
    assert float(unweighted) == pytest.approx(float(metrics["teacher_top_k_kl_sum"]), rel=1e-12)


@pytest.mark.parametrize("cp", [1, 2])
def test_policy_batch_shifts_the_teachers_rows_to_the_next_token_on_each_cp_rank(cp):
    """Position p of a sequence carries the row of token p + 1 (the teacher's top k for the
    action token it predicts); the last position of every sequence and the padding carry ids 0,
    log-probabilities 0; the CP ranks' slices, joined, are the whole row's."""
    samples = add_teacher_top_k(training_samples(9, 50, seed=3), 50, 4, seed=3)
    (mb,) = pack_into_grid(samples, 512, 1, cp, teacher_top_k=True)[0]
    batches = [policy_batch(mb, rank, cp) for rank in range(cp)]
    ids = torch.cat([b.teacher_top_ids for b in batches])
    logprobs = torch.cat([b.teacher_top_logprobs for b in batches])
    loss_mask = torch.cat([b.loss_mask for b in batches])
    assert ids.dtype == torch.long and logprobs.dtype == torch.float32 and ids.shape == (mb.num_tokens, 4)
    expected_ids, expected_logprobs = np.zeros((mb.num_tokens, 4)), np.zeros((mb.num_tokens, 4))
    for start, end, index in zip(mb.cu_seqlens[:-1], mb.cu_seqlens[1:], mb.sample_index[mb.cu_seqlens[:-1]]):
        sample = samples[index]
        for p in range(end - start - 1):
            expected_ids[start + p] = sample.teacher_top_ids[p + 1]
            expected_logprobs[start + p] = sample.teacher_top_logprobs[p + 1]
    np.testing.assert_array_equal(ids.numpy(), expected_ids)
    np.testing.assert_array_equal(logprobs.numpy(), expected_logprobs.astype(np.float32))
    # Every action position carries a teacher row (log-probabilities < 0), the others none.
    assert bool((logprobs[loss_mask] < 0).all()) and bool((logprobs[~loss_mask] == 0).all())


def test_the_policy_loss_refuses_action_tokens_without_the_teachers_top_k():
    samples = training_samples(4, 50, seed=4)
    (mb,) = pack_into_grid(samples, 256, 1, 1)[0]
    loss = policy_loss_func(AlgorithmConfig(type="ppo"), 1.0, teacher_top_k_coef=0.5).loss
    logits = torch.zeros(1, mb.num_tokens, 50)
    with pytest.raises(ValueError, match="distillation top_k_kl needs the teacher's top-k ids"):
        loss(logits, policy_batch(mb))
    dummy = policy_batch(dummy_micro_batch(2))
    assert dummy.teacher_top_ids is None and not bool(dummy.loss_mask.any())
    with pytest.raises(ValueError, match="distillation kl_penalty needs the teacher's log-probabilities"):
        policy_loss_func(AlgorithmConfig(type="ppo"), 1.0, teacher_coef=0.5).loss(logits, policy_batch(mb))
