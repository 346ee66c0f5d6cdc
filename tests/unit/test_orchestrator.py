"""The orchestrator's loop driven in-process: fake rollout client, fake critic (a counting
scorer), fake policy that publishes each version some time after its grid. Checks the data flow
(critic first, one score call per group), the two bounds on asynchrony, failed members, the
multi-turn tool environment's exact tokens and its GAE, and resuming with the same prompts."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from transformers import AutoTokenizer

from megatron_rl.envs import make_environment
from megatron_rl.orchestrator.loop import Orchestrator, Timeouts
from megatron_rl.orchestrator.rollouts import PromptEncoder
from megatron_rl.orchestrator.state import OrchestratorState
from tests.support.orchestrator import (
    FakeClient,
    FakePolicy,
    FakeWeights,
    build_orchestrator,
    orchestrator_config,
    per_token_gae,
)

build = build_orchestrator


@pytest.fixture(scope="module")
def encoder(tiny_models):
    return PromptEncoder(AutoTokenizer.from_pretrained(str(tiny_models["qwen3"])))


@pytest.mark.parametrize("algorithm", ["sao", "ppo"])
def test_critic_first_and_one_score_call_per_group(encoder, algorithm):
    resolved = orchestrator_config(algorithm, group_size=3, num_steps=3)
    orchestrator, events, _, critic, policy, records = build(resolved, encoder)
    assert asyncio.run(orchestrator.run()) == 3
    for step in range(3):  # critic grid, critic trained, then policy grid, per step
        assert (
            events.index(("critic_grid", step))
            < events.index(("critic_trained", step))
            < events.index(("policy_grid", step))
        )
    calls = critic.scorer.calls
    assert len(calls) == 3 * resolved.orchestrator.batch_size  # one call per group
    assert all(len(call) == 3 for call in calls)  # ... with every branch
    for grid in [*critic.grids.values(), *policy.grids.values()]:  # every data rank: same micro-steps
        assert len(grid) == 2 and len({len(rank) for rank in grid}) == 1
    policy_samples = {int(i) for rank in policy.grids[0] for mb in rank for i in mb.sample_index if i >= 0}
    assert len(policy_samples) == resolved.orchestrator.batch_size * 3
    assert all(r["groups_admitted"] == 4 and r["explained_variance"] is not None for r in records)


def test_grpo_never_contacts_a_critic(encoder):
    resolved = orchestrator_config("grpo", group_size=4, num_steps=2)
    orchestrator, events, _, critic, _, records = build(resolved, encoder)
    asyncio.run(orchestrator.run())
    assert critic is None and [e[0] for e in events] == ["policy_grid", "policy_grid"]
    by_group = {}
    for _, sample in orchestrator.shipped.items:  # group-normalised: one scalar per sample, mean 0 per group
        values = set(sample.advantages[sample.loss_mask].tolist())
        assert len(values) == 1 and not sample.advantages[~sample.loss_mask].any()
        by_group.setdefault(sample.group_id, []).append(values.pop())
    assert len(by_group) == 8 and all(abs(sum(v)) < 1e-5 for v in by_group.values())


@pytest.mark.parametrize("max_off_policy", [0, 1, 3])
@pytest.mark.parametrize("lead", [0, 1, 3])
def test_staleness_and_lead_gate_bounds_hold(encoder, max_off_policy, lead):
    resolved = orchestrator_config("grpo", num_steps=6, batch_size=3, group_size=2,
                                   max_async_level=lead, max_off_policy_steps=max_off_policy)  # fmt: skip
    orchestrator, _, _, _, policy, records = build(resolved, encoder, {"delay_s": 0.01}, train_s=0.03)
    asyncio.run(orchestrator.run())
    for step in policy.grids:
        assert policy.version_at_ship[step] >= step - lead  # the lead gate, at shipping...
    # no shipped sample's (training step - generating version) exceeds the bound, queue time included
    for record in records:
        assert all(int(lag) <= max_off_policy for lag in record["off_policy_lag"])
    assert orchestrator.shipped.items
    assert all(step - s.policy_version <= max_off_policy for step, s in orchestrator.shipped.items)
    # ...and at generation: batch n's rollouts started only once version >= n - lead was live
    assert all(s.policy_version >= step - lead for step, s in orchestrator.shipped.items)
    if lead <= max_off_policy:  # nothing can go stale
        assert sum(r["stale_dropped"] for r in records) == 0


def test_a_failed_or_cancelled_member_never_hangs_its_group(encoder):
    resolved = orchestrator_config("grpo", num_steps=1, batch_size=2, group_size=3)
    failures = {(0, 1): RuntimeError("worker exploded"), (1, 2): asyncio.CancelledError()}
    orchestrator, _, _, _, policy, records = build(resolved, encoder, {"fail": failures})
    asyncio.run(asyncio.wait_for(orchestrator.run(), 30))
    assert records[0]["members_dropped"] == {"failed": 1, "cancelled": 1}
    assert records[0]["samples"] == 4 and records[0]["groups_admitted"] == 2


def test_multi_turn_tool_rollout_tokens_masks_and_gae(encoder):
    resolved = orchestrator_config("ppo", num_steps=1, batch_size=1, group_size=1, max_completion_tokens=64,
                                   seed=0)  # fmt: skip
    tok = encoder.tokenizer
    call = tok.encode("<calc>2*3</calc>", add_special_tokens=False)
    final = tok.encode(" so 6", add_special_tokens=False)
    orchestrator, _, client, critic, policy, _ = build(
        resolved, encoder, {"script": [call, final]}, env="calculator"
    )
    asyncio.run(orchestrator.run())
    sample = orchestrator.shipped.items[0][1]
    turns = [c["prompt"] for c in client.calls if c["session"] == "group0-branch0"]
    prompt = turns[0]
    observation = tok.encode("<result>6</result>", add_special_tokens=False)
    assert len(turns) == 2 and turns[1] == prompt + call + observation  # turn 2 extends the exact tokens
    assert sample.token_ids.tolist() == prompt + call + observation + final
    expected_mask = (
        [False] * len(prompt) + [True] * len(call) + [False] * len(observation) + [True] * len(final)
    )
    assert sample.loss_mask.tolist() == expected_mask
    assert sample.inference_logprobs[~sample.loss_mask].tolist() == [0.0] * (len(prompt) + len(observation))
    a = resolved.algorithm
    reference = per_token_gae(sample.reward, sample.values.astype(np.float64), expected_mask, sample.bootstrap_value,
                              sample.truncated and not sample.episode_done, a.gamma, a.policy_lambda)  # fmt: skip
    assert sample.advantages == pytest.approx(reference, abs=1e-5)


def test_only_an_unfinished_episode_bootstraps_its_tail(encoder):
    """A single-turn answer cut off at the length limit is graded: its episode is done, the value
    after its last token is 0 (a bootstrap would add V to a final reward: at gamma 1 the values
    grew from 0 to 6 in 24 demo steps with rewards <= 1). A multi-turn rollout that runs out of
    its token budget before the environment finished is bootstrapped with the critic's value."""
    tok = encoder.tokenizer
    resolved = orchestrator_config("ppo", num_steps=1, batch_size=1, group_size=1, max_completion_tokens=4,
                                   seed=0)  # fmt: skip
    long_answer = tok.encode("xxxxxxxx", add_special_tokens=False)
    orchestrator, *_ = build(resolved, encoder, {"script": [long_answer]}, dataset="count")
    asyncio.run(orchestrator.run())
    graded = orchestrator.shipped.items[0][1]
    assert graded.truncated and graded.episode_done and graded.bootstrap_value != 0.0
    a, mask = resolved.algorithm, graded.loss_mask.tolist()
    values = graded.values.astype(np.float64)
    last = max(t for t in range(len(mask)) if mask[t])
    assert graded.returns[last] == pytest.approx(graded.reward, abs=1e-6)  # no V added to the final reward
    reference = per_token_gae(graded.reward, values, mask, graded.bootstrap_value, False, a.gamma, a.policy_lambda)
    assert graded.advantages == pytest.approx(reference, abs=1e-5)

    call = tok.encode("<calc>2*3</calc>", add_special_tokens=False)
    resolved = orchestrator_config("ppo", num_steps=1, batch_size=1, group_size=1,
                                   max_completion_tokens=len(call) + 2, seed=0)  # fmt: skip
    orchestrator, *_ = build(resolved, encoder, {"script": [call, call]}, env="calculator")
    asyncio.run(orchestrator.run())
    cut = orchestrator.shipped.items[0][1]
    assert cut.truncated and not cut.episode_done and cut.reward == 0.0
    mask = cut.loss_mask.tolist()
    reference = per_token_gae(0.0, cut.values.astype(np.float64), mask, cut.bootstrap_value, True, a.gamma,
                              a.policy_lambda)  # fmt: skip
    assert cut.advantages == pytest.approx(reference, abs=1e-5)


def test_resume_continues_with_the_same_prompts(encoder, tmp_path):
    resolved = orchestrator_config("sao", num_steps=4, batch_size=2, group_size=1)
    uninterrupted, *_ = build(resolved, encoder)
    asyncio.run(uninterrupted.run())
    full = [(step, s.group_id, s.token_ids.tolist()) for step, s in uninterrupted.shipped.items]

    first = orchestrator_config("sao", num_steps=2, batch_size=2, group_size=1)
    part1, *_ = build(first, encoder, state=OrchestratorState(tmp_path / "state.json"))
    asyncio.run(part1.run())
    state = OrchestratorState(tmp_path / "state.json")
    assert state.step == 2
    part2, *_ = build(resolved, encoder, state=state)
    part2.weights.current = 2  # the trainers resumed with version 2 live
    asyncio.run(part2.run())
    resumed = [(step, s.group_id, s.token_ids.tolist()) for step, s in part2.shipped.items]
    assert [r[:2] for r in resumed] == [r[:2] for r in full if r[0] >= 2]
    # Same rows -> same prompts (the fake's completions are seeded by session, so tokens match too).
    assert resumed == [r for r in full if r[0] >= 2]


def test_unreachable_inference_stops_the_run_naming_it(encoder):
    from megatron_rl.inference.rollout import RolloutError

    class Down:
        def __contains__(self, key):
            return True

        def __getitem__(self, key):
            return RolloutError("completion failed on http://10.1.2.3:8000: ConnectError")

    resolved = orchestrator_config("grpo", num_steps=2, batch_size=2, group_size=2)
    orchestrator, *_ = build(resolved, encoder, {"fail": Down()})
    with pytest.raises(RuntimeError, match=r"consecutive groups failed every rollout.*http://10.1.2.3:8000"):
        asyncio.run(asyncio.wait_for(orchestrator.run(), 30))


def test_unreachable_critic_stops_the_run_naming_it(encoder):
    from megatron_rl.critic.client import HttpValueScorer

    resolved = orchestrator_config("sao", num_steps=1, batch_size=1, group_size=1)
    orchestrator, *_ = build(resolved, encoder)
    from megatron_rl.parallel import free_port

    url = f"http://127.0.0.1:{free_port()}"
    orchestrator.algorithm.scorer = HttpValueScorer(url, retries=1, backoff_s=0.01)
    with pytest.raises(RuntimeError, match=f"{url}/score: unreachable"):
        asyncio.run(asyncio.wait_for(orchestrator.run(), 30))


def test_evaluation_runs_held_out_rows_at_step_zero_and_every_interval(encoder):
    from megatron_rl.config import EvalConfig

    resolved = orchestrator_config("grpo", num_steps=3, batch_size=2, group_size=2)
    resolved.orchestrator.eval = [EvalConfig(name="copy", dataset="copy", num_examples=5, samples_per_example=2,
                                             interval=2)]  # fmt: skip
    orchestrator, _, client, _, _, records = build(resolved, encoder)
    asyncio.run(orchestrator.run())
    assert [("eval/copy/pass@2" in r) for r in records] == [True, False, True]
    assert all(r["eval/copy/errors"] == 0 for r in records if "eval/copy/errors" in r)
    eval_sessions = {c["session"] for c in client.calls if int(c["session"].split("-")[0][5:]) >= 1 << 40}
    assert len(eval_sessions) == 2 * 5 * 2  # two evaluations of 5 rows x 2 samples
    trained = {s.group_id for _, s in orchestrator.shipped.items}
    assert all(g < 1 << 40 for g in trained)  # never trained on


def test_version_follower_loads_each_new_published_version_and_names_what_it_waits_for(tmp_path):
    from megatron_rl.orchestrator.loop import OrchestratorError
    from megatron_rl.orchestrator.run import VersionFollower
    from megatron_rl.trainer import atomic_dir

    class Sync:
        version, loaded = 0, []

        def update(self, version, path):
            self.loaded.append((version, path.name))
            self.version = version
            return 0.01

    def publish(version):
        partial = atomic_dir.begin(tmp_path, atomic_dir.name("version", version))
        (partial / "manifest.json").write_text("{}")
        atomic_dir.commit(tmp_path, partial, 2, "version_*")

    async def run():
        sync = Sync()
        follower = VersionFollower(sync, str(tmp_path), poll_s=0.01)
        follower.start()
        publish(1)
        await follower.wait_for(1, 5)
        publish(2)
        await follower.wait_for(2, 5)
        with pytest.raises(OrchestratorError, match=f"policy version 3 did not go live.*{tmp_path}"):
            await follower.wait_for(3, 0.2)
        follower.stop()
        return sync.loaded

    assert asyncio.run(run()) == [(1, "version_00000001"), (2, "version_00000002")]


def reachable(root, kind) -> int:
    """How many objects of `kind` the object graph from `root` reaches (modules, classes and
    functions are not followed: they lead to every global of the process)."""
    import gc
    import types

    skip = (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType, types.CodeType)
    seen, stack, count = set(), [root], 0
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, skip):
            continue
        seen.add(id(obj))
        count += isinstance(obj, kind)
        stack.extend(gc.get_referents(obj))
    return count


@pytest.mark.parametrize("lead", [0, 2])
def test_production_keeps_no_sample_past_its_step(encoder, lead):
    """Without a recorder attached the orchestrator holds only the groups in flight: what it
    reaches after 9 steps is what it reaches after 3 (shipped_log held every sample: 13 GB at
    500 steps of 64 x 16K)."""
    from megatron_rl.data.types import TrainingSample

    class Forgetful(FakePolicy):  # a trainer that keeps no grid
        async def send(self, step, grid):
            await super().send(step, grid)
            self.grids.clear()

    held = {}
    for steps in (3, 9):
        resolved = orchestrator_config("grpo", num_steps=steps, batch_size=3, group_size=2, max_async_level=lead,
                                       max_off_policy_steps=lead)  # fmt: skip
        weights = FakeWeights()
        policy = Forgetful(weights, [], 0.0)
        orchestrator = Orchestrator(
            resolved, make_environment("procedural", None, 0), encoder, FakeClient(weights), weights, None,
            policy.send, OrchestratorState(None), lambda record: None, Timeouts(batch_s=60, critic_s=60, weights_s=60),
        )  # fmt: skip
        asyncio.run(orchestrator.run())
        held[steps] = reachable(orchestrator, TrainingSample)
        in_flight = resolved.orchestrator.batch_size * (lead + 1) * resolved.orchestrator.group_size
        assert held[steps] <= in_flight, (steps, held[steps], in_flight)
    assert held[9] == held[3]


@pytest.mark.parametrize("minibatches", [1, 2])
def test_one_grid_serves_both_models_where_their_packings_are_equal(encoder, minibatches):
    """Same seq_len, DP, CP and sequence parallel and one mini-batch: the policy gets the critic's
    grid (packing every token once), equal to the policy's own packing; otherwise it is packed."""
    from megatron_rl.data.packing import pack_minibatches

    resolved = orchestrator_config("sao", group_size=2, num_steps=2)
    resolved.algorithm.policy_minibatches = minibatches
    orchestrator, _, _, critic, policy, _ = build(resolved, encoder)
    asyncio.run(orchestrator.run())
    assert orchestrator.one_packing == (minibatches == 1)
    for step in range(2):
        samples = [s for shipped_step, s in orchestrator.shipped.items if shipped_step == step]
        own = pack_minibatches(samples, minibatches, (resolved.orchestrator.seed, step), resolved.model.seq_len,
                               resolved.layout.policy.dp)  # fmt: skip
        assert (policy.grids[step] is critic.grids[step]) == (minibatches == 1)
        got = [mb for rank in policy.grids[step] for mb in rank]
        expected = [mb for rank in own for mb in rank]
        assert len(got) == len(expected)
        for a, b in zip(got, expected):
            assert a.minibatch == b.minibatch and a.is_dummy == b.is_dummy
            for name, array in a.arrays().items():
                np.testing.assert_array_equal(array, b.arrays()[name], err_msg=name)
