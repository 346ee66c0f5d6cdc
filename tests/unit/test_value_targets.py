"""Version-aware value targets (`version_bootstrap_returns`) against a plain per-token loop."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from megatron_rl.algorithms.advantages import skip_observation_gae, version_bootstrap_returns
from tests.support.tensors import pad_batch, random_mask

METHODS = ["scan", "blockwise"]


def reference_targets(
    reward, values, mask, versions, bootstrap, truncated, gamma, lam, current, max_lag, kl=None
):
    """The definition, one action token at a time from the end: G_k = r_k + gamma * V(t_{k+1}),
    plus gamma * lambda * (G_{k+1} - V(t_{k+1})) when k continues into k + 1 (same version, lag
    within max_lag). Returns (returns, cuts) as lists over the sample's tokens."""
    actions = [t for t in range(len(values)) if mask[t]]
    returns = [0.0] * len(values)
    cuts = [False] * len(values)
    later_return = 0.0
    for i in reversed(range(len(actions))):
        t = actions[i]
        last = i == len(actions) - 1
        next_value = (bootstrap if truncated else 0.0) if last else values[actions[i + 1]]
        r = (reward if last else 0.0) + (kl[t] if kl is not None else 0.0)
        fresh = max_lag is None or current - versions[t] <= max_lag
        continues = not last and versions[actions[i + 1]] == versions[t] and fresh
        target = r + gamma * next_value
        if continues:
            target += gamma * lam * (later_return - next_value)
        returns[t] = target
        cuts[t] = not last and not continues
        later_return = target
    return returns, cuts


def layout(*spans):
    """(kind, length, version) spans, kind 'p' prompt, 'a' action, 'o' observation: (mask, versions)."""
    mask, versions = [], []
    for kind, length, version in spans:
        mask += [kind == "a"] * length
        versions += [version] * length
    return mask, versions


# Hand-made trajectories: the policy version that sampled each token, with the version the
# targets are for (current) and the number of cuts expected without a staleness bound.
CASES = {
    "multi_turn_one_version": (layout(("p", 3, 4), ("a", 4, 5), ("o", 3, 5), ("a", 3, 5)), 5, 0),
    "one_boundary": (layout(("p", 2, 3), ("a", 4, 3), ("a", 3, 4)), 4, 1),
    "interrupted_twice": (layout(("p", 2, 2), ("a", 3, 2), ("a", 2, 3), ("a", 4, 4)), 5, 2),
    "boundary_inside_observation": (
        layout(("p", 2, 3), ("a", 3, 3), ("o", 2, 3), ("o", 2, 4), ("a", 3, 4)),
        4,
        1,
    ),
    "observation_version_not_read": (layout(("p", 2, 4), ("a", 3, 4), ("o", 2, 5), ("a", 2, 4)), 6, 0),
    "multi_turn_boundaries_on_actions": (
        layout(("p", 3, 1), ("a", 2, 1), ("a", 2, 2), ("o", 4, 2), ("a", 1, 2), ("a", 3, 3), ("o", 2, 3)),
        3,
        2,
    ),
}


def run_both(mask, versions, values, reward, boot, truncated, gamma, lam, current, max_lag, kl, method):
    """version_bootstrap_returns on one sample and the loop on the same inputs."""
    returns, cuts = version_bootstrap_returns(
        torch.tensor([reward], dtype=torch.float64),
        torch.tensor([values], dtype=torch.float64),
        torch.tensor([mask]),
        torch.tensor([boot], dtype=torch.float64),
        torch.tensor([truncated]),
        gamma,
        lam,
        torch.tensor([versions]),
        current,
        max_lag=max_lag,
        kl_rewards=None if kl is None else torch.tensor([kl], dtype=torch.float64),
        method=method,
    )
    expected, expected_cuts = reference_targets(
        reward, values, mask, versions, boot, truncated, gamma, lam, current, max_lag, kl
    )
    return returns[0], cuts[0], torch.tensor(expected, dtype=torch.float64), torch.tensor(expected_cuts)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("case", list(CASES))
def test_hand_made_trajectories_match_the_loop(case, method):
    (mask, versions), current, boundaries = CASES[case]
    rng = random.Random(case)
    values = [rng.gauss(0, 1) for _ in mask]
    kl = [rng.gauss(0, 0.1) for _ in mask]
    settings = itertools.product((1.0, 0.9), (0.0, 0.9, 1.0), (False, True), (None, 0, 1, 2), (None, kl))
    for gamma, lam, truncated, max_lag, kl_rewards in settings:
        returns, cuts, expected, expected_cuts = run_both(
            mask, versions, values, 1.3, -0.4, truncated, gamma, lam, current, max_lag, kl_rewards, method
        )
        torch.testing.assert_close(returns, expected, atol=1e-12, rtol=0)
        assert torch.equal(cuts, expected_cuts)
        assert (returns[~torch.tensor(mask)] == 0).all()
        if max_lag is None:
            assert int(cuts.sum()) == boundaries


@pytest.mark.parametrize("method", METHODS)
def test_segments_bootstrap_on_the_next_segments_first_value(method):
    """gamma = lambda = 1, by hand: each segment's targets are the critic's value at the next
    segment's first action token; the last segment's are the reward; a stale token's target is
    the value of the next action token."""
    mask, versions = layout(("p", 2, 2), ("a", 3, 2), ("o", 2, 2), ("a", 2, 3), ("a", 3, 4))
    values = [0.5 + 0.25 * t for t in range(len(mask))]  # V(t) = 0.5 + t / 4
    returns, cuts = version_bootstrap_returns(
        torch.tensor([2.0], dtype=torch.float64),
        torch.tensor([values], dtype=torch.float64),
        torch.tensor([mask]),
        torch.tensor([0.0], dtype=torch.float64),
        torch.tensor([False]),
        1.0,
        1.0,
        torch.tensor([versions]),
        4,
        method=method,
    )
    # action tokens 2, 3, 4 (v2) | 7, 8 (v3) | 9, 10, 11 (v4)
    expected = [0.0] * 2 + [values[7]] * 3 + [0.0] * 2 + [values[9]] * 2 + [2.0] * 3
    torch.testing.assert_close(returns[0], torch.tensor(expected, dtype=torch.float64), atol=1e-12, rtol=0)
    assert cuts[0].nonzero().flatten().tolist() == [4, 8]
    stale, _ = version_bootstrap_returns(
        torch.tensor([2.0], dtype=torch.float64),
        torch.tensor([values], dtype=torch.float64),
        torch.tensor([mask]),
        torch.tensor([0.0], dtype=torch.float64),
        torch.tensor([False]),
        1.0,
        1.0,
        torch.tensor([versions]),
        4,
        max_lag=1,
        method=method,
    )
    # version 2 (lag 2) is beyond max_lag 1: one-step targets V(t_{k+1}), the reward is 0 there.
    expected[2:5] = [values[3], values[4], values[7]]
    torch.testing.assert_close(stale[0], torch.tensor(expected, dtype=torch.float64), atol=1e-12, rtol=0)


def random_versions(rng: random.Random, length: int, current: int) -> list[int]:
    """Non-decreasing versions (a rollout continued under each next version) or, one time in
    four, any version per token; all at most `current`."""
    if rng.random() < 0.25:
        return [current - rng.randint(0, 3) for _ in range(length)]
    version = current - rng.randint(0, 4)
    versions = []
    for _ in range(length):
        if rng.random() < 3 / max(length, 1):
            version = min(current, version + rng.randint(1, 2))
        versions.append(version)
    return versions


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("max_len", [1, 5, 40, 300])
def test_random_batches_match_the_loop(max_len, method):
    rng = random.Random(100 * max_len + len(method))
    for _ in range(15):
        batch = rng.randint(1, 6)
        current = rng.randint(3, 9)
        lengths = [rng.randint(1, max_len) for _ in range(batch)]
        masks = [random_mask(rng, n) for n in lengths]
        versions = [random_versions(rng, n, current) for n in lengths]
        values = [[rng.gauss(0, 1) for _ in range(n)] for n in lengths]
        kls = [[rng.gauss(0, 0.1) for _ in range(n)] for n in lengths] if rng.random() < 0.5 else None
        rewards = [rng.gauss(0, 1) for _ in range(batch)]
        boots = [rng.gauss(0, 1) for _ in range(batch)]
        truncated = [rng.random() < 0.5 for _ in range(batch)]
        gamma = rng.choice([1.0, 0.99, rng.random()])
        per_sample = rng.random() < 0.3
        lams = [rng.random() for _ in range(batch)] if per_sample else [rng.choice([0.0, 0.9, 1.0])] * batch
        max_lag = rng.choice([None, 0, 1, 3])
        returns, cuts = version_bootstrap_returns(
            torch.tensor(rewards, dtype=torch.float64),
            pad_batch(values, 123.0, torch.float64),  # padding must not leak in
            pad_batch(masks, False, torch.bool),
            torch.tensor(boots, dtype=torch.float64),
            torch.tensor(truncated),
            gamma,
            torch.tensor(lams, dtype=torch.float64) if per_sample else lams[0],
            pad_batch(versions, current + 7, torch.int64),  # newer than current: only off the actions
            current,
            max_lag=max_lag,
            kl_rewards=None if kls is None else pad_batch(kls, 5.0, torch.float64),
            method=method,
        )
        assert returns.dtype == torch.float64 and cuts.dtype == torch.bool
        for b in range(batch):
            expected, expected_cuts = reference_targets(
                rewards[b],
                values[b],
                masks[b],
                versions[b],
                boots[b],
                truncated[b],
                gamma,
                lams[b],
                current,
                max_lag,
                None if kls is None else kls[b],
            )
            n = lengths[b]
            torch.testing.assert_close(
                returns[b, :n], torch.tensor(expected, dtype=torch.float64), atol=1e-9, rtol=0
            )
            assert cuts[b, :n].tolist() == expected_cuts
            assert (returns[b, n:] == 0).all() and not cuts[b, n:].any()


@pytest.mark.parametrize("method", METHODS)
def test_long_sequence_with_many_boundaries(method):
    """16k tokens, a version boundary every ~500 tokens, lambda 0.95 and 1: matches the loop."""
    rng = random.Random(17)
    n = 16_384
    mask = random_mask(rng, n)
    versions = sorted(rng.randint(0, 30) for _ in range(n))
    values = [rng.gauss(0, 1) for _ in range(n)]
    for lam in (0.95, 1.0):
        returns, _ = version_bootstrap_returns(
            torch.tensor([1.5], dtype=torch.float64),
            torch.tensor([values], dtype=torch.float64),
            torch.tensor([mask]),
            torch.tensor([0.7], dtype=torch.float64),
            torch.tensor([True]),
            1.0,
            lam,
            torch.tensor([versions]),
            30,
            max_lag=25,
            method=method,
        )
        expected, _ = reference_targets(1.5, values, mask, versions, 0.7, True, 1.0, lam, 30, 25)
        torch.testing.assert_close(returns[0], torch.tensor(expected, dtype=torch.float64), atol=1e-9, rtol=0)


@pytest.mark.parametrize("method", METHODS)
def test_one_version_per_sample_is_skip_observation_gae_bit_for_bit(method):
    g = torch.Generator().manual_seed(3)
    batch, length = 6, 200
    mask = torch.rand(batch, length, generator=g) < 0.6
    mask[:, :20] = False  # the prompt
    values = torch.randn(batch, length, generator=g, dtype=torch.float64)
    rewards, boots = torch.randn(batch, dtype=torch.float64), torch.randn(batch, dtype=torch.float64)
    truncated = torch.tensor([True, False, True, False, True, False])
    kl = 0.1 * torch.randn(batch, length, generator=g, dtype=torch.float64)
    sample_versions = torch.tensor([7, 7, 5, 6, 7, 4])
    versions = sample_versions[:, None].expand(batch, length).clone()
    versions[:, :20] = 2  # prompt versions are not read
    args = (rewards, values, mask, boots, truncated, 0.99)
    for lam in (0.9, 1.0, torch.rand(batch, generator=g, dtype=torch.float64)):
        _, gae_returns = skip_observation_gae(*args, lam, kl_rewards=kl, method=method)
        for max_lag in (None, 3):
            returns, cuts = version_bootstrap_returns(
                *args, lam, versions, 7, max_lag=max_lag, kl_rewards=kl, method=method
            )
            assert torch.equal(returns, gae_returns)
            assert not cuts.any()


def call_with_versions(token_versions, current_version=5, max_lag=None):
    mask = torch.tensor([[False, True, True, False, True]])
    return version_bootstrap_returns(
        torch.tensor([1.0], dtype=torch.float64),
        torch.randn(1, 5, dtype=torch.float64),
        mask,
        torch.tensor([0.0], dtype=torch.float64),
        torch.tensor([False]),
        1.0,
        1.0,
        token_versions,
        current_version,
        max_lag=max_lag,
    )


def test_bad_token_versions_are_named():
    with pytest.raises(ValueError, match=r"token_versions: shape \(1, 4\), expected loss_mask's \(1, 5\)"):
        call_with_versions(torch.tensor([[5, 5, 5, 5]]))
    with pytest.raises(
        ValueError,
        match="token_versions: sample 0 has action tokens of version 6, newer than current_version 5",
    ):
        call_with_versions(torch.tensor([[5, 5, 6, 9, 5]]))  # 9 is on an observation token
    with pytest.raises(ValueError, match="token_versions: dtype torch.float32, expected an integer dtype"):
        call_with_versions(torch.tensor([[5.0, 5, 5, 5, 5]]))
    with pytest.raises(ValueError, match="max_lag: -1, expected >= 0 or None"):
        call_with_versions(torch.tensor([[5, 5, 5, 5, 5]]), max_lag=-1)
    # Newer versions off the action tokens (padding, observations) are not read.
    returns, _ = call_with_versions(torch.tensor([[9, 5, 5, 9, 5]]))
    assert torch.isfinite(returns).all()
