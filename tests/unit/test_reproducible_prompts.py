"""What stays reproducible when a run is not: the prompts of each step. The orchestrator's loop
in-process (fake rollout client with random per-rollout delays, fake critic, fake policy that
publishes each version some time after its grid) at `max_async_level` 0, 1 and 3 and with
different rollout and training times: every step trains the same groups (group ids, i.e. the
same dataset rows in the same order), and the dataset cursor after N steps (the orchestrator
state's first group of each step) is the same. What the asynchrony changes is which policy
version generated each sample, which the records show."""

from __future__ import annotations

import asyncio

import pytest
from transformers import AutoTokenizer

from megatron_rl.envs import make_environment
from megatron_rl.orchestrator.loop import Orchestrator, Timeouts
from megatron_rl.orchestrator.rollouts import PromptEncoder
from megatron_rl.orchestrator.state import OrchestratorState
from tests.support.orchestrator import (
    FakeClient,
    FakeCritic,
    FakePolicy,
    FakeWeights,
    orchestrator_config,
)
from tests.support.shipped import ShippedSamples

NUM_STEPS, BATCH_SIZE, GROUP_SIZE = 5, 3, 2


@pytest.fixture(scope="module")
def encoder(tiny_models):
    return PromptEncoder(AutoTokenizer.from_pretrained(str(tiny_models["qwen3"])))


def run(encoder, tmp_path, lead: int, delay_s: float, train_s: float) -> tuple[list[dict], OrchestratorState]:
    resolved = orchestrator_config("ppo", num_steps=NUM_STEPS, batch_size=BATCH_SIZE, group_size=GROUP_SIZE,
                                   max_async_level=lead, max_off_policy_steps=lead)  # fmt: skip
    weights, events, records, shipped = FakeWeights(), [], [], []
    state = OrchestratorState(tmp_path / f"state-{lead}-{delay_s}-{train_s}.json")
    orchestrator = ShippedSamples().attach(Orchestrator(
        resolved, make_environment("procedural", None, resolved.orchestrator.seed), encoder,
        FakeClient(weights, delay_s=delay_s), weights, FakeCritic(events), FakePolicy(weights, events, train_s).send,
        state, records.append, Timeouts(batch_s=60, critic_s=60, weights_s=60),
    ))  # fmt: skip
    asyncio.run(orchestrator.run())
    for step, sample in orchestrator.shipped.items:
        if not shipped or shipped[-1][0] != step:
            shipped.append((step, []))
        shipped[-1][1].append(sample.policy_version)
    return records, OrchestratorState(state.path), shipped


def test_each_step_trains_the_same_prompts_whatever_the_asynchrony_and_timing(encoder, tmp_path):
    reference, reference_state, reference_shipped = run(encoder, tmp_path, 0, 0.0, 0.0)
    assert [r["step"] for r in reference] == list(range(NUM_STEPS))
    groups = [r["group_ids"] for r in reference]
    assert len({g for step in groups for g in step}) == NUM_STEPS * BATCH_SIZE  # every step new rows
    versions_seen = set()
    for lead, delay_s, train_s in [(1, 0.02, 0.03), (3, 0.02, 0.05), (3, 0.05, 0.0)]:
        records, state, shipped = run(encoder, tmp_path, lead, delay_s, train_s)
        assert [r["group_ids"] for r in records] == groups, (lead, delay_s, train_s)
        assert state.step == reference_state.step == NUM_STEPS
        assert state.first_group == reference_state.first_group
        versions_seen |= {(step, tuple(v)) for step, v in shipped}
    # ...while the policy versions that generated them do change with the asynchrony.
    assert versions_seen - {(step, tuple(v)) for step, v in reference_shipped}
