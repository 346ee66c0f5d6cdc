"""An environment that drives its own turns (envs/base.py DrivenEnvironment, the hub adapters'
seam): the first conversation is rendered as the prompt, each later one must extend it (the
assistant turn just sampled, then new messages rendered after the sampled tokens, masked), the
sequence equals the template's render of the whole conversation, and a conversation that does
not extend the rollout fails the member with its reason, never the group."""

from __future__ import annotations

import asyncio

import pytest

from megatron_rl.envs import ChatModel, ConversationError, DrivenEnvironment, Turn
from megatron_rl.inference.rollout import SamplingParams
from megatron_rl.orchestrator.chat import PromptEncoder
from megatron_rl.orchestrator.rollouts import run_group, run_member
from tests.support.orchestrator import FakeClient, FakeWeights
from tests.support.qwen_tokenizer import qwen_tokenizer
from tests.unit.test_chat import SYSTEM, completion


@pytest.fixture(scope="module")
def qwen():
    return qwen_tokenizer()


TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add.", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}}, "required": ["a"]}}}]  # fmt: skip


class Agent(DrivenEnvironment):
    """Asks, hands a tool result back as an OpenAI client would (the whole conversation), asks
    again; `tamper` edits the history before the second call."""

    def __init__(self, tamper=None, turns=2):
        self.tamper, self.turns, self.replies = tamper, turns, []

    def row(self, index):
        return {"index": index}

    async def run(self, row, model: ChatModel) -> Turn:
        messages = [SYSTEM, {"role": "user", "content": "What is 2 + 3?"}]
        for turn in range(self.turns):
            reply = await model.chat(messages, TOOLS)
            self.replies.append(reply)
            if reply.finish_reason == "length" or turn == self.turns - 1:
                break
            messages = [*messages, {"role": "assistant", "content": reply.content},
                        {"role": "tool", "content": "5"}]  # fmt: skip
            if self.tamper:
                messages = self.tamper(messages)
        return Turn(reward=float("5" in self.replies[-1].content), passed=True, tool_calls=1)


def roll(env, encoder, script, budget=1024):
    client = FakeClient(FakeWeights(), script=script)
    sampling = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=256, seed=0)
    return asyncio.run(run_member(env, env.row(0), client, encoder, sampling, 0, 0, budget))


def test_the_sequence_is_the_render_of_the_whole_conversation(qwen):
    encoder = PromptEncoder(qwen)
    first, second = completion(qwen, "I will add."), completion(qwen, "It is 5.")
    env = Agent()
    member = roll(env, encoder, [first, second])
    t = member.trajectory
    conversation = [SYSTEM, {"role": "user", "content": "What is 2 + 3?"}]
    assert t.prompt_ids == qwen.encode(encoder.render(conversation, TOOLS, generation=True), add_special_tokens=False)
    whole = [*conversation, {"role": "assistant", "content": "I will add."}, {"role": "tool", "content": "5"},
             {"role": "assistant", "content": "It is 5."}]  # fmt: skip
    assert qwen.decode(t.token_ids) == encoder.render(whole, TOOLS).removesuffix("\n")  # up to the last <|im_end|>
    sampled = [i for i, m in zip(t.token_ids, t.loss_mask, strict=True) if m]
    assert sampled == first + second  # the observation between them is masked
    assert member.status == "finished" and member.reward == 1.0 and member.turns == 2 and member.tool_calls == 1
    assert member.observation_tokens == len(t.token_ids) - len(t.prompt_ids) - len(first) - len(second) > 0
    # each reply's prompt ids are the whole sequence before that turn
    assert env.replies[1].prompt_ids == t.token_ids[: len(t.prompt_ids) + len(first) + member.observation_tokens]
    assert env.replies[1].token_ids == second and env.replies[1].content == "It is 5."


@pytest.mark.parametrize("tamper, reason", [
    (lambda m: [m[0], {"role": "user", "content": "Other?"}, *m[2:]], "does not extend the rollout"),
    (lambda m: m[:-1], "nothing to answer"),
    (lambda m: [*m[:2], {"role": "tool", "content": "5"}], "should be the assistant turn"),
    (lambda m: [*m, {"role": "assistant", "content": "forged"}, {"role": "user", "content": "?"}], "did not sample"),
])  # fmt: skip
def test_a_conversation_that_does_not_extend_the_rollout_fails_the_member(qwen, tamper, reason):
    encoder = PromptEncoder(qwen)
    script = [completion(qwen, "a"), completion(qwen, "b")]
    client = FakeClient(FakeWeights(), script=script)
    sampling = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=64, seed=0)
    group = asyncio.run(run_group(Agent(tamper), {"index": 0}, 0, 1, client, encoder, sampling, 512))
    (member,) = group.members
    assert member.status == "failed" and "ConversationError" in member.error and reason in member.error


def test_the_token_budget_ends_the_rollout_with_an_empty_length_turn(qwen):
    encoder = PromptEncoder(qwen)
    first = completion(qwen, "I will add the numbers now.")
    env = Agent(turns=3)
    member = roll(env, encoder, [first, completion(qwen, "x")], budget=len(first) + 3)
    assert env.replies[-1].finish_reason == "length" and env.replies[-1].token_ids == []
    assert member.truncated and member.budget_exhausted and member.turns == 1
    t = member.trajectory
    assert len(t.token_ids) - len(t.prompt_ids) == len(first) + 3  # the observation cut to the budget


def test_an_environment_that_never_samples_is_an_error(qwen):
    class Idle(Agent):
        async def run(self, row, model):
            return Turn(reward=1.0)

    with pytest.raises(ConversationError, match="before sampling"):
        roll(Idle(), PromptEncoder(qwen), [])
    with pytest.raises(TypeError, match="drives its own turns"):
        Idle().prompt({})


def test_a_hub_whose_library_is_missing_is_a_config_error_naming_the_extra(monkeypatch):
    import importlib.util

    from megatron_rl.config import ConfigError, parse_config
    from tests.support.configs import base

    config = base()
    config["orchestrator"].update(environment={"hub": "openenv", "url": "http://127.0.0.1:1"}, dataset=None)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "openenv" else real(name, *a))
    with pytest.raises(ConfigError, match=r"orchestrator.environment: hub 'openenv' needs the openenv package.*\[hubs\]"):
        parse_config(config)


def test_a_judge_on_a_hub_environment_is_refused_by_name():
    from megatron_rl.config import ConfigError, parse_config
    from megatron_rl.config.orchestrator import JudgeConfig
    from megatron_rl.envs.judge import Judge, JudgedEnvironment
    from tests.support.configs import base

    config = base()
    judge = {"url": "http://127.0.0.1:1", "model": "judge", "template": "{prompt} {answer}"}
    config["orchestrator"].update(environment={"hub": "openenv", "url": "http://127.0.0.1:1"}, dataset=None,
                                  judge=judge)  # fmt: skip
    with pytest.raises(ConfigError, match=r"orchestrator.judge: the environment is hub 'openenv'"):
        parse_config(config)
    with pytest.raises(ValueError, match="drives its own turns and scores its own rollouts"):
        JudgedEnvironment(Agent(), Judge(JudgeConfig(**judge)))
