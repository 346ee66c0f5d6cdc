"""PPO clip, SAO DIS and value losses: sums over masked tokens (megatron divides by the global
token count), values, gradients, independence of how tokens are split into micro-batches."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.algorithms.losses import (
    entropy_bonus,
    ppo_clip_loss,
    reference_kl,
    reference_kl_loss,
    sao_dis_loss,
    value_loss,
)
from megatron_rl.algorithms.registry import policy_loss_for
from megatron_rl.config import AlgorithmConfig


def random_tokens(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(n, generator=g, dtype=torch.float64) * 3
    # log-ratios spread over [-1.5, 2] so ratios fall below, inside and above every band.
    logprobs = (old + torch.empty(n, dtype=torch.float64).uniform_(-1.5, 2.0, generator=g)).requires_grad_()
    advantages = torch.randn(n, generator=g, dtype=torch.float64)
    mask = torch.rand(n, generator=g) < 0.8
    return logprobs, old, advantages, mask


@pytest.mark.parametrize("seed", range(5))
def test_dis_gradient_is_ratio_times_advantage_inside_the_band(seed):
    logprobs, old, advantages, mask = random_tokens(400, seed)
    loss, metrics = sao_dis_loss(logprobs, old, advantages, mask, eps_low=0.3, eps_high=5.0)
    loss.backward()
    ratio = torch.exp(logprobs.detach() - old)
    inside = (ratio > 0.7) & (ratio < 6.0)
    # d/dlogp of -r*A is -r*A (dr/dlogp = r): the ascent direction is r*A*grad(logp).
    expected = torch.where(mask & inside, -ratio * advantages, 0.0)
    torch.testing.assert_close(logprobs.grad, expected, atol=1e-15, rtol=0)
    for sign in (1, -1):  # both tails are masked whatever the sign of A
        outside = mask & ~inside & (torch.sign(advantages) == sign)
        assert outside.any() and (logprobs.grad[outside] == 0).all()
        assert (logprobs.grad[mask & inside & (torch.sign(advantages) == sign)] != 0).all()
    expected_loss = -(ratio * advantages)[mask & inside].sum()
    torch.testing.assert_close(loss.detach(), expected_loss)
    assert metrics["clipped_sum"] == (mask & ~inside).sum()
    assert metrics["num_tokens"] == mask.sum()


@pytest.mark.parametrize("seed", range(5))
def test_ppo_clip_gradient_is_zero_exactly_where_the_clipped_branch_is_active(seed):
    logprobs, old, advantages, mask = random_tokens(400, seed)
    loss, metrics = ppo_clip_loss(logprobs, old, advantages, mask, eps_low=0.2, eps_high=0.28)
    loss.backward()
    ratio = torch.exp(logprobs.detach() - old)
    clipped_active = ((advantages > 0) & (ratio > 1.28)) | ((advantages < 0) & (ratio < 0.8))
    assert (mask & clipped_active).any() and (mask & ~clipped_active).any()
    expected = torch.where(mask & ~clipped_active, -ratio * advantages, 0.0)
    torch.testing.assert_close(logprobs.grad, expected, atol=1e-15, rtol=0)
    assert metrics["clipped_sum"] == (mask & clipped_active).sum()
    reference = torch.maximum(-ratio * advantages, -ratio.clamp(0.8, 1.28) * advantages)[mask].sum()
    torch.testing.assert_close(loss.detach(), reference)


def test_ppo_dual_clip_bounds_negative_advantages():
    logprobs, old, advantages, mask = random_tokens(400, 9)
    loss, _ = ppo_clip_loss(logprobs, old, advantages, mask, 0.2, 0.2, dual_clip=3.0)
    loss.backward()
    ratio = torch.exp(logprobs.detach() - old)
    dual = mask & (advantages < 0) & (ratio > 3.0)
    assert dual.any()
    assert (logprobs.grad[dual] == 0).all()
    per_token = torch.maximum(-ratio * advantages, -ratio.clamp(0.8, 1.2) * advantages)
    per_token = torch.where((advantages < 0), torch.minimum(per_token, -3.0 * advantages), per_token)
    torch.testing.assert_close(loss.detach(), per_token[mask].sum())


@pytest.mark.parametrize("preset", ["grpo", "ppo"])
def test_the_configs_dual_clip_is_on_at_verls_3_by_default_and_null_turns_it_off(preset):
    """algorithm.dual_clip defaults to verl's clip_ratio_c 3.0: the preset's loss equals the
    per-token reference with the bound -3 A on negative-advantage tokens whose ratio exceeds 3;
    dual_clip: null gives the plain clipped loss."""
    logprobs, old, advantages, mask = random_tokens(400, 9)
    ratio = torch.exp(logprobs.detach() - old)
    plain = torch.maximum(-ratio * advantages, -ratio.clamp(0.8, 1.2) * advantages)
    bounded = torch.where(advantages < 0, torch.minimum(plain, -3.0 * advantages), plain)
    assert (mask & (bounded != plain)).any()  # the bound acts on these tokens
    for dual_clip, expected in ((3.0, bounded), (None, plain)):
        config = AlgorithmConfig(type=preset) if dual_clip else AlgorithmConfig(type=preset, dual_clip=None)
        assert config.dual_clip == dual_clip
        loss, _ = policy_loss_for(config)(logprobs, old, advantages, mask, sequences=None, weights=None)
        torch.testing.assert_close(loss.detach(), expected[mask].sum())


@pytest.mark.parametrize("loss_name", ["ppo", "sao", "value"])
def test_summed_loss_is_independent_of_micro_batch_split(loss_name):
    n = 300
    logprobs, old, advantages, mask = random_tokens(n, 4)
    returns = torch.randn(n, dtype=torch.float64)

    def run(boundaries):
        total = 0.0
        for start, end in zip(boundaries[:-1], boundaries[1:]):
            sl = slice(start, end)
            if loss_name == "ppo":
                part, _ = ppo_clip_loss(logprobs[sl], old[sl], advantages[sl], mask[sl])
            elif loss_name == "sao":
                part, _ = sao_dis_loss(logprobs[sl], old[sl], advantages[sl], mask[sl])
            else:
                part, _ = value_loss(logprobs[sl], returns[sl], mask[sl], old[sl], clip=0.5)
            part.backward()
            total = total + part.detach()
        grad = logprobs.grad.clone()
        logprobs.grad = None
        return total, grad

    loss_a, grad_a = run([0, 300])
    loss_b, grad_b = run([0, 17, 150, 151, 300])
    torch.testing.assert_close(loss_a, loss_b, atol=1e-12, rtol=0)
    torch.testing.assert_close(grad_a, grad_b, atol=1e-15, rtol=0)


def test_value_loss_plain_and_clipped():
    g = torch.Generator().manual_seed(1)
    values = torch.randn(50, generator=g, dtype=torch.float64, requires_grad=True)
    returns = torch.randn(50, generator=g, dtype=torch.float64)
    old = torch.randn(50, generator=g, dtype=torch.float64)
    mask = torch.rand(50, generator=g) < 0.7
    loss, metrics = value_loss(values, returns, mask)
    torch.testing.assert_close(loss, 0.5 * ((values - returns) ** 2)[mask].sum())
    assert metrics["num_tokens"] == mask.sum()
    clipped, metrics = value_loss(values, returns, mask, old_values=old, clip=0.2)
    v_clip = old + (values.detach() - old).clamp(-0.2, 0.2)
    expected = (
        0.5 * torch.maximum((values.detach() - returns) ** 2, (v_clip - returns) ** 2)[mask].sum()
    )
    torch.testing.assert_close(clipped.detach(), expected)
    assert 0 < metrics["clipped_sum"] <= mask.sum()
    with pytest.raises(ValueError, match="old_values is None"):
        value_loss(values, returns, mask, clip=0.2)


def test_fully_masked_micro_batch_contributes_zero_loss_and_gradient():
    logprobs, old, advantages, _ = random_tokens(64, 3)
    mask = torch.zeros(64, dtype=torch.bool)
    for fn in (ppo_clip_loss, sao_dis_loss):
        loss, metrics = fn(logprobs, old, advantages, mask)
        loss.backward()
        assert loss.item() == 0.0 and (logprobs.grad == 0).all() and metrics["num_tokens"] == 0
        logprobs.grad = None


def test_reference_kl_loss_is_k3_zero_at_the_reference_with_zero_gradient():
    from megatron_rl.algorithms.losses import reference_kl_loss

    logprobs = torch.tensor([-1.0, -2.0, -0.5, -3.0], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-1.0, -1.5, -0.7, -9.0], dtype=torch.float64)
    mask = torch.tensor([True, True, True, False])
    loss, metrics = reference_kl_loss(logprobs, ref, mask)
    d = ref - logprobs.detach()
    per_token = torch.exp(d) - d - 1
    assert per_token[0] == 0 and (per_token[:3] >= 0).all()
    assert loss.item() == pytest.approx(per_token[:3].sum().item())
    assert metrics["kl_ref_sum"].item() == pytest.approx(per_token[:3].sum().item())
    loss.backward()
    # d/dlogp (e^d - d - 1) = 1 - e^d: zero where the policies agree, none on masked tokens
    expected = torch.where(mask, 1 - torch.exp(d), 0.0)
    torch.testing.assert_close(logprobs.grad, expected)


@pytest.mark.parametrize("loss_name", ["ppo", "ppo_dual", "dis"])
def test_extreme_ratios_give_finite_loss_and_gradients(loss_name):
    """Ratios of 1e+-40 (log-ratio +-92: float32 exp overflows at 88.7): the loss and every
    gradient stay finite; the clamped tokens get no gradient; in-band tokens keep theirs."""
    log_gap = torch.tensor([[92.1, -92.1, 25.0, -25.0, 0.05, 0.0]])  # ln(1e40) = 92.1
    old = torch.zeros(1, 6)
    for advantage in (1.0, -1.0):
        logprobs = (old + log_gap).clone().requires_grad_(True)
        advantages = torch.full((1, 6), advantage)
        mask = torch.ones(1, 6, dtype=torch.bool)
        if loss_name == "dis":
            loss, metrics = sao_dis_loss(logprobs, old, advantages, mask)
        else:
            dual = 3.0 if loss_name == "ppo_dual" else None
            loss, metrics = ppo_clip_loss(logprobs, old, advantages, mask, dual_clip=dual)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(logprobs.grad).all(), (loss, logprobs.grad)
        assert all(torch.isfinite(torch.as_tensor(v)).all() for v in metrics.values())
        assert (logprobs.grad[0, :2] == 0).all()  # beyond the clamp: no gradient
        assert logprobs.grad[0, 4:].abs().min() > 0  # in band: the usual gradient
        assert abs(loss.item()) < 1e9


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "low_var_kl"])
def test_reference_kl_estimators_are_verls(estimator):
    """k1 = log pi - log pi_ref; k2 = k1^2 / 2; k3 = low_var_kl = exp(-k1) + k1 - 1 with verl's
    clamps; values and gradients token by token, weights and mask applied."""
    logprobs, ref, _, mask = random_tokens(300, 7)
    weights = torch.rand(300, dtype=torch.float64) + 0.5
    loss, metrics = reference_kl_loss(logprobs, ref, mask, estimator, weights)
    loss.backward()
    k = logprobs.detach() - ref
    expected = {"k1": k, "k2": 0.5 * k**2}.get(estimator)
    if expected is None:
        expected = torch.clamp(torch.exp(torch.clamp(-k, -20, 20)) + torch.clamp(-k, -20, 20).neg() - 1, max=10)
    torch.testing.assert_close(reference_kl(logprobs.detach(), ref, estimator), expected)
    torch.testing.assert_close(loss.detach(), (expected * weights)[mask].sum())
    torch.testing.assert_close(metrics["kl_ref_sum"], expected[mask].sum())
    gradient = {"k1": torch.ones_like(k), "k2": k}.get(estimator, 1 - torch.exp(-k))
    inside = torch.abs(k) < 20
    torch.testing.assert_close(logprobs.grad[inside], torch.where(mask, gradient * weights, 0.0)[inside])
    with pytest.raises(ValueError, match="algorithm.kl_estimator: unknown 'k4'"):
        reference_kl(logprobs, ref, "k4")


def test_entropy_bonus_is_the_weighted_masked_sum():
    g = torch.Generator().manual_seed(2)
    entropy = torch.rand(50, generator=g, dtype=torch.float64).requires_grad_()
    mask = torch.rand(50, generator=g) < 0.6
    weights = torch.rand(50, generator=g, dtype=torch.float64)
    bonus = entropy_bonus(entropy, mask, weights)
    bonus.backward()
    torch.testing.assert_close(bonus.detach(), (entropy.detach() * weights)[mask].sum())
    torch.testing.assert_close(entropy.grad, torch.where(mask, weights, 0.0))


@pytest.mark.parametrize("loss_name", ["ppo", "sao"])
def test_policy_losses_weight_each_token(loss_name):
    """Per-token weights (loss aggregation x rollout correction) multiply each token's loss and
    gradient; None is weight 1 exactly."""
    logprobs, old, advantages, mask = random_tokens(300, 5)
    weights = torch.rand(300, dtype=torch.float64)
    fn = ppo_clip_loss if loss_name == "ppo" else sao_dis_loss
    plain, _ = fn(logprobs, old, advantages, mask)
    plain.backward()
    plain_grad = logprobs.grad.clone()
    logprobs.grad = None
    weighted, _ = fn(logprobs, old, advantages, mask, weights=weights)
    weighted.backward()
    torch.testing.assert_close(logprobs.grad, plain_grad * weights)
    ones, _ = fn(logprobs.detach(), old, advantages, mask, weights=torch.ones(300, dtype=torch.float64))
    assert ones == plain.detach()
