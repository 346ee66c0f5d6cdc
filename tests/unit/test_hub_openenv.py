"""Environments written for OpenEnv (openenv-core 0.3.0) through our adapter
(megatron_rl/envs/hubs/openenv.py), against a small environment server written with the library's
own classes (tests/support/openenv_server.py: the `count` task as an episode of `turns` steps),
served in a thread of this process on a free port, offline.

Rewards are the server's step rewards combined (sum or last); the prompt ids are the chat
template's render of the first messages; a multi-turn sequence is the render of the whole
conversation with the observations masked; a server that answers with an error frame, closes the
socket mid-episode, never answers, rejects a malformed action, or cannot be reached fails that
rollout only, its error named in the member and counted by kind in the step's metrics; every
session is closed (the server's count of open sessions returns to 0) on every path, cancellation
included; at most `max_concurrent` sessions are open at once, and a full server is waited for."""

from __future__ import annotations

import asyncio
import time

import pytest

from megatron_rl.config import EvalConfig
from megatron_rl.config.hubs import HubEnvironment
from megatron_rl.envs import make_environment
from megatron_rl.inference.rollout import SamplingParams
from megatron_rl.orchestrator.chat import PromptEncoder
from megatron_rl.orchestrator.evaluation import Evaluator
from megatron_rl.orchestrator.rollouts import run_group, run_member
from megatron_rl.parallel import free_port
from tests.support.lazy import lazy_module
from tests.support.orchestrator import FakeClient, FakeWeights, build_orchestrator, orchestrator_config
from tests.support.qwen_tokenizer import qwen_tokenizer
from tests.unit.test_chat import completion

# openenv-core's server classes, imported by the first test that reads them (tests/support/lazy.py)
count_server = lazy_module("tests.support.openenv_server")
openenv_hub = lazy_module("megatron_rl.envs.hubs.openenv")
KEY = "orchestrator.environment"


@pytest.fixture(scope="module")
def qwen():
    return qwen_tokenizer()


@pytest.fixture(scope="module")
def server():
    with count_server.serve_in_thread(free_port(), max_concurrent_envs=4) as url:
        yield url


@pytest.fixture(autouse=True)
def sessions_closed():
    """Every test leaves no session open on the server (the close ran on every path)."""
    count_server.CountEnvironment.release.clear()
    yield
    count_server.CountEnvironment.release.set()
    assert wait_until(lambda: count_server.CountEnvironment.open_sessions == 0), f"{count_server.CountEnvironment.open_sessions} sessions open"


def wait_until(condition, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def openenv(url, seed=0, key=KEY, max_concurrent=None, timeout_s=5.0, retries=1, pass_threshold=1.0,
            **args) -> openenv_hub.OpenEnvEnvironment:  # fmt: skip
    spec = HubEnvironment(hub="openenv", url=url, id="count", max_concurrent=max_concurrent, timeout_s=timeout_s,
                          retries=retries, pass_threshold=pass_threshold)  # fmt: skip
    return make_environment(spec, None, seed, key=key, args={"observation_template": "{prompt}", **args})


def roll_group(env, encoder, size=1, script=None, budget=256, **client):
    fake = FakeClient(FakeWeights(), script=script, **client)
    sampling = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=64, seed=0)
    return asyncio.run(run_group(env, env.row(0), 0, size, fake, encoder, sampling, budget))


# --- rewards and tokens ---------------------------------------------------------------------------
@pytest.mark.parametrize("combine", ["sum", "last"])
def test_a_multi_turn_episode_is_the_render_of_its_conversation_and_its_rewards_combined(server, qwen, combine):
    encoder = PromptEncoder(qwen)
    texts = ["xx", "xxxxx", "x"]
    env = openenv(server, seed=3, reset_args={"turns": 3}, system_prompt="Write x's.", reward=combine,
                  pass_threshold=1.5)  # fmt: skip
    row = env.row(0)
    rows = [count_server.COUNT.row(row["seed"] + turn) for turn in range(3)]  # what the server asks, turn by turn
    script = [completion(qwen, text) for text in texts]
    client = FakeClient(FakeWeights(), script=script)
    sampling = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=64, seed=0)
    member = asyncio.run(run_member(env, row, client, encoder, sampling, 0, 0, 512))

    rewards = [count_server.COUNT.reward(r, text) for r, text in zip(rows, texts, strict=True)]
    expected = sum(rewards) if combine == "sum" else rewards[-1]
    assert member.status == "finished" and member.episode_done and member.turns == 3
    assert member.reward == pytest.approx(expected) and len(set(rewards)) > 1
    assert member.passed == (expected >= 1.5)
    t = member.trajectory
    conversation = [{"role": "system", "content": "Write x's."}, {"role": "user", "content": count_server.COUNT.prompt(rows[0])}]
    assert t.prompt_ids == qwen.encode(encoder.render(conversation, None, generation=True), add_special_tokens=False)
    whole = [*conversation, {"role": "assistant", "content": texts[0]}, {"role": "user", "content": count_server.COUNT.prompt(rows[1])},
             {"role": "assistant", "content": texts[1]}, {"role": "user", "content": count_server.COUNT.prompt(rows[2])},
             {"role": "assistant", "content": texts[2]}]  # fmt: skip
    assert qwen.decode(t.token_ids) == encoder.render(whole, None).removesuffix("\n")
    assert [i for i, m in zip(t.token_ids, t.loss_mask, strict=True) if m] == [i for s in script for i in s]
    assert member.observation_tokens == len(t.token_ids) - len(t.prompt_ids) - sum(map(len, script)) > 0
    # each turn's request is the exact sequence so far
    prompts = [c["prompt"] for c in client.calls]
    assert prompts[0] == t.prompt_ids and all(t.token_ids[: len(p)] == p for p in prompts)


def test_max_turns_ends_an_unfinished_episode_without_reward(server, qwen):
    env = openenv(server, reset_args={"turns": 3}, max_turns=2)
    (member,) = roll_group(env, PromptEncoder(qwen), script=[completion(qwen, "x")] * 3).members
    assert member.status == "finished" and member.turns == 2 and not member.episode_done
    assert member.reward == 0.0 and member.truncated


def test_the_token_budget_ends_an_episode_unfinished(server, qwen):
    first = completion(qwen, "xx")
    env = openenv(server, reset_args={"turns": 3})
    (member,) = roll_group(env, PromptEncoder(qwen), script=[first] * 3, budget=len(first) + 3).members
    assert member.status == "finished" and member.turns == 1 and member.budget_exhausted and not member.episode_done
    t = member.trajectory
    assert member.reward == 0.0 and len(t.token_ids) - len(t.prompt_ids) == len(first) + 3  # the observation cut


def test_plug_ins_map_text_to_actions_and_observations_to_messages(server, qwen):
    env = openenv(server, observation_template=None, action_fn=f"{__name__}:shout_action",
                  observation_fn=f"{__name__}:prompt_as_tool_result", reset_args={"turns": 2})  # fmt: skip
    encoder = PromptEncoder(qwen)
    (member,) = roll_group(env, encoder, script=[completion(qwen, "xy"), completion(qwen, "XX")]).members
    row = env.row(0)
    rows = [count_server.COUNT.row(row["seed"] + turn) for turn in range(2)]
    assert member.status == "finished", member.error
    assert member.reward == pytest.approx(count_server.COUNT.reward(rows[0], "xx") + count_server.COUNT.reward(rows[1], "xx"))
    text = qwen.decode(member.trajectory.token_ids)
    assert f"<tool_response>\n{count_server.COUNT.prompt(rows[1])}\n</tool_response>" in text  # rendered as a tool message


def shout_action(text: str, observation: dict) -> dict:
    """An action plug-in: the reply lower-cased, its y's as x's."""
    assert "prompt" in observation
    return {"message": text.lower().replace("y", "x")}


def prompt_as_tool_result(observation: dict) -> list[dict]:
    return [{"role": "tool", "content": observation["prompt"]}]


# --- failures: the rollout, never the run ---------------------------------------------------------
@pytest.mark.parametrize("args, kind, says", [
    ({"reset_args": {"turns": 2, "fail": "raise", "fail_at": 2}}, "OpenEnvServerError",
     "step 2 answered with an error frame EXECUTION_ERROR: the environment failed at step 2"),
    ({"reset_args": {"turns": 2, "fail": "hangup"}}, "OpenEnvDisconnected", "closed the session during step 1"),
    ({"reset_args": {"fail": "hang"}, "timeout_s": 0.3}, "OpenEnvTimeout", "no reply to step 1 within timeout_s 0.3 s"),
    ({"action_field": "text"}, "OpenEnvActionRejected", "step 1 answered with an error frame VALIDATION_ERROR"),
    ({"observation_template": None}, "OpenEnvAdapterError", "has 2 text fields (['feedback', 'prompt'])"),
    ({"observation_template": "{answer}"}, "OpenEnvAdapterError", "needs 'answer' that the reset's observation lacks"),
])  # fmt: skip
def test_a_failing_server_fails_that_rollout_naming_the_error(server, qwen, args, kind, says):
    env = openenv(server, **args)
    group = roll_group(env, PromptEncoder(qwen), size=2)
    assert [m.status for m in group.members] == ["failed", "failed"]
    for member in group.members:
        assert member.error.startswith(f"{kind}: openenv 'count' ({server})") and says in member.error, member.error


def test_a_server_that_cannot_be_reached_is_retried_then_fails_the_rollout(qwen):
    env = openenv(f"http://127.0.0.1:{free_port()}", retries=2)
    began = time.monotonic()
    (member,) = roll_group(env, PromptEncoder(qwen)).members
    assert member.status == "failed" and member.error.startswith("OpenEnvUnavailable:")
    assert "no session after 3 tries (2 retries)" in member.error
    assert time.monotonic() - began >= 0.3  # the pauses between tries: 0.1 s, then 0.2 s


def test_failed_rollouts_are_counted_by_kind_in_the_step_metrics_and_the_run_goes_on(server, qwen):
    resolved = orchestrator_config("grpo", num_steps=2, batch_size=3, group_size=2, max_completion_tokens=16,
                                   max_prompt_tokens=64)  # fmt: skip
    env = openenv(server, max_concurrent=4, reset_args={"fail": "raise", "fail_every": 2})
    failing = sum(env.row(i)["seed"] % 2 == 0 for i in range(12))
    assert 0 < failing < 12  # some rows fail, some do not
    orchestrator, *_, records = build_orchestrator(resolved, PromptEncoder(qwen), {"vocab": 500}, environment=env)
    asyncio.run(asyncio.wait_for(orchestrator.run(), 60))
    assert [r["step"] for r in records] == [0, 1]
    for record in records:
        failed = record["members_dropped"].get("failed", 0)
        assert record.get("member_errors", {}) == ({"OpenEnvServerError": failed} if failed else {})
    assert sum(r["members_dropped"].get("failed", 0) for r in records) > 0
    assert all(r["groups_admitted"] == 3 for r in records)  # the failed groups were replaced


def test_an_evaluation_set_counts_what_passes_and_names_its_errors(server, qwen):
    """pass@k and mean@k of `orchestrator.eval` count `passed` (a finished episode whose reward
    reaches pass_threshold); a failed rollout is counted by kind, never fatal."""
    config = EvalConfig(name="count", environment=HubEnvironment(hub="openenv", url=server, max_concurrent=4,
                                                                 pass_threshold=1.0),
                        environment_args={"observation_template": "{prompt}",
                                          "reset_args": {"fail": "raise", "fail_every": 3}},
                        num_examples=12, samples_per_example=2, seed=5)  # fmt: skip
    fake = FakeClient(FakeWeights(), script=[completion(qwen, "xxx")])  # every answer: three x's
    evaluator = Evaluator([config], fake, PromptEncoder(qwen), 16, seed=0)
    metrics = asyncio.run(evaluator.run(0))
    env = evaluator.sets[0][1]
    seeds = [env.row(i)["seed"] for i in range(12)]
    failing = [seed % 3 == 0 for seed in seeds]
    passing = [not f and count_server.COUNT.row(seed)["n"] == 3 for seed, f in zip(seeds, failing, strict=True)]
    assert 0 < sum(failing) < 12 and 0 < sum(passing)
    assert metrics["eval/count/pass@2"] == metrics["eval/count/mean@2"] == pytest.approx(sum(passing) / 12)
    assert metrics["eval/count/errors"] == 2 * sum(failing)
    assert metrics["eval/count/error_kinds"] == {"OpenEnvServerError": 2 * sum(failing)}


# --- sessions: closed on every path, bounded --------------------------------------------------------
def test_a_cancelled_rollout_closes_its_session(server, qwen):
    env = openenv(server)
    fake = FakeClient(FakeWeights(), slow={0: 30.0})  # the model's turn takes long: cancelled during it
    sampling = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=16, seed=0)

    async def cancel_mid_episode():
        task = asyncio.ensure_future(run_member(env, env.row(0), fake, PromptEncoder(qwen), sampling, 0, 0, 64))
        while not fake.calls:  # reset answered, the model's turn begun: the session is open
            await asyncio.sleep(0.01)
        assert count_server.CountEnvironment.open_sessions == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_mid_episode())
    assert wait_until(lambda: count_server.CountEnvironment.open_sessions == 0)


def test_at_most_max_concurrent_sessions_are_open_at_once(server, qwen):
    env = openenv(server, max_concurrent=2, reset_args={"delay_s": 0.05})
    count_server.CountEnvironment.reset_counters()
    group = roll_group(env, PromptEncoder(qwen), size=6)
    assert all(m.status == "finished" for m in group.members)
    assert count_server.CountEnvironment.peak_sessions == 2


def test_a_full_server_is_waited_for_then_gives_up_after_timeout(server, qwen):
    encoder = PromptEncoder(qwen)
    # two environments on one server of 4 sessions (training and an evaluation set): 6 at once
    first, second = (openenv(server, max_concurrent=3, reset_args={"delay_s": 0.1}) for _ in range(2))
    fake = FakeClient(FakeWeights())
    sampling = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=16, seed=0)
    count_server.CountEnvironment.reset_counters()

    async def both():
        return await asyncio.gather(*(run_group(env, env.row(0), g, 3, fake, encoder, sampling, 64)
                                      for g, env in enumerate((first, second))))  # fmt: skip

    groups = asyncio.run(both())
    assert all(m.status == "finished" for g in groups for m in g.members)
    assert count_server.CountEnvironment.peak_sessions == 4
    # a server of one session held by a step that never answers: the next rollout waits, then fails
    with count_server.serve_in_thread(free_port(), max_concurrent_envs=1) as small:
        holder = openenv(small, reset_args={"fail": "hang"}, timeout_s=3.0)
        waiting = openenv(small, timeout_s=0.4)

        async def full():
            held = asyncio.ensure_future(run_member(holder, holder.row(0), fake, encoder, sampling, 0, 0, 64))
            while count_server.CountEnvironment.open_sessions < 1 or not fake.calls:
                await asyncio.sleep(0.01)
            try:
                await run_member(waiting, waiting.row(0), fake, encoder, sampling, 1, 0, 64)
            finally:
                count_server.CountEnvironment.release.set()
                await asyncio.gather(held, return_exceptions=True)

        with pytest.raises(Exception, match="the server stayed full .*CAPACITY_REACHED.* for timeout_s 0.4 s") as error:
            asyncio.run(full())
        assert type(error.value).__name__ == "OpenEnvUnavailable"


# --- rows and arguments -------------------------------------------------------------------------------
def test_rows_are_deterministic_seeded_resets(server):
    env, again, other = openenv(server, seed=1), openenv(server, seed=1), openenv(server, seed=2)
    assert [env.row(i) for i in range(5)] == [again.row(i) for i in range(5)]
    assert env.row(3) == {"index": 3, "episode": 3, "seed": openenv_hub.episode_seed(1, 3)}
    assert env.row(3)["seed"] != other.row(3)["seed"] and env.__len__() is None  # endless
    finite = openenv(server, seed=1, num_rows=4)
    epochs = [sorted(finite.row(i)["episode"] for i in range(e * 4, e * 4 + 4)) for e in range(3)]
    assert epochs == [[0, 1, 2, 3]] * 3 and len(finite) == 4  # every episode once an epoch
    assert [finite.row(i)["episode"] for i in range(4)] != [finite.row(i)["episode"] for i in range(4, 8)]


@pytest.mark.parametrize("args, says", [
    ({"max_turns": 0}, "orchestrator.environment_args.max_turns: Input should be greater than or equal to 1"),
    ({"nope": 1}, "orchestrator.environment_args.nope: Extra inputs are not permitted"),
    ({"reward": "mean"}, "orchestrator.environment_args.reward: Input should be 'sum' or 'last'"),
    ({"action_fn": "tests.unit.test_hub_openenv:shout_action", "action_field": "message"}, "give it or action_field"),
    ({"reset_args": {"seed": 3}}, "reset_args sets `seed` while seed_resets"),
    ({"action_fn": "tests.unit.test_hub_openenv:nothing_here"}, "orchestrator.environment_args.action_fn: module"),
    ({"observation_fn": "no_colon", "observation_template": None}, "orchestrator.environment_args.observation_fn: 'no_colon' is not an import path"),
])  # fmt: skip
def test_bad_arguments_are_refused_naming_the_key(args, says):
    with pytest.raises(ValueError, match="^orchestrator.environment") as error:
        openenv("http://127.0.0.1:1", **args)
    assert says in str(error.value)


def test_a_dataset_or_a_url_that_is_not_one_is_refused():
    spec = HubEnvironment(hub="openenv", url="http://127.0.0.1:1")
    with pytest.raises(ValueError, match="takes no dataset"):
        make_environment(spec, "count", 0, key=KEY)
    with pytest.raises(ValueError, match=r"orchestrator.environment.url: '127.0.0.1:1' is not an http"):
        make_environment(HubEnvironment(hub="openenv", url="127.0.0.1:1"), None, 0, key=KEY)
