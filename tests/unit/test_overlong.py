"""Overlong shaping (`orchestrator.overlong`): the soft length penalty against a plain reference,
the sink's shaped rewards (the task's own reward kept as `score`), mask mode (truncated samples
stay in their group's baseline with no loss), the step's metrics, and config errors."""

from __future__ import annotations

import asyncio
import zlib

import numpy as np
import pytest
from transformers import AutoTokenizer

from megatron_rl.config import AdmissionConfig, ConfigError, OverlongConfig
from megatron_rl.envs import Environment, Turn
from megatron_rl.inference.rollout import Completion, TokenTrajectory
from megatron_rl.orchestrator.loop import Orchestrator, Timeouts
from megatron_rl.orchestrator.rollouts import Group, Member, PromptEncoder
from megatron_rl.orchestrator.sink import TrainSink, overlong_penalty
from megatron_rl.orchestrator.state import OrchestratorState
from tests.support.orchestrator import (
    FakeClient,
    FakeCritic,
    FakePolicy,
    FakeWeights,
    orchestrator_config,
)
from tests.support.shipped import ShippedSamples


def reference_penalty(length: int, max_tokens: int, buffer: int, factor: float) -> float:
    """DAPO's soft overlong punishment, case by case."""
    if length <= max_tokens - buffer:
        return 0.0
    return (max_tokens - buffer - length) / buffer * factor


@pytest.mark.parametrize(
    "max_tokens,buffer,factor", [(24, 8, 1.0), (10, 1, 0.5), (100, 99, 2.0), (7, 3, 0.0)]
)
def test_penalty_matches_the_reference_at_every_length(max_tokens, buffer, factor):
    for length in range(max_tokens + 1):
        assert overlong_penalty(length, max_tokens, buffer, factor) == pytest.approx(
            reference_penalty(length, max_tokens, buffer, factor), abs=1e-12
        )
    assert overlong_penalty(max_tokens, max_tokens, buffer, factor) == pytest.approx(-factor)


def member(branch: int, completion_tokens: int, reward: float, truncated: bool = False) -> Member:
    trajectory = TokenTrajectory(prompt_ids=[1, 2, 3])
    finish = "length" if truncated else "stop"
    trajectory.add_completion(Completion([5] * completion_tokens, [-0.1] * completion_tokens, finish,
                                         policy_version=0, worker="fake"))  # fmt: skip
    return Member(
        branch, "finished", trajectory=trajectory, reward=reward, truncated=truncated, episode_done=True
    )


def test_the_sink_adds_the_penalty_and_keeps_the_score():
    sink = TrainSink(AdmissionConfig(reject_identical_rewards=True), OverlongConfig(buffer_tokens=4), 10)
    lengths = [3, 6, 7, 9, 10]
    samples = sink.admit(Group(0, {}, [member(b, n, 1.0, truncated=n == 10) for b, n in enumerate(lengths)]))
    assert [s.score for s in samples] == [1.0] * 5
    assert [s.reward for s in samples] == pytest.approx(
        [1.0 + reference_penalty(n, 10, 4, 1.0) for n in lengths]
    )
    assert all(s.loss_mask.sum() == n for s, n in zip(samples, lengths))  # penalty mode masks nothing
    # The identical-rewards rule compares what the advantages see: equal scores, lengths apart, admitted;
    # equal shaped rewards rejected.
    assert sink.admit(Group(1, {}, [member(0, 3, 1.0), member(1, 9, 1.0)])) is not None
    assert sink.admit(Group(2, {}, [member(0, 3, 1.0), member(1, 5, 1.0)])) is None
    assert sink.judge(Group(3, {}, [member(0, 8, 0.5), member(1, 8, 0.5)])).rule == "identical_rewards"


def test_mask_mode_keeps_truncated_samples_in_the_group_without_loss():
    sink = TrainSink(AdmissionConfig(), OverlongConfig(buffer_tokens=4, mode="mask"), 10)
    samples = sink.admit(Group(0, {}, [member(0, 4, 1.0), member(1, 10, 0.0, truncated=True)]))
    assert len(samples) == 2 and [s.reward for s in samples] == [1.0, 0.0]  # no penalty, still in the group
    assert samples[0].loss_mask.sum() == 4 and not samples[1].loss_mask.any()
    assert samples[1].truncated and len(samples[1]) == 13  # its tokens are still there (for the critic)


class HashEnvironment(Environment):
    """Rewards each completion by a hash of its text: the members of a group differ."""

    def row(self, index: int) -> dict:
        return {"index": index}

    def prompt(self, row: dict) -> str:
        return f"write something, number {row['index']}"

    def step(self, row: dict, completions: list[str]) -> Turn:
        return Turn(reward=(zlib.crc32(completions[-1].encode()) % 9973) / 9973, passed=True)


@pytest.fixture(scope="module")
def encoder(tiny_models):
    return PromptEncoder(AutoTokenizer.from_pretrained(str(tiny_models["qwen3"])))


def run(resolved, encoder):
    events, weights = [], FakeWeights()
    critic = FakeCritic(events) if resolved.value is not None else None
    policy = FakePolicy(weights, events)
    records = []
    orchestrator = ShippedSamples().attach(Orchestrator(
        resolved, HashEnvironment(), encoder, FakeClient(weights), weights, critic, policy.send,
        OrchestratorState(None), records.append, Timeouts(batch_s=60, critic_s=60, weights_s=60),
    ))  # fmt: skip
    asyncio.run(asyncio.wait_for(orchestrator.run(), 60))
    return orchestrator, records


def test_penalty_through_the_loop_and_its_metrics(encoder):
    resolved = orchestrator_config("grpo", num_steps=3, batch_size=4, group_size=2, max_completion_tokens=12,
                                   overlong={"buffer_tokens": 6, "penalty_factor": 0.5})  # fmt: skip
    orchestrator, records = run(resolved, encoder)
    by_step: dict[int, list] = {}
    for step, sample in orchestrator.shipped.items:
        by_step.setdefault(step, []).append(sample)
        expected = reference_penalty(int(sample.loss_mask.sum()), 12, 6, 0.5)
        assert sample.reward == pytest.approx(sample.score + expected, abs=1e-12)
    assert any(s.reward != s.score for _, s in orchestrator.shipped.items)
    for record in records:
        samples = by_step[record["step"]]
        penalties = [s.reward - s.score for s in samples]
        assert record["overlong_shaped"] == sum(p != 0 for p in penalties)
        assert record["overlong_penalty_mean"] == pytest.approx(np.mean(penalties))
        assert record["score_mean"] == pytest.approx(np.mean([s.score for s in samples]))
        assert record["reward_mean"] == pytest.approx(np.mean([s.reward for s in samples]))
        assert record["overlong_masked"] == 0


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_mask_mode_through_the_loop(encoder, algorithm):
    resolved = orchestrator_config(algorithm, num_steps=3, batch_size=4, group_size=2, max_completion_tokens=4,
                                   overlong={"buffer_tokens": 2, "mode": "mask"})  # fmt: skip
    orchestrator, records = run(resolved, encoder)
    shipped = [s for _, s in orchestrator.shipped.items]
    masked = [s for s in shipped if s.truncated]
    assert masked and len(masked) < len(shipped)
    assert all(not s.loss_mask.any() and not s.advantages.any() and s.reward == s.score for s in masked)
    assert sum(r["overlong_masked"] for r in records) == len(masked)
    if algorithm == "grpo":  # a masked member is in its group's baseline: its partner's advantage is not 0
        groups: dict[int, list] = {}
        for s in shipped:
            groups.setdefault(s.group_id, []).append(s)
        mixed = [g for g in groups.values() if len(g) == 2 and sum(s.truncated for s in g) == 1]
        assert mixed
        for group in mixed:
            kept = next(s for s in group if not s.truncated)
            other = next(s for s in group if s.truncated)
            value = float(kept.advantages[kept.loss_mask][0])
            assert np.sign(value) == np.sign(kept.reward - other.reward)


def test_overlong_config_errors_name_the_keys():
    with pytest.raises(ConfigError, match=r"orchestrator\.overlong\.buffer_tokens \(24\) must be less than "
                       r"orchestrator\.max_completion_tokens \(24\)"):  # fmt: skip
        orchestrator_config("grpo", max_completion_tokens=24, overlong={"buffer_tokens": 24})
    with pytest.raises(ConfigError, match=r"orchestrator\.overlong\.buffer_tokens"):
        orchestrator_config("grpo", overlong={"buffer_tokens": 0})
    with pytest.raises(ConfigError, match=r"orchestrator\.overlong\.penalty_factor"):
        orchestrator_config("grpo", overlong={"buffer_tokens": 4, "penalty_factor": -1})
    with pytest.raises(
        ConfigError, match=r"orchestrator\.overlong\.mode 'mask'.*orchestrator\.admission\.drop_truncated"
    ):
        orchestrator_config(
            "grpo", overlong={"buffer_tokens": 4, "mode": "mask"}, admission={"drop_truncated": True}
        )
    assert orchestrator_config("grpo").orchestrator.overlong is None
