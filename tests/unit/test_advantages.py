"""Skip-observation GAE, length-adaptive lambda and GRPO advantages against plain references."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_rl.algorithms.advantages import (
    decoupled_gae,
    grpo_advantages,
    length_adaptive_lambda,
    skip_observation_gae,
)
from tests.support.tensors import pad_batch, random_mask


def reference_gae(reward, values, mask, bootstrap, truncated, gamma, lam, kl=None):
    """Plain per-token loop over the action tokens of one sample (the verl/OpenRLHF style)."""
    actions = [t for t in range(len(values)) if mask[t]]
    advantages = [0.0] * len(values)
    returns = [0.0] * len(values)
    running = 0.0
    for i in reversed(range(len(actions))):
        t = actions[i]
        next_value = values[actions[i + 1]] if i + 1 < len(actions) else (bootstrap if truncated else 0.0)
        r = (reward if i == len(actions) - 1 else 0.0) + (kl[t] if kl is not None else 0.0)
        delta = r + gamma * next_value - values[t]
        running = delta + gamma * lam * running
        advantages[t] = running
        returns[t] = running + values[t]
    return advantages, returns


def ordinary_gae(rewards, values, next_value_at_end, gamma, lam):
    """Textbook GAE over a dense sequence of actions (rewards per step)."""
    advantages = [0.0] * len(values)
    running = 0.0
    for t in reversed(range(len(values))):
        next_value = values[t + 1] if t + 1 < len(values) else next_value_at_end
        running = rewards[t] + gamma * next_value - values[t] + gamma * lam * running
        advantages[t] = running
    return advantages


METHODS = ["scan", "blockwise"]


def check_against_reference(rng, batch, max_len, lam_per_sample, kl, method="auto"):
    lengths = [rng.randint(1, max_len) for _ in range(batch)]
    masks = [random_mask(rng, n) for n in lengths]
    values = [[rng.gauss(0, 1) for _ in range(n)] for n in lengths]
    kls = [[rng.gauss(0, 0.1) for _ in range(n)] for n in lengths] if kl else None
    rewards = [rng.gauss(0, 1) for _ in range(batch)]
    boots = [rng.gauss(0, 1) for _ in range(batch)]
    truncated = [rng.random() < 0.5 for _ in range(batch)]
    gamma = rng.choice([1.0, 0.99, rng.random()])
    lams = (
        [rng.random() for _ in range(batch)]
        if lam_per_sample
        else [rng.choice([0.0, 0.95, 1.0, rng.random()])] * batch
    )
    advantages, returns = skip_observation_gae(
        torch.tensor(rewards, dtype=torch.float64),
        pad_batch(values, 123.0, torch.float64),  # padding values must not leak in
        pad_batch(masks, False, torch.bool),
        torch.tensor(boots, dtype=torch.float64),
        torch.tensor(truncated),
        gamma,
        torch.tensor(lams, dtype=torch.float64) if lam_per_sample else lams[0],
        kl_rewards=pad_batch(kls, 0.0, torch.float64) if kl else None,
        method=method,
    )
    assert advantages.dtype == returns.dtype == torch.float64
    for b in range(batch):
        ref_a, ref_r = reference_gae(
            rewards[b], values[b], masks[b], boots[b], truncated[b], gamma, lams[b], kls[b] if kl else None
        )
        n = lengths[b]
        torch.testing.assert_close(
            advantages[b, :n], torch.tensor(ref_a, dtype=torch.float64), atol=1e-9, rtol=0
        )
        torch.testing.assert_close(
            returns[b, :n], torch.tensor(ref_r, dtype=torch.float64), atol=1e-9, rtol=0
        )
        assert (advantages[b, n:] == 0).all() and (returns[b, n:] == 0).all()


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("max_len", [1, 2, 7, 50, 300])
@pytest.mark.parametrize("lam_per_sample", [False, True])
def test_gae_matches_per_token_reference(max_len, lam_per_sample, method):
    rng = random.Random(1000 * max_len + lam_per_sample)
    for _ in range(20):
        check_against_reference(rng, rng.randint(1, 6), max_len, lam_per_sample, kl=False, method=method)


@pytest.mark.parametrize("method", METHODS)
def test_gae_with_kl_rewards_matches_reference(method):
    rng = random.Random(7)
    for _ in range(20):
        check_against_reference(rng, rng.randint(1, 5), 120, rng.random() < 0.5, kl=True, method=method)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), batch=st.integers(1, 4), max_len=st.integers(1, 200))
def test_gae_property(seed, batch, max_len):
    method = METHODS[seed % 2]
    check_against_reference(
        random.Random(seed), batch, max_len, seed % 3 == 0, kl=seed % 5 == 0, method=method
    )


def test_auto_uses_the_compiled_scan_on_cpu():
    from megatron_rl.algorithms import _gae_kernel

    assert _gae_kernel.available()  # numba is a dependency: CPU GAE must not fall back silently


@pytest.mark.parametrize("method", METHODS)
def test_deleting_observations_gives_ordinary_gae(method):
    rng = random.Random(3)
    for _ in range(30):
        n = rng.randint(5, 200)
        mask = random_mask(rng, n)
        if not any(mask):
            mask[-1] = True
        values = [rng.gauss(0, 1) for _ in range(n)]
        reward, boot, truncated = rng.gauss(0, 1), rng.gauss(0, 1), rng.random() < 0.5
        gamma, lam = rng.random(), rng.random()
        advantages, _ = skip_observation_gae(
            torch.tensor([reward], dtype=torch.float64),
            torch.tensor([values], dtype=torch.float64),
            torch.tensor([mask]),
            torch.tensor([boot], dtype=torch.float64),
            torch.tensor([truncated]),
            gamma,
            lam,
            method=method,
        )
        action_values = [v for v, m in zip(values, mask) if m]
        step_rewards = [0.0] * (len(action_values) - 1) + [reward]
        dense = ordinary_gae(step_rewards, action_values, boot if truncated else 0.0, gamma, lam)
        on_actions = advantages[0][torch.tensor(mask)]
        torch.testing.assert_close(on_actions, torch.tensor(dense, dtype=torch.float64), atol=1e-9, rtol=0)
        assert (advantages[0][~torch.tensor(mask)] == 0).all()


@pytest.mark.parametrize("method", METHODS)
def test_gamma_lambda_one_returns_equal_reward(method):
    g = torch.Generator().manual_seed(0)
    mask = torch.rand(8, 64, generator=g) < 0.5
    mask[:, 10] = True
    values = torch.randn(8, 64, generator=g, dtype=torch.float64)
    rewards = torch.randn(8, generator=g, dtype=torch.float64)
    advantages, returns = skip_observation_gae(
        rewards,
        values,
        mask,
        torch.randn(8, dtype=torch.float64),
        torch.zeros(8, dtype=torch.bool),
        1.0,
        1.0,
        method=method,
    )
    expected_returns = rewards[:, None].expand(-1, 64)
    torch.testing.assert_close(returns[mask], expected_returns[mask], atol=1e-12, rtol=0)
    torch.testing.assert_close(advantages[mask], (expected_returns - values)[mask], atol=1e-12, rtol=0)


@pytest.mark.parametrize("method", METHODS)
def test_long_sequence_is_stable_and_exact(method):
    """32k tokens with lambda 0.95 (0.95^32000 underflows float64): no NaN, matches the loop."""
    rng = random.Random(11)
    n = 32_768
    mask = random_mask(rng, n)
    values = [rng.gauss(0, 1) for _ in range(n)]
    for truncated in (False, True):
        advantages, returns = skip_observation_gae(
            torch.tensor([1.5], dtype=torch.float64),
            torch.tensor([values], dtype=torch.float64),
            torch.tensor([mask]),
            torch.tensor([0.7], dtype=torch.float64),
            torch.tensor([truncated]),
            1.0,
            0.95,
            method=method,
        )
        assert torch.isfinite(advantages).all() and torch.isfinite(returns).all()
        ref_a, ref_r = reference_gae(1.5, values, mask, 0.7, truncated, 1.0, 0.95)
        torch.testing.assert_close(advantages[0], torch.tensor(ref_a, dtype=torch.float64), atol=1e-9, rtol=0)
        torch.testing.assert_close(returns[0], torch.tensor(ref_r, dtype=torch.float64), atol=1e-9, rtol=0)


@pytest.mark.parametrize("method", METHODS)
def test_sample_without_action_tokens_gets_zeros(method):
    mask = torch.tensor([[False, False, False], [False, True, True]])
    advantages, returns = skip_observation_gae(
        torch.tensor([1.0, 1.0]),
        torch.ones(2, 3, dtype=torch.float64),
        mask,
        torch.zeros(2),
        torch.zeros(2, dtype=torch.bool),
        1.0,
        1.0,
        method=method,
    )
    assert (advantages[0] == 0).all() and (returns[0] == 0).all()
    torch.testing.assert_close(returns[1], torch.tensor([0.0, 1.0, 1.0], dtype=torch.float64))


def test_length_adaptive_lambda():
    lam = length_adaptive_lambda(torch.tensor([0, 1, 2, 10, 1000]), alpha=1.5)
    expected = [0.0, 1 - 1 / 1.5, 1 - 1 / 3.0, 1 - 1 / 15.0, 1 - 1 / 1500.0]
    torch.testing.assert_close(lam, torch.tensor(expected, dtype=torch.float64))
    # VAPO's alpha 0.05: short sequences clamp to 0.
    small = length_adaptive_lambda(torch.tensor([10, 20, 100]), alpha=0.05)
    torch.testing.assert_close(small, torch.tensor([0.0, 0.0, 0.8], dtype=torch.float64))
    assert ((lam >= 0) & (lam <= 1)).all()


def test_decoupled_gae_uses_each_lambda():
    g = torch.Generator().manual_seed(5)
    mask = torch.rand(4, 40, generator=g) < 0.7
    values = torch.randn(4, 40, generator=g, dtype=torch.float64)
    rewards, boots = torch.randn(4, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
    truncated = torch.tensor([True, False, True, False])
    args = (rewards, values, mask, boots, truncated, 0.99)
    advantages, returns = decoupled_gae(*args, policy_lambda=0.9, value_lambda=1.0)
    torch.testing.assert_close(advantages, skip_observation_gae(*args, 0.9)[0])
    torch.testing.assert_close(returns, skip_observation_gae(*args, 1.0)[1])
    adaptive, _ = decoupled_gae(*args, policy_lambda=0.9, length_adaptive_alpha=1.5)
    lam = length_adaptive_lambda(mask.sum(1), 1.5)
    torch.testing.assert_close(adaptive, skip_observation_gae(*args, lam)[0])
    assert not torch.allclose(adaptive, advantages)


def test_grpo_advantages_match_a_loop():
    rng = random.Random(2)
    rewards = [rng.choice([0.0, 1.0, rng.random()]) for _ in range(24)]
    groups = [i // 4 for i in range(24)]
    rng.shuffle(groups)
    out = grpo_advantages(torch.tensor(rewards, dtype=torch.float64), torch.tensor(groups))
    for i, (r, g) in enumerate(zip(rewards, groups)):
        members = [rewards[j] for j in range(24) if groups[j] == g]
        mean = sum(members) / len(members)
        std = math.sqrt(sum((m - mean) ** 2 for m in members) / (len(members) - 1))
        assert out[i].item() == pytest.approx((r - mean) / (std + 1e-6), abs=1e-9)
    centered = grpo_advantages(
        torch.tensor(rewards, dtype=torch.float64), torch.tensor(groups), normalize_std=False
    )
    assert centered[0].item() == pytest.approx(
        rewards[0] - sum(rewards[j] for j in range(24) if groups[j] == groups[0]) / 4
    )
    # Equal rewards in a group: advantage exactly 0 (no signal), not NaN.
    assert (grpo_advantages(torch.tensor([1.0, 1.0, 0.0, 1.0]), torch.tensor([0, 0, 1, 1]))[:2] == 0).all()
