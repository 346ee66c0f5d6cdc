"""Arithmetic with a tool, in the model's own call format: the tool-integrated reasoning loop of a
real chat model at the size of a test.

Rows are generated from the seed: `a OP b` with a, b uniform in [low, high] and OP from `ops`,
asked as `question`. The model may call the sandboxed `python` tool (envs/sandbox.py; or the
tools `environment_args.tools` names) in the format of `tool_parser` (`hermes` by default:
`<tool_call>{"name": "python", "arguments": {"code": ...}}</tool_call>`); the result comes back as
the chat template's tool message; a completion without a call is the answer, reward 1 when it
contains the right number. Its demonstrations (the warm start's) call python with
`print(a OP b)` in the parser's format, read the result and answer with it.
"""

from __future__ import annotations

import random
import re

from megatron_rl.envs.base import Turn
from megatron_rl.envs.calculator import check_operands
from megatron_rl.envs.tool_parsers import ToolCall
from megatron_rl.envs.tools import ToolEnvironment


class ArithmeticEnvironment(ToolEnvironment):
    """`low`, `high`, `ops` (of + - *), `question` (a format string of a, op, b), `system` (a
    system prompt, or none), and ToolEnvironment's `tools`, `tool_parser`, `max_turns`."""

    def __init__(self, dataset: str | None = None, seed: int = 0, low: int = 10, high: int = 99, ops: str = "*",
                 question: str = "What is {a} {op} {b}?", system: str | None = None, tools=("python",),
                 tool_parser: str = "hermes", max_turns: int = 2):  # fmt: skip
        if dataset is not None:
            raise ValueError("orchestrator.dataset: the arithmetic environment generates its rows (give none)")
        check_operands(low, high, ops, question)
        super().__init__(tools, tool_parser, max_turns)
        self.seed, self.low, self.high, self.ops, self.question, self.system = seed, low, high, ops, question, system

    def row(self, index: int) -> dict:
        rng = random.Random(f"arithmetic:{self.seed}:{index}")
        a, b, op = rng.randint(self.low, self.high), rng.randint(self.low, self.high), rng.choice(self.ops)
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        return {"index": index, "question": self.question.format(a=a, op=op, b=b), "code": f"print({a} {op} {b})",
                "answer": str(value)}  # fmt: skip

    def prompt(self, row: dict) -> list[dict]:
        user = [{"role": "user", "content": row["question"]}]
        return [{"role": "system", "content": self.system}, *user] if self.system else user

    def grade(self, row: dict, answer: str) -> Turn:
        correct = row["answer"] in re.findall(r"-?\d+", answer)
        return Turn(reward=1.0 if correct else 0.0, passed=correct)

    def demonstration(self, row: dict) -> list[tuple[str | list[dict], bool]]:
        """Call python on the row's expression, read the tool message, answer with the result."""
        if "python" not in self.tools:
            raise ValueError("arithmetic: demonstrations call the python tool; environment_args.tools has none")
        call = self.parser.format(ToolCall("python", {"code": row["code"]}))
        return [(call, True), ([{"role": "tool", "name": "python", "content": row["answer"]}], False), (row["answer"], True)]
