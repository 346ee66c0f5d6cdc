"""Multi-turn rollouts in-process (fake rollout client, fake critic): a turn that fails mid-rollout
ends its member and never its group; a tool error ends the member with reward 0; the per-step
turn metrics count turns, tool calls and errors, observation tokens and budget cuts; the
calculator's constructor keywords (`orchestrator.environment_args`) and their errors; the
warm start's demonstrations are the rollouts the environment itself would produce."""

from __future__ import annotations

import asyncio

import pytest
from transformers import AutoTokenizer

from megatron_rl.config import ConfigError, parse_config
from megatron_rl.config.orchestrator import BUILTIN_ENVIRONMENTS
from megatron_rl.config.plugins import PluginError, load_object
from megatron_rl.demo.warm_start import TOOL_TASK
from megatron_rl.envs import ENVIRONMENTS, make_environment
from megatron_rl.envs.calculator import CalculatorEnvironment
from megatron_rl.orchestrator.loop import Orchestrator, Timeouts
from megatron_rl.orchestrator.metrics import turn_metrics
from megatron_rl.orchestrator.rollouts import Member, PromptEncoder
from megatron_rl.orchestrator.state import OrchestratorState
from tests.support.configs import base
from tests.support.orchestrator import (
    FakeClient,
    FakeCritic,
    FakePolicy,
    FakeWeights,
    orchestrator_config,
)
from tests.support.shipped import ShippedSamples


@pytest.fixture(scope="module")
def encoder(tiny_models):
    return PromptEncoder(AutoTokenizer.from_pretrained(str(tiny_models["qwen3"])))


def run(resolved, encoder, env, client_kwargs, client_class=FakeClient):
    """One in-process run; (records, [(step, shipped sample)], client)."""
    weights, events, records = FakeWeights(), [], []
    client = client_class(weights, **client_kwargs)
    critic = FakeCritic(events) if resolved.value is not None else None
    orchestrator = ShippedSamples().attach(Orchestrator(
        resolved, env, encoder, client, weights, critic, FakePolicy(weights, events).send, OrchestratorState(None),
        records.append, Timeouts(batch_s=60, critic_s=60, weights_s=60),
    ))  # fmt: skip
    asyncio.run(asyncio.wait_for(orchestrator.run(), 60))
    return records, orchestrator.shipped.items, client


def two_times_three(tmp_path):
    """A calculator over one row, "What is 2*3?"."""
    dataset = tmp_path / "questions.jsonl"
    dataset.write_text('{"prompt": "What is 2*3?", "answer": "6"}\n')
    return make_environment("calculator", str(dataset), seed=0)


def test_a_turn_that_fails_mid_rollout_ends_its_member_and_the_group_completes(encoder, tmp_path):
    """Member (0, 1) fails on its second request (the server answered turn 1, then refused);
    member (0, 2) writes a call the tool cannot evaluate. Both end, the group of 3 completes with
    the others, and the step reports one failed member and one tool error."""
    tok = encoder.tokenizer
    call, final = (tok.encode(t, add_special_tokens=False) for t in ("<calc>2*3</calc>", " 6"))
    bad_call = tok.encode("<calc>2*x</calc>", add_special_tokens=False)
    resolved = orchestrator_config("ppo", num_steps=1, batch_size=1, group_size=3, max_completion_tokens=64)

    class Scripted(FakeClient):  # member 2 writes the bad call, the others the good one
        async def complete(self, prompt_ids, sampling, session_id, max_tokens=None, seed=None, stop=None, routes_start=0):
            completion = await super().complete(prompt_ids, sampling, session_id, max_tokens, seed, stop)
            if session_id == "group0-branch2":
                completion.token_ids = bad_call
                completion.logprobs = [-1.0] * len(bad_call)
            return completion

    failure = {(0, 1, 1): RuntimeError("HTTP 503 from worker w1")}
    records, shipped, client = run(resolved, encoder, two_times_three(tmp_path),
                                   {"script": [call, final], "fail": failure}, Scripted)  # fmt: skip
    record = records[0]
    assert [c["session"] for c in client.calls].count("group0-branch1") == 2  # it failed on its 2nd turn
    assert record["members_dropped"] == {"failed": 1}
    assert record["groups_admitted"] == 1 and record["samples"] == 2
    by_branch = {s.branch_index: s for _, s in shipped}
    assert set(by_branch) == {0, 2}
    assert by_branch[0].reward == 1.0 and by_branch[0].episode_done  # called, then answered 6
    assert by_branch[2].reward == 0.0 and by_branch[2].episode_done and not by_branch[2].truncated
    assert by_branch[2].loss_mask.sum() == len(bad_call)  # one turn, no observation
    # turns and tools of the two finished members: (2 turns, 1 call) and (1 turn, 1 failed call)
    assert record["turns_mean"] == 1.5 and record["tool_calls"] == 2 and record["tool_errors"] == 1
    observation = tok.encode("<result>6</result>", add_special_tokens=False)
    assert record["observation_tokens_mean"] == len(observation) / 2
    assert record["budget_exhausted_rate"] == 0.0


def test_budget_cut_is_counted_and_bootstrapped_and_an_answer_is_not(encoder):
    tok = encoder.tokenizer
    call = tok.encode("<calc>2*3</calc>", add_special_tokens=False)
    resolved = orchestrator_config("ppo", num_steps=1, batch_size=1, group_size=1,
                                   max_completion_tokens=len(call) + 2)  # fmt: skip
    records, shipped, _ = run(resolved, encoder, make_environment("calculator", seed=0), {"script": [call, call]})
    sample = shipped[0][1]
    assert sample.truncated and not sample.episode_done  # bootstrapped by the critic's value
    assert records[0]["budget_exhausted_rate"] == 1.0 and records[0]["observation_tokens_mean"] == 2
    assert records[0]["turns_mean"] == 1.0 and records[0]["tool_calls"] == 1


def test_turn_metrics_of_no_member_and_of_members():
    assert turn_metrics([])["turns_mean"] is None and turn_metrics([])["tool_calls"] == 0
    members = [Member(0, "finished", turns=2, tool_calls=1, observation_tokens=5),
               Member(1, "finished", turns=1, tool_calls=1, tool_errors=1, budget_exhausted=True,
                      template_rewrites=1)]  # fmt: skip
    assert turn_metrics(members) == {"turns_mean": 1.5, "tool_calls": 2, "tool_errors": 1, "tool_malformed": 0,
                                     "observation_tokens_mean": 2.5, "budget_exhausted_rate": 0.5,
                                     "template_rewrites": 1}  # fmt: skip


def test_calculator_arguments_shape_its_rows_and_bad_ones_are_named():
    env = make_environment("calculator", seed=3, args={"low": 10, "high": 99, "ops": "*", "question": "{a}{op}{b}=",
                                                       "instruction": "", "max_turns": 2})  # fmt: skip
    rows = [env.row(i) for i in range(50)]
    assert all(len(r["expression"].split("*")) == 2 for r in rows)
    assert all(10 <= int(x) <= 99 for r in rows for x in r["expression"].split("*"))
    assert env.prompt(rows[0]) == rows[0]["expression"] + "=" and env.max_turns == 2
    assert rows == [env.row(i) for i in range(50)]  # deterministic
    with pytest.raises(PluginError, match=r"orchestrator.environment_args: 'calculator' .*'colour'"):
        make_environment("calculator", args={"colour": "red"})
    for args, match in (({"ops": "/"}, "ops"), ({"low": 5, "high": 2}, "low <= high"),
                        ({"question": "{x}"}, "question"), ({"max_turns": 0}, "max_turns")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            CalculatorEnvironment(**args)


def test_environment_args_are_checked_when_the_config_is_read():
    config = base("ppo")
    config["orchestrator"].update(environment="calculator", environment_args={"max_turns": 2, "colour": 1})
    with pytest.raises(ConfigError, match=r"orchestrator.environment_args: 'calculator' .*'colour'"):
        parse_config(config, source="test.yaml")
    config["orchestrator"]["environment_args"] = {"max_turns": 2}
    assert parse_config(config).orchestrator.environment_args == {"max_turns": 2}
    config["orchestrator"]["environment_args"] = ["max_turns"]
    with pytest.raises(ConfigError, match=r"orchestrator.environment_args"):
        parse_config(config, source="test.yaml")


def test_config_knows_every_built_in_environment_by_its_class():
    assert set(BUILTIN_ENVIRONMENTS) == set(ENVIRONMENTS)
    for name, path in BUILTIN_ENVIRONMENTS.items():
        assert load_object(path, "test") is ENVIRONMENTS[name]


def test_tool_demonstrations_are_what_the_environment_answers(tmp_path):
    """A demonstration's observation is the environment's own, and following it earns reward 1:
    the warm start teaches exactly the protocol the RL run grades."""
    from megatron_rl.models.tiny import build_char_tokenizer

    environment, args = TOOL_TASK
    env = make_environment(environment, seed=11, args=args)
    tokenizer = build_char_tokenizer(64, tool_characters=True)
    for index in range(20):
        row = env.row(index)
        segments = env.demonstration(row)
        actions = [text for text, action in segments if action]
        first = env.step(row, actions[:1])
        assert not first.done and (first.observation, False) == segments[1] and first.tool_calls == 1
        final = env.step(row, actions)
        assert final.done and final.reward == 1.0 and final.passed
        for text, _ in segments:  # every character of the protocol is in the char-tool vocabulary
            ids = tokenizer.encode(text, add_special_tokens=False)
            assert tokenizer.decode(ids) == text and tokenizer.unk_token_id not in ids
    plain = build_char_tokenizer(64)  # the count demo's, unchanged: "<" is not in it
    assert plain.unk_token_id in plain.encode("<calc>", add_special_tokens=False)
    assert plain.get_vocab() == {t: i for t, i in tokenizer.get_vocab().items() if t not in "<>/()"}
    with pytest.raises(ValueError, match="no 'expression'"):
        env.demonstration({"index": 0, "prompt": "What is 2+2?", "answer": "4"})


def test_train_on_observations_marks_observations_as_actions_with_the_samplers_logprobs(encoder, tmp_path):
    """The ablation: the second turn's prompt_logprobs give the observation's tokens their
    sampler log-probabilities, and the observation joins the actions (mask 1)."""
    import dataclasses

    tok = encoder.tokenizer
    call, final = (tok.encode(t, add_special_tokens=False) for t in ("<calc>2*3</calc>", " 6"))
    observation = tok.encode("<result>6</result>", add_special_tokens=False)

    class WithPromptLogprobs(FakeClient):
        async def complete(self, prompt_ids, sampling, session_id, max_tokens=None, seed=None, stop=None, routes_start=0):
            completion = await super().complete(prompt_ids, sampling, session_id, max_tokens, seed, stop)
            assert sampling.prompt_logprobs
            return dataclasses.replace(completion, prompt_logprobs=[float("nan")] + [-0.5 - i for i in range(1, len(prompt_ids))])

    resolved = orchestrator_config("ppo", num_steps=1, batch_size=1, group_size=1, max_completion_tokens=64,
                                   train_on_observations=True)  # fmt: skip
    _, shipped, _ = run(resolved, encoder, two_times_three(tmp_path), {"script": [call, final]}, WithPromptLogprobs)
    sample = shipped[0][1]
    prompt = len(sample.token_ids) - len(call) - len(observation) - len(final)
    start = prompt + len(call)
    assert sample.loss_mask.tolist() == [False] * prompt + [True] * (len(call) + len(observation) + len(final))
    assert sample.inference_logprobs[start : start + len(observation)].tolist() == [
        -0.5 - i for i in range(start, start + len(observation))
    ]
    with pytest.raises(ConfigError, match=r"train_on_observations.*temperature is 0.7"):
        config = base("ppo")
        config["orchestrator"].update(train_on_observations=True, temperature=0.7)
        parse_config(config, source="test.yaml")


def test_prompt_logprobs_are_parsed_per_prompt_token_and_a_missing_one_is_named():
    import msgspec

    from megatron_rl.inference.rollout import RolloutClient, RolloutError

    client = RolloutClient("http://router:1", "m")
    reply = {"choices": [{"token_ids": [7], "logprobs": {"token_logprobs": [-0.1]}, "finish_reason": "stop",
                          "prompt_logprobs": [None, {"5": {"logprob": -2.0, "rank": 3}}, {"6": {"logprob": -0.25}}]}]}  # fmt: skip
    completion = client._parse(msgspec.json.encode(reply), 0, "http://w:1", prompt_ids=[4, 5, 6])
    assert completion.prompt_logprobs[1:] == [-2.0, -0.25] and completion.prompt_logprobs[0] != completion.prompt_logprobs[0]
    reply["choices"][0]["prompt_logprobs"][2] = {"9": {"logprob": -0.25}}
    with pytest.raises(RolloutError, match=r"http://w:1: prompt_logprobs at position 2 do not include token 6"):
        client._parse(msgspec.json.encode(reply), 0, "http://w:1", prompt_ids=[4, 5, 6])
    with pytest.raises(RolloutError, match=r"asked for prompt_logprobs of 2 tokens, got 3"):
        client._parse(msgspec.json.encode(reply), 0, "http://w:1", prompt_ids=[4, 5])
    asyncio.run(client.close())
