"""Environments written with verifiers 0.4.0's own classes (tests/support/hub_envs: a single-turn
math taskset with two weighted rewards over a local JSONL, a multi-turn `Env.run` protocol, a
toolset of two tools) run through our rollouts unchanged (envs/hubs/verifiers.py): the library's
chat program (its `null` harness) drives the turns, our client samples them. The rewards equal
`await task.score(trace)` on the traces our rollouts produced; the prompt is our template's render
of the environment's messages, and a multi-turn sequence the render of the whole conversation with
the environment's messages masked; a reward that raises and an `Env.run` that raises fail their
rollout, named, never the group; bad arguments are errors naming the key."""

from __future__ import annotations

import asyncio
import gc
import json

import pytest

from megatron_rl.config import EvalConfig
from megatron_rl.config.hubs import HubEnvironment
from megatron_rl.envs import make_environment
from megatron_rl.inference.rollout import SamplingParams
from megatron_rl.orchestrator.chat import PromptEncoder
from megatron_rl.orchestrator.evaluation import Evaluator
from megatron_rl.orchestrator.rollouts import run_group, run_member
from tests.support.hub_verifiers import hub_envs_importable, library_score, record_episodes
from tests.support.orchestrator import FakeClient, FakeWeights
from tests.support.qwen_tokenizer import qwen_tokenizer
from tests.unit.test_chat import call, completion

ROWS = [{"question": "What is 2 + 2?", "answer": "4"}, {"question": "What is 3 + 3?", "answer": "6"},
        {"question": "What is 1 / 0?", "answer": "raise"}]  # fmt: skip
SAMPLING = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=64, seed=0)


@pytest.fixture(scope="module")
def qwen():
    return qwen_tokenizer()


@pytest.fixture(scope="module", autouse=True)
def installed():
    with hub_envs_importable() as folder:
        yield folder


@pytest.fixture
def math_data(tmp_path):
    path = tmp_path / "math.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in ROWS))
    return str(path)


def hub(id, **settings):
    return HubEnvironment(hub="verifiers", id=id, **settings)


def text(content) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content or [])


def messages_of(trace, replies) -> list[dict]:
    """The trace's conversation as our template renders it: the environment's messages as the
    library recorded them, each assistant turn the text it was sampled as (`replies`)."""
    replies, out = iter(replies), []
    for message in trace.messages:
        out.append({"role": "assistant", "content": next(replies)} if message.role == "assistant"
                   else {"role": message.role, "content": text(message.content)})  # fmt: skip
    return out


async def roll_rows(environment, rows, client, encoder, budget=512):
    try:
        return await asyncio.gather(*(run_member(environment, environment.row(i), client, encoder, SAMPLING, i, 0,
                                                 budget) for i in rows), return_exceptions=True)  # fmt: skip
    finally:
        await environment.aclose()


def test_single_turn_rewards_equal_the_library_scoring_and_the_prompt_is_our_render(qwen, math_data):
    encoder = PromptEncoder(qwen)
    environment = make_environment(hub("mrl-vf-math"), args={"taskset": {"data_path": math_data}})
    assert len(environment) == 3 and environment.row(4) == environment.row(1)
    episodes = record_episodes(environment)
    answers = [environment.tasks[i].data.answer for i in range(3)]
    client = FakeClient(FakeWeights(), script=[completion(qwen, "4")])
    members = asyncio.run(roll_rows(environment, [answers.index("4"), answers.index("6")], client, encoder))
    right, wrong = members
    assert right.status == wrong.status == "finished"
    # two weighted rewards: correct (1.0) and brief (0.25); a metric
    assert right.reward == 1.25 and wrong.reward == 0.25
    assert right.scores == {"reward/correct": 1.0, "reward/brief": 1.0, "metric/reply_chars": 1.0}
    assert wrong.scores["reward/correct"] == 0.0 and right.passed and not wrong.passed
    assert len(episodes) == 2
    for task, episode in episodes:
        (trace,) = episode.traces
        member = right if task.data.answer == "4" else wrong
        library = asyncio.run(library_score(task, trace))
        assert library.reward == member.reward == trace.reward
        assert {f"reward/{k}": r.score for k, r in library.rewards.items()} == {
            k: v for k, v in member.scores.items() if k.startswith("reward/")}  # fmt: skip
        assert {name: r.weight for name, r in library.rewards.items()} == {"correct": 1.0, "brief": 0.25}
        prompt = [{"role": "system", "content": "Answer with the number only."},
                  {"role": "user", "content": task.data.prompt}]  # fmt: skip
        assert messages_of(trace, ["4"])[:2] == prompt  # what the environment sent
        t = member.trajectory
        assert t.prompt_ids == qwen.encode(encoder.render(prompt, generation=True), add_special_tokens=False)
        assert t.token_ids[len(t.prompt_ids):] == completion(qwen, "4") and all(t.loss_mask[len(t.prompt_ids):])
        # what the library recorded of the turn is what was sampled
        (branch,) = trace.branches
        assert branch.token_ids == t.token_ids and sum(branch.sampled_mask) == len(completion(qwen, "4"))


def test_multi_turn_sequence_is_the_render_of_the_whole_conversation(qwen):
    encoder = PromptEncoder(qwen)
    environment = make_environment(hub("mrl-vf-guess"), args={"rounds": 3})
    episodes = record_episodes(environment)
    secret = [environment.tasks[i].data.secret for i in range(len(environment))].index(7)
    guesses = ["5", "8", "7"]
    client = FakeClient(FakeWeights(), script=[completion(qwen, g) for g in guesses])
    (member,) = asyncio.run(roll_rows(environment, [secret], client, encoder))
    assert member.status == "finished" and member.turns == 3 and member.reward == 1.0 and member.passed
    assert member.scores == {"reward/found": 1.0, "metric/guesses": 3.0}
    ((task, episode),) = episodes
    (trace,) = episode.traces
    whole = messages_of(trace, guesses)
    assert [m["content"] for m in whole if m["role"] == "user"][1:] == ["No, higher. Guess again.",
                                                                         "No, lower. Guess again."]  # fmt: skip
    t = member.trajectory
    assert t.prompt_ids == qwen.encode(encoder.render(whole[:1], generation=True), add_special_tokens=False)
    assert qwen.decode(t.token_ids) == encoder.render(whole).removesuffix("\n")  # up to the last <|im_end|>
    sampled = [i for i, m in zip(t.token_ids, t.loss_mask, strict=True) if m]
    assert sampled == [i for g in guesses for i in completion(qwen, g)]  # the user's hints are masked
    assert member.observation_tokens == len(t.token_ids) - len(t.prompt_ids) - len(sampled) > 0
    assert asyncio.run(library_score(task, trace)).reward == member.reward


def test_a_toolset_of_two_tools(qwen):
    encoder = PromptEncoder(qwen)
    environment = make_environment(hub("mrl-vf-tools"))
    episodes = record_episodes(environment)
    task_index = [environment.tasks[i].data.answer for i in range(len(environment))].index("20")
    turns = [call("calc_add", a=2, b=3), call("calc_multiply", a=5, b=4), "(2 + 3) * 4 = 20"]
    client = FakeClient(FakeWeights(), script=[completion(qwen, turn) for turn in turns])
    (member,) = asyncio.run(roll_rows(environment, [task_index], client, encoder, budget=2048))
    assert member.status == "finished", member.error
    assert member.turns == 3 and member.tool_calls == 2 and member.tool_errors == 0 and member.reward == 1.0
    assert member.scores == {"reward/correct": 1.0, "metric/tool_results": 2.0}
    from verifiers.v1.clients.train import tool_to_wire

    ((task, episode),) = episodes
    (trace,) = episode.traces
    tools = [tool_to_wire(tool) for tool in trace.tools]
    assert sorted(tool["function"]["name"] for tool in tools) == ["calc_add", "calc_multiply"]
    whole = messages_of(trace, turns)
    assert [m["content"] for m in whole if m["role"] == "tool"] == ["5", "20"]  # the tools' own results
    t = member.trajectory
    assert t.prompt_ids == qwen.encode(encoder.render(whole[:1], tools, generation=True), add_special_tokens=False)
    assert qwen.decode(t.token_ids) == encoder.render(whole, tools).removesuffix("\n")
    sampled = [i for i, m in zip(t.token_ids, t.loss_mask, strict=True) if m]
    assert sampled == [i for turn in turns for i in completion(qwen, turn)]
    assert asyncio.run(library_score(task, trace)).reward == member.reward


def test_a_reward_that_raises_and_an_env_run_that_raises_fail_their_rollout_named(qwen, math_data):
    encoder = PromptEncoder(qwen)
    environment = make_environment(hub("mrl-vf-math"), args={"taskset": {"data_path": math_data}})
    boom = [environment.tasks[i].data.answer for i in range(3)].index("raise")
    client = FakeClient(FakeWeights(), script=[completion(qwen, "4")])

    async def group(env, row):
        try:
            return await run_group(env, env.row(row), row, 1, client, encoder, SAMPLING, 256)
        finally:
            await env.aclose()

    members = asyncio.run(group(environment, boom)).members
    assert [m.status for m in members] == ["failed"]  # the group completes, its member counted
    assert all(m.error.startswith("VerifiersScoringError:") and "ZeroDivisionError: the grader divided by zero"
               in m.error for m in members)  # fmt: skip

    guess = make_environment(hub("mrl-vf-guess"))
    lost = [guess.tasks[i].data.secret for i in range(len(guess))].index(-1)
    members = asyncio.run(group(guess, lost)).members
    assert [m.status for m in members] == ["failed"]
    assert all(m.error.startswith("VerifiersRolloutError:") and "GuessEnv.run()" in m.error
               and "the game master lost track of the secret" in m.error for m in members)  # fmt: skip


def test_a_rollout_past_timeout_s_fails_named(qwen, math_data):
    environment = make_environment(hub("mrl-vf-math", timeout_s=0.5), args={"taskset": {"data_path": math_data}})
    client = FakeClient(FakeWeights(), script=[completion(qwen, "4")], slow={0: 30.0})

    async def roll():
        members = await roll_rows(environment, [0], client, PromptEncoder(qwen))
        gc.collect()  # the killed harness program's pipes close on this loop, not after it
        await asyncio.sleep(0.1)
        return members

    (member,) = asyncio.run(roll())
    assert isinstance(member, Exception) and "ran past timeout_s (0.5 s)" in str(member)


def test_evaluation_sets_count_passed_by_the_pass_signal(qwen, math_data):
    """pass@k counts `passed`: here the `brief` reward's score at least 0.5 (the default, the total
    weighted reward at least 1, is in the single-turn test)."""
    spec = hub("mrl-vf-math", pass_signal="brief", pass_threshold=0.5)
    config = EvalConfig(name="vf", environment=spec, environment_args={"taskset": {"data_path": math_data}},
                        num_examples=3, samples_per_example=1, seed=0)  # fmt: skip
    client = FakeClient(FakeWeights(), script=[completion(qwen, "4")])
    evaluator = Evaluator([config], client, PromptEncoder(qwen), 64, seed=0)

    async def evaluate():
        try:
            return await evaluator.run(0)
        finally:
            await evaluator.sets[0][1].aclose()

    results = asyncio.run(evaluate())
    # rows: 2 + 2 and 3 + 3 (both brief: they pass, though one is wrong), the raising reward (an error, counted)
    assert results["eval/vf/pass@1"] == pytest.approx(2 / 3) and results["eval/vf/errors"] == 1
    assert results["eval/vf/error_kinds"] == {"VerifiersScoringError": 1}
    assert results["eval/vf/reward_mean"] == pytest.approx((1.25 + 0.25) / 2)


@pytest.mark.parametrize("settings, args, message", [
    ({}, {"taskset": {"shots": 2}}, "orchestrator.environment_args.taskset.shots: Extra inputs"),
    ({}, {"taskset": {"id": "other"}}, "orchestrator.environment_args.taskset.id: the taskset is"),
    ({}, {"agent": {"runtime": {"type": "docker"}}}, "orchestrator.environment_args.agent.runtime: only the local"),
    ({}, {"agent": {"max_turns": "many"}}, "orchestrator.environment_args.agent.max_turns:"),
    ({"id": "mrl-vf-missing"}, {}, "orchestrator.environment.id: verifiers cannot load 'mrl-vf-missing'"),
    ({"tool_parser": "nope"}, {}, "orchestrator.environment.tool_parser: unknown tool parser 'nope'"),
])  # fmt: skip
def test_bad_arguments_are_errors_naming_the_key(settings, args, message):
    spec = hub(**{"id": "mrl-vf-guess", **settings})
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        make_environment(spec, args=args)


def test_the_dataset_key_is_refused_and_the_hub_block_is_checked():
    with pytest.raises(ValueError, match=r"orchestrator.dataset: a verifiers environment loads its own rows"):
        make_environment(hub("mrl-vf-guess"), dataset="rows.jsonl")
    with pytest.raises(ValueError, match="pass_signal belong to hub verifiers"):
        HubEnvironment(hub="openenv", url="http://127.0.0.1:1", pass_signal="correct")
    # a resolved config is validated again from its dump: defaults never count as given
    spec = HubEnvironment(hub="openenv", url="http://127.0.0.1:1", pass_threshold=0.5)
    assert HubEnvironment(**spec.model_dump()).pass_threshold == 0.5


def test_max_concurrent_bounds_the_rollouts_in_flight(qwen, math_data):
    environment = make_environment(hub("mrl-vf-math", max_concurrent=1), args={"taskset": {"data_path": math_data}})
    original, in_flight, most = environment.env.run_episode, [0], [0]

    async def counting(task, context, **kwargs):  # the episodes the environment runs at once
        in_flight[0] += 1
        most[0] = max(most[0], in_flight[0])
        try:
            return await original(task, context, **kwargs)
        finally:
            in_flight[0] -= 1

    environment.env.run_episode = counting
    client = FakeClient(FakeWeights(), script=[completion(qwen, "4")])
    answers = [environment.tasks[i].data.answer for i in range(3)]
    members = asyncio.run(roll_rows(environment, [answers.index("4"), answers.index("6")], client, PromptEncoder(qwen)))
    assert [m.status for m in members] == ["finished", "finished"] and most[0] == 1
