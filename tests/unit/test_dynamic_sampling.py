"""Dynamic sampling (`orchestrator.dynamic_sampling`): the dispatcher under random settings with a
fake generator whose groups are rejected at a known rate, decided by group id so the admitted
stream is known in advance. Every step: the batch is full unless the bound stopped it ("train"),
the step never consumes more than `batch_size + max_extra_groups` groups (but for the one
admitted group a "train" step waits for when none was admitted yet), occupancy never exceeds the
lead gate's capacity, no shipped group was generated before version n - L or is staler than the
bound, and the counts add up to every group consumed, each in exactly one step. Then the same
through the orchestrator's loop: smaller batches pack and ship, metrics, resume."""

from __future__ import annotations

import asyncio
import random
import zlib
from collections import Counter
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from megatron_rl.config import AdmissionConfig, ConfigError
from megatron_rl.envs import Environment, Turn
from megatron_rl.inference.rollout import Completion, TokenTrajectory
from megatron_rl.orchestrator.dispatcher import Dispatcher, DynamicSamplingLimit
from megatron_rl.orchestrator.loop import Orchestrator, Timeouts
from megatron_rl.orchestrator.rollouts import Group, Member, PromptEncoder
from megatron_rl.orchestrator.sink import TrainSink
from megatron_rl.orchestrator.state import OrchestratorState
from tests.support.orchestrator import (
    FakeClient,
    FakeCritic,
    FakePolicy,
    FakeWeights,
    orchestrator_config,
)
from tests.support.shipped import ShippedSamples


def rule_of(seed: int, group_id: int, reject_rate: float) -> str | None:
    """The admission rule that rejects group `group_id` (None: admitted), at `reject_rate`."""
    draw = random.Random(f"{seed}:{group_id}").random()
    if draw < reject_rate / 2:
        return "no_member_left"
    return "identical_rewards" if draw < reject_rate else None


class Harness:
    """One Dispatcher, a fake generator (groups rejected by `rule_of`) and a fake trainer that
    makes version n + 1 live some time after batch n ships; checks the lead gate at every fill."""

    def __init__(self, seed, batch_size, lead, max_lag, reject_rate, sampling, group_size=2, rule=None):
        self.seed, self.lead, self.max_lag = seed, lead, max_lag
        self.rule = rule or (lambda group_id: rule_of(seed, group_id, reject_rate))
        self.group_size, self.version = group_size, 0
        self.rng = random.Random(seed)
        self.started: dict[int, int] = {}  # group id -> version live when its generation began
        self.sink = TrainSink(AdmissionConfig(reject_identical_rewards=True))
        harness = self

        class Checked(Dispatcher):
            def fill(self):
                harness.check_gate()
                super().fill()
                harness.check_gate()

        self.dispatcher = Checked(self.start_group, self.sink.judge, batch_size, lead, max_lag,
                                  lambda: self.version, dynamic_sampling=sampling)  # fmt: skip

    def check_gate(self) -> None:
        d = self.dispatcher
        assert d.occupancy() <= d.capacity(), (d.occupancy(), d.capacity(), d.shipped_batches, self.version)

    async def start_group(self, group_id: int, row: int) -> Group:
        version = self.started[group_id] = self.version
        await asyncio.sleep(self.rng.random() * 0.003)
        rule, members = self.rule(group_id), []
        for branch in range(self.group_size):
            if rule == "no_member_left":
                members.append(Member(branch, "cancelled", error="cancelled"))
                continue
            trajectory = TokenTrajectory(prompt_ids=[1, 2])
            trajectory.add_completion(
                Completion([3, 4], [-0.5, -0.5], "stop", policy_version=version, worker="fake")
            )
            reward = 0.5 if rule == "identical_rewards" else float(branch)
            members.append(
                Member(branch, "finished", trajectory=trajectory, reward=reward, episode_done=True)
            )
        return Group(group_id, {"row": row}, members)

    async def train(self, step: int, seconds: float) -> None:
        await asyncio.sleep(seconds)
        self.version = max(self.version, step + 1)
        self.dispatcher.notify()

    async def run(self, num_steps: int, train_s: float):
        batches, counts, trainers = [], [], []
        for step in range(num_steps):
            while self.version < step - self.lead:  # the loop's wait for version n - L
                await asyncio.sleep(0.001)
            first = self.dispatcher.next_to_ship
            batch = await self.dispatcher.next_batch(step, timeout_s=30)
            self.check_gate()
            for group, samples in batch:
                assert step - self.started[group.group_id] <= self.lead  # the gate at generation
                assert all(step - s.policy_version <= self.max_lag for s in samples)  # staleness
            batches.append((first, [group.group_id for group, _ in batch]))
            counts.append(self.dispatcher.last_counts)
            trainers.append(asyncio.ensure_future(self.train(step, train_s * self.rng.random())))
        self.dispatcher.cancel()
        await asyncio.gather(*trainers)
        return batches, counts


def reference_batches(rule, batch_size: int, sampling, num_steps: int) -> list[list[int]]:
    """A plain loop over the ordered stream when nothing goes stale."""
    cursor, out = 0, []
    for _ in range(num_steps):
        batch, consumed = [], 0
        while len(batch) < batch_size:
            if (
                sampling
                and sampling.on_limit == "train"
                and batch
                and consumed >= batch_size + sampling.max_extra_groups
            ):
                break
            if rule(cursor) is None:
                batch.append(cursor)
            cursor, consumed = cursor + 1, consumed + 1
        out.append(batch)
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    batch_size=st.integers(1, 5),
    lead=st.integers(0, 3),
    max_lag=st.integers(0, 3),
    reject_rate=st.sampled_from([0.0, 0.3, 0.6, 0.9]),
    max_extra=st.none() | st.integers(0, 6),
    on_limit=st.sampled_from(["train", "wait"]),
    train_s=st.sampled_from([0.0, 0.005]),
)
def test_dynamic_sampling_bounds_and_counts(seed, batch_size, lead, max_lag, reject_rate, max_extra, on_limit,
                                            train_s):  # fmt: skip
    sampling = None if max_extra is None else SimpleNamespace(max_extra_groups=max_extra, on_limit=on_limit)
    harness = Harness(seed, batch_size, lead, max_lag, reject_rate, sampling)
    num_steps = 6
    batches, counts = asyncio.run(harness.run(num_steps, train_s))
    consumed = 0
    for (first, ids), c in zip(batches, counts):
        assert first == consumed  # steps consume consecutive ranges of the stream
        span = range(first, first + c.generated)
        rules = {g: harness.rule(g) for g in span}
        assert ids == sorted(ids) and set(ids) <= {g for g in span if rules[g] is None}
        assert c.rejected == Counter(r for r in rules.values() if r is not None)  # by rule, every one
        assert c.admitted == len(ids) >= 1
        assert c.generated == c.admitted + sum(c.rejected.values()) + c.stale
        if len(ids) == batch_size:  # a full step ends on the group that completed it
            assert ids[-1] == span[-1]
        not_admitted = c.generated - c.admitted
        if sampling is None:
            assert not c.limit_hit and not c.partial and len(ids) == batch_size
        else:
            assert c.limit_hit == (not_admitted > max_extra)
            assert c.partial == (len(ids) < batch_size)
            if on_limit == "wait" or not c.limit_hit:  # the bound allows a full batch: it is full
                assert len(ids) == batch_size
            if on_limit == "train" and c.generated > batch_size + max_extra:  # to find a first admitted one
                assert c.admitted == 1 and ids == [span[-1]]
            if c.partial:  # only at the bound
                assert c.generated >= batch_size + max_extra
        consumed += c.generated
    assert consumed == harness.dispatcher.next_to_ship  # every consumed group counted in one step
    if max_lag >= lead:  # nothing can go stale: the batches are the plain loop's
        assert all(c.stale == 0 for c in counts)
        assert [ids for _, ids in batches] == reference_batches(harness.rule, batch_size, sampling, num_steps)


def test_without_a_bound_and_below_it_the_batches_are_todays():
    """No dynamic_sampling, and a bound never reached, give the same groups in the same batches."""
    runs = []
    for sampling in (None, SimpleNamespace(max_extra_groups=10_000, on_limit="train")):
        harness = Harness(7, 3, 1, 1, 0.6, sampling)
        runs.append([ids for _, ids in asyncio.run(harness.run(8, 0.002))[0]])
    assert runs[0] == runs[1] == reference_batches(lambda g: rule_of(7, g, 0.6), 3, None, 8)


def test_stop_raises_naming_the_key_and_the_rejections():
    sampling = SimpleNamespace(max_extra_groups=1, on_limit="stop")
    harness = Harness(0, 2, 1, 1, 0.0, sampling, rule=lambda g: "identical_rewards" if g in (1, 2) else None)
    with pytest.raises(DynamicSamplingLimit, match=r"orchestrator\.dynamic_sampling\.max_extra_groups \(1\) passed: "
                       r"3 groups consumed, 1 of 2 admitted \(rejected by rule: \{'identical_rewards': 2\}"):  # fmt: skip
        asyncio.run(harness.run(1, 0.0))


def test_train_after_a_smaller_batch_restarts_groups_that_would_pass_the_gate():
    """L = 0: a smaller batch leaves replacement groups running that batch n + 1 would otherwise
    train on although version n generated them; they are cancelled and started again (same ids)."""
    sampling = SimpleNamespace(max_extra_groups=0, on_limit="train")
    harness = Harness(0, 4, 0, 3, 0.0, sampling, rule=lambda g: "identical_rewards" if g == 1 else None)
    batches, counts = asyncio.run(harness.run(3, 0.0))
    assert [ids for _, ids in batches] == [[0, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert counts[0].partial and counts[0].limit_hit and counts[0].generated == 4
    assert not counts[1].partial and counts[1].generated == 4
    assert harness.started[4] == 1  # group 4 trained at step 1 was generated by version 1


# -- through the loop -------------------------------------------------------------------------


class RejectingEnvironment(Environment):
    """Rows drawn below `rate` give every member one reward (rejected by reject_identical_rewards);
    the others reward each completion by a hash of its text (distinct members)."""

    def __init__(self, rate: float, seed: int = 0):
        self.rate, self.seed = rate, seed

    def row(self, index: int) -> dict:
        return {"index": index, "flat": random.Random(f"{self.seed}:{index}").random() < self.rate}

    def prompt(self, row: dict) -> str:
        return f"say anything, number {row['index']}"

    def step(self, row: dict, completions: list[str]) -> Turn:
        if row["flat"]:
            return Turn(reward=0.5, passed=False)
        return Turn(reward=(zlib.crc32(completions[-1].encode()) % 9973) / 9973, passed=True)


@pytest.fixture(scope="module")
def encoder(tiny_models):
    return PromptEncoder(AutoTokenizer.from_pretrained(str(tiny_models["qwen3"])))


def build(resolved, encoder, env, state=None, train_s=0.0):
    events, weights = [], FakeWeights()
    critic = FakeCritic(events) if resolved.value is not None else None
    policy = FakePolicy(weights, events, train_s)
    records = []
    orchestrator = ShippedSamples().attach(Orchestrator(
        resolved, env, encoder, FakeClient(weights, delay_s=0.002), weights, critic, policy.send,
        state or OrchestratorState(None), records.append, Timeouts(batch_s=60, critic_s=60, weights_s=60),
    ))  # fmt: skip
    return orchestrator, policy, critic, records


@pytest.mark.parametrize("algorithm", ["grpo", "sao"])
def test_smaller_batches_pack_ship_and_are_measured(encoder, algorithm):
    resolved = orchestrator_config(
        algorithm, num_steps=5, batch_size=3, group_size=2, max_async_level=1, max_off_policy_steps=1,
        admission={"reject_identical_rewards": True},
        dynamic_sampling={"max_extra_groups": 1, "on_limit": "train"},
    )  # fmt: skip
    resolved.algorithm.policy_minibatches = 6  # more than a smaller batch's samples
    env = RejectingEnvironment(0.5)
    orchestrator, policy, critic, records = build(resolved, encoder, env, train_s=0.01)
    asyncio.run(asyncio.wait_for(orchestrator.run(), 60))
    assert len(records) == 5
    for r in records:
        assert (
            r["groups_generated"]
            == r["groups_admitted"] + sum(r["groups_rejected"].values()) + r["stale_dropped"]
        )
        assert r["extra_generation"] == max(0, r["groups_generated"] - 3) / 3
        assert r["batch_partial"] == (r["groups_admitted"] < 3)
        assert r["groups_admitted"] >= 1 and (r["groups_generated"] <= 4 or r["groups_admitted"] == 1)
        assert r["overlong_shaped"] == 0 and r["score_mean"] == r["reward_mean"]
    assert any(r["batch_partial"] for r in records) and any(not r["batch_partial"] for r in records)
    for step, grid in policy.grids.items():  # every data rank: the same mini-batches and micro-steps
        assert len({tuple(mb.minibatch for mb in rank) for rank in grid}) == 1
        shipped = {int(i) for rank in grid for mb in rank for i in mb.sample_index if i >= 0}
        assert len(shipped) == records[step]["samples"]
    if critic is not None:
        assert all(len({len(rank) for rank in grid}) == 1 for grid in critic.grids.values())
    consumed = sum(r["groups_generated"] for r in records)
    assert consumed == orchestrator.dispatcher.next_to_ship  # every group counted in one step


def test_a_resumed_run_sees_the_same_groups_with_dynamic_sampling(encoder, tmp_path):
    def config(num_steps):
        return orchestrator_config(
            "grpo", num_steps=num_steps, batch_size=2, group_size=2, max_async_level=1, max_off_policy_steps=1,
            admission={"reject_identical_rewards": True},
            dynamic_sampling={"max_extra_groups": 1, "on_limit": "train"},
        )  # fmt: skip

    full, *_ = build(config(4), encoder, RejectingEnvironment(0.5))
    asyncio.run(full.run())
    expected = sorted({(step, s.group_id) for step, s in full.shipped.items})
    first, *_ = build(
        config(2), encoder, RejectingEnvironment(0.5), state=OrchestratorState(tmp_path / "s.json")
    )
    asyncio.run(first.run())
    state = OrchestratorState(tmp_path / "s.json")
    second, *_ = build(config(4), encoder, RejectingEnvironment(0.5), state=state)
    second.weights.current = 2  # the trainers resumed with version 2 live
    asyncio.run(second.run())
    resumed = sorted({(step, s.group_id) for step, s in [*first.shipped.items, *second.shipped.items]})
    assert resumed == expected


def test_dynamic_sampling_config_errors_name_the_key():
    with pytest.raises(ConfigError, match=r"orchestrator\.dynamic_sampling\.max_extra_groups"):
        orchestrator_config("grpo", dynamic_sampling={"max_extra_groups": -1})
    with pytest.raises(ConfigError, match=r"orchestrator\.dynamic_sampling\.on_limit"):
        orchestrator_config("grpo", dynamic_sampling={"max_extra_groups": 2, "on_limit": "later"})
    with pytest.raises(ConfigError, match=r"orchestrator\.dynamic_sampling\.max_extra_groups: required"):
        orchestrator_config("grpo", dynamic_sampling={"on_limit": "wait"})
    assert orchestrator_config("grpo").orchestrator.dynamic_sampling is None
