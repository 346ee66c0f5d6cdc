"""Algorithm classes: one scorer call per group, reply validation, annotation in order."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from megatron_rl.algorithms import (
    CriticAlgorithm,
    OutcomeAlgorithm,
    ScoreReplyError,
    decoupled_gae,
    make_algorithm,
)
from megatron_rl.algorithms.registry import policy_loss_for
from megatron_rl.config import AlgorithmConfig
from megatron_rl.data import ScoreResult, TrainingSample
from tests.support.orchestrator import InProcessScorer


def make_group(group_id: int, lengths: list[int], seed: int = 0) -> list[TrainingSample]:
    rng = np.random.default_rng(seed)
    samples = []
    for branch, n in enumerate(lengths):
        mask = rng.random(n) < 0.6
        mask[:2] = False  # prompt
        mask[-1] = True
        samples.append(
            TrainingSample(
                token_ids=rng.integers(0, 500, n),
                loss_mask=mask,
                inference_logprobs=np.where(mask, -rng.random(n), 0.0),
                reward=float(rng.normal()),
                truncated=bool(branch % 2),
                group_id=group_id,
                branch_index=branch,
            )
        )
    return samples


def fake_critic(batched: list[list[int]]) -> ScoreResult:
    """Deterministic values from the token ids, so each sequence's values are its own."""
    values = [np.array([((t * 37) % 101) / 101.0 for t in ids], dtype=np.float32) for ids in batched]
    return ScoreResult(values=values, bootstrap_values=[float(len(ids)) / 100 for ids in batched], step=3)


def run(coro):
    return asyncio.run(coro)


def test_make_algorithm_picks_classes_and_sao_defaults():
    scorer = InProcessScorer(fake_critic)
    assert isinstance(make_algorithm(AlgorithmConfig(type="grpo")), OutcomeAlgorithm)
    assert type(make_algorithm(AlgorithmConfig(type="ppo"), scorer)) is CriticAlgorithm
    sao = make_algorithm(AlgorithmConfig(type="sao"), scorer)
    assert isinstance(sao, CriticAlgorithm) and sao.needs_critic
    assert (sao.config.eps_low, sao.config.eps_high, sao.config.length_adaptive_alpha) == (0.3, 5.0, 1.5)
    assert (sao.config.advantage, sao.config.policy_loss) == ("gae", "dis")
    with pytest.raises(ValueError, match=r"'gae' \(algorithm.type 'ppo'\) needs a ValueScorer"):
        make_algorithm(AlgorithmConfig(type="ppo"))


@pytest.mark.parametrize("algorithm_type", ["ppo", "sao"])
def test_score_samples_one_call_per_group_in_order(algorithm_type):
    scorer = InProcessScorer(fake_critic)
    algorithm = make_algorithm(AlgorithmConfig(type=algorithm_type, gamma=0.99), scorer)
    groups = [make_group(g, [5 + 3 * g, 17, 9 + g], seed=g) for g in range(3)]
    for group in groups:
        run(algorithm.prepare_group(group))
    assert len(scorer.calls) == 3
    for call, group in zip(scorer.calls, groups):
        assert call == [s.token_ids.tolist() for s in group]
        expected = fake_critic(call)
        for sample, values, boot in zip(group, expected.values, expected.bootstrap_values):
            np.testing.assert_array_equal(sample.values, values)
            assert sample.bootstrap_value == pytest.approx(boot)
    # Advantages and returns equal a direct decoupled GAE call on the same group.
    group = groups[1]
    c = algorithm.config
    longest = max(len(s) for s in group)

    def pad(rows, dtype):
        out = torch.zeros(len(rows), longest, dtype=dtype)
        for i, r in enumerate(rows):
            out[i, : len(r)] = torch.as_tensor(r)
        return out

    advantages, returns = decoupled_gae(
        torch.tensor([s.reward for s in group], dtype=torch.float64),
        pad([s.values for s in group], torch.float64),
        pad([s.loss_mask for s in group], torch.bool),
        torch.tensor([s.bootstrap_value for s in group], dtype=torch.float64),
        torch.tensor([s.truncated for s in group]),
        c.gamma,
        c.policy_lambda,
        c.value_lambda,
        c.length_adaptive_alpha,
    )
    for i, sample in enumerate(group):
        np.testing.assert_allclose(sample.advantages, advantages[i, : len(sample)].numpy(), atol=1e-6)
        np.testing.assert_allclose(sample.returns, returns[i, : len(sample)].numpy(), atol=1e-6)
        assert (sample.advantages[~sample.loss_mask] == 0).all()


def test_score_reply_with_wrong_sequence_count_is_rejected():
    short = InProcessScorer(
        lambda b: ScoreResult(values=fake_critic(b).values[:-1], bootstrap_values=[0.0] * len(b))
    )
    algorithm = CriticAlgorithm(AlgorithmConfig(type="ppo"), short)
    with pytest.raises(
        ScoreReplyError, match=r"group 4: 2 value rows and 3 bootstrap values for 3 sequences"
    ):
        run(algorithm.prepare_group(make_group(4, [6, 7, 8])))
    missing_boot = InProcessScorer(lambda b: ScoreResult(values=fake_critic(b).values, bootstrap_values=[]))
    with pytest.raises(ScoreReplyError, match="0 bootstrap values"):
        run(CriticAlgorithm(AlgorithmConfig(type="ppo"), missing_boot).prepare_group(make_group(4, [6, 7])))


def test_score_reply_with_wrong_length_is_rejected():
    def truncating(batched):
        reply = fake_critic(batched)
        reply.values[1] = reply.values[1][:-1]
        return reply

    algorithm = CriticAlgorithm(AlgorithmConfig(type="sao"), InProcessScorer(truncating))
    group = make_group(9, [6, 7, 8])
    with pytest.raises(ScoreReplyError, match=r"group 9, sequence 1: 6 values for 7 tokens"):
        run(algorithm.prepare_group(group))


def test_grpo_broadcasts_group_advantage_onto_action_tokens():
    algorithm = OutcomeAlgorithm(AlgorithmConfig(type="grpo"))
    group = make_group(0, [6, 8, 10, 12], seed=3)
    run(algorithm.prepare_group(group))
    rewards = np.array([s.reward for s in group])
    expected = (rewards - rewards.mean()) / (rewards.std(ddof=1) + 1e-6)
    for sample, value in zip(group, expected):
        assert np.allclose(sample.advantages[sample.loss_mask], value, atol=1e-6)
        assert (sample.advantages[~sample.loss_mask] == 0).all()


@pytest.mark.parametrize("algorithm_type", ["grpo", "ppo", "sao"])
def test_the_policy_objective_is_dis_for_sao_and_clip_otherwise(algorithm_type):
    g = torch.Generator().manual_seed(0)
    logprobs = torch.randn(100, generator=g, dtype=torch.float64)
    old = logprobs + torch.empty(100, dtype=torch.float64).uniform_(-1, 1, generator=g)
    advantages = torch.randn(100, generator=g, dtype=torch.float64)
    mask = torch.ones(100, dtype=torch.bool)
    loss, _ = policy_loss_for(AlgorithmConfig(type=algorithm_type))(logprobs, old, advantages, mask)
    ratio = torch.exp(logprobs - old)
    if algorithm_type == "sao":  # the SAO defaults: band (0.7, 6.0)
        inside = (ratio > 0.7) & (ratio < 6.0)
        torch.testing.assert_close(loss, -(ratio * advantages)[inside].sum())
    else:
        expected = torch.maximum(-ratio * advantages, -ratio.clamp(0.8, 1.2) * advantages).sum()
        torch.testing.assert_close(loss, expected)


def test_training_sample_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match=r"group 2, branch 1\): loss_mask has 3 entries for 4 tokens"):
        TrainingSample(
            token_ids=[1, 2, 3, 4],
            loss_mask=[True] * 3,
            inference_logprobs=[0.0] * 4,
            reward=1.0,
            group_id=2,
            branch_index=1,
        )
