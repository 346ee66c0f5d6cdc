"""`orchestrator.batch_order: finish` with `oversample`, driven in-process (the real
Orchestrator and Dispatcher over the fakes of tests/support/orchestrator.py): a step takes the
first groups to finish instead of waiting for a slow one, never ships a sample past the
staleness bound, and a resumed run trains every row at most once."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from transformers import AutoTokenizer

from megatron_rl.config import ConfigError
from megatron_rl.orchestrator.rollouts import PromptEncoder
from megatron_rl.orchestrator.state import OrchestratorState
from tests.support.orchestrator import build_orchestrator, orchestrator_config


@pytest.fixture(scope="module")
def encoder(tiny_models):
    return PromptEncoder(AutoTokenizer.from_pretrained(str(tiny_models["qwen3"])))


def shipped_groups(orchestrator) -> dict[int, set[int]]:
    steps: dict[int, set[int]] = {}
    for step, sample in orchestrator.shipped.items:
        steps.setdefault(step, set()).add(sample.group_id)
    return steps


@pytest.mark.parametrize("order", ["dataset", "finish"])
def test_a_slow_group_holds_back_only_the_dataset_ordered_batch(encoder, order):
    extra = {"oversample": 2} if order == "finish" else {}
    resolved = orchestrator_config("grpo", num_steps=6, batch_size=2, group_size=2, max_async_level=1,
                                   max_off_policy_steps=6, batch_order=order, **extra)  # fmt: skip
    orchestrator, _, _, _, _, records = build_orchestrator(resolved, encoder, {"slow": {0: 0.25}}, train_s=0.15)
    asyncio.run(asyncio.wait_for(orchestrator.run(), 30))
    steps = shipped_groups(orchestrator)
    if order == "dataset":
        assert steps[0] == {0, 1} and records[0]["time"]["generate"] >= 0.25
    else:  # step 0 took the two first to finish; group 0 came later, within the bound
        assert 0 not in steps[0] and records[0]["time"]["generate"] < 0.15
        assert any(0 in groups for groups in steps.values())
    trained = [g for groups in steps.values() for g in groups]
    assert len(trained) == len(set(trained)) == 12  # no group twice


@pytest.mark.parametrize("max_off_policy", [0, 1, 3])
@pytest.mark.parametrize("lead", [0, 2])
def test_finish_order_batches_never_exceed_the_staleness_bound(encoder, max_off_policy, lead):
    resolved = orchestrator_config("grpo", num_steps=5, batch_size=3, group_size=2, max_async_level=lead,
                                   max_off_policy_steps=max_off_policy, batch_order="finish", oversample=3)  # fmt: skip
    slow = {0: 0.25, 4: 0.2, 7: 0.3}  # a tail: these finish steps after their neighbours
    orchestrator, _, _, _, policy, records = build_orchestrator(resolved, encoder, {"delay_s": 0.02, "slow": slow},
                                                                train_s=0.03)  # fmt: skip
    asyncio.run(asyncio.wait_for(orchestrator.run(), 60))
    assert orchestrator.shipped.items
    assert all(step - s.policy_version <= max_off_policy for step, s in orchestrator.shipped.items)
    assert all(int(lag) <= max_off_policy for r in records for lag in r["off_policy_lag"])
    assert all(policy.version_at_ship[step] >= step - lead for step in policy.grids)  # the gate at shipping
    stale = sum(r["stale_dropped"] for r in records)
    if lead > max_off_policy:  # batches generated ahead under version 0 pass the bound: it acts
        assert stale > 0
    trained = [g for groups in shipped_groups(orchestrator).values() for g in groups]
    assert len(trained) == len(set(trained))


def test_finish_order_resume_trains_every_row_at_most_once(encoder, tmp_path):
    options = dict(batch_size=2, group_size=1, max_async_level=1, max_off_policy_steps=4, batch_order="finish",
                   oversample=2)  # fmt: skip
    first = orchestrator_config("sao", num_steps=2, **options)
    part1, *_ = build_orchestrator(first, encoder, {"slow": {0: 0.5}}, state=OrchestratorState(tmp_path / "s.json"))
    asyncio.run(asyncio.wait_for(part1.run(), 30))
    state = OrchestratorState(tmp_path / "s.json")
    before = [s.group_id for _, s in part1.shipped.items]
    assert state.step == 2 and 0 not in before  # group 0 was in flight at the checkpoint...
    assert state.group_for_step(2) == 0 and list(state.consumed_for_step(2)) == sorted(before)  # ...recorded

    resumed = orchestrator_config("sao", num_steps=4, **options)
    part2, *_ = build_orchestrator(resumed, encoder, state=state)
    part2.weights.current = 2  # the trainers resumed with version 2 live
    asyncio.run(asyncio.wait_for(part2.run(), 30))
    after = [s.group_id for _, s in part2.shipped.items]
    assert not set(before) & set(after) and len(after) == len(set(after)) == 4
    assert 0 in after  # the group lost in flight is generated anew from its row


def test_oversample_needs_finish_order():
    with pytest.raises(ConfigError, match="orchestrator.oversample .*batch_order 'finish'"):
        orchestrator_config("grpo", oversample=2)


def test_samples_spanning_versions_flow_to_the_metrics_the_bound_and_the_value_targets(encoder):
    """Partial rollouts through the orchestrator (fake completions resumed across an update):
    each sample keeps its per-token versions, staleness is judged by the oldest token, the step
    reports the spans and the tokens per lag, and version_bootstrap targets are cut at the
    boundary (the critic's next value there, at lambda 1) while the advantages stay GAE's."""
    resolved = orchestrator_config("sao", algorithm_options={"value_targets": "version_bootstrap"}, num_steps=4,
                                   batch_size=3, group_size=1, max_async_level=1, max_off_policy_steps=2,
                                   batch_order="finish", oversample=2)  # fmt: skip
    orchestrator, _, _, _, _, records = build_orchestrator(resolved, encoder, {"interrupted": True}, train_s=0.02)
    asyncio.run(asyncio.wait_for(orchestrator.run(), 30))
    spanning = [(step, s) for step, s in orchestrator.shipped.items if len(set(s.versions()[s.loss_mask])) > 1]
    assert spanning and all(step - s.versions().min() <= 2 and s.policy_version == s.versions().min()
                            for step, s in orchestrator.shipped.items)  # fmt: skip
    for record in records:
        assert sum(record["token_lag"].values()) == pytest.approx(1.0)
        assert record["samples_spanning_versions"] == sum(1 for step, _ in spanning if step == record["step"])
    assert sum(r["interruptions"] for r in records) == len(spanning)
    for _, sample in spanning:
        actions = np.flatnonzero(sample.loss_mask)
        versions = sample.versions()[actions]
        last_old = int(np.flatnonzero(versions == versions.min())[-1])  # the boundary: cut after it
        assert sample.returns[actions[last_old]] == pytest.approx(sample.values[actions[last_old + 1]], abs=1e-6)
