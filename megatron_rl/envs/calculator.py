"""A multi-turn tool environment: arithmetic questions with a calculator tool.

The model may call the tool by writing `<calc>EXPRESSION</calc>` (the turn stops there); the
environment evaluates the expression (numbers, + - * / // % ** and parentheses only, no names)
and appends `<result>VALUE</result>` as an observation (tokens with loss mask 0), up to
`max_turns` turns. The rollout ends on a turn without a call (its text is the final answer),
on a tool error (reward 0), or when the token budget runs out (the orchestrator's). Reward: 1
when the final answer contains the correct number, else 0. Rows: generated from the seed, or a
JSONL dataset of `{"prompt", "answer"}`.
"""

from __future__ import annotations

import ast
import operator
import random
import re

from megatron_rl.envs.base import Environment, Turn
from megatron_rl.envs.datasets import load_rows
from megatron_rl.envs.math import ShuffledRows

CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
_OPS = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
    ast.USub: operator.neg, ast.UAdd: operator.pos,
}  # fmt: skip


def evaluate(expression: str) -> float:
    """Arithmetic only; raises ValueError on anything else (names, calls, huge powers)."""

    def walk(node):
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, int | float)
            and not isinstance(node.value, bool)
        ):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("exponent too large")
            return _OPS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.operand))
        raise ValueError(f"not arithmetic: {ast.dump(node)[:60]}")

    try:
        return walk(ast.parse(expression.strip(), mode="eval"))
    except (SyntaxError, ZeroDivisionError, OverflowError, TypeError) as exc:
        raise ValueError(str(exc)) from None


def check_operands(low: int, high: int, ops: str, question: str) -> None:
    """The generated questions' settings (environment_args low, high, ops, question), named when bad."""
    if not 0 <= low <= high:
        raise ValueError(f"orchestrator.environment_args: need 0 <= low <= high, got low {low}, high {high}")
    if not ops or set(ops) - set("+-*"):
        raise ValueError(f"orchestrator.environment_args.ops: a string of + - *, got {ops!r}")
    try:
        question.format(a=1, op="+", b=2)
    except (KeyError, IndexError, ValueError) as exc:
        raise ValueError(
            f"orchestrator.environment_args.question: a format string of {{a}}, {{op}}, {{b}}; {question!r}: {exc!r}"
        ) from None


def format_number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


class CalculatorEnvironment(Environment):
    """Generated rows: `a OP b` with a, b uniform in [low, high] and OP from `ops`, asked as
    `question` (a format string of a, op, b); `instruction` is appended to every prompt (rows of a
    JSONL dataset too). `max_turns` counts completions: the last one must be the answer."""

    stop = ("</calc>",)

    def __init__(
        self, dataset: str | None = None, seed: int = 0, max_turns: int = 4, low: int = 10, high: int = 999,
        ops: str = "+-*", question: str = "What is {a} {op} {b}?",
        instruction: str = " You may use <calc>expression</calc>.",
    ):  # fmt: skip
        if max_turns < 1:
            raise ValueError(f"orchestrator.environment_args.max_turns: at least 1, got {max_turns}")
        check_operands(low, high, ops, question)
        self.max_turns, self.seed = max_turns, seed
        self.low, self.high, self.ops, self.question, self.instruction = low, high, ops, question, instruction
        self._rows = ShuffledRows(_text_rows(dataset), seed) if dataset else None

    def row(self, index: int) -> dict:
        if self._rows is not None:
            return self._rows(index)
        rng = random.Random(f"calculator:{self.seed}:{index}")
        a, b, op = rng.randint(self.low, self.high), rng.randint(self.low, self.high), rng.choice(self.ops)
        return {
            "index": index,
            "prompt": self.question.format(a=a, op=op, b=b),
            "expression": f"{a}{op}{b}",
            "answer": format_number(evaluate(f"{a}{op}{b}")),
        }

    def prompt(self, row: dict) -> str:
        return row["prompt"] + self.instruction

    def step(self, row: dict, completions: list[str]) -> Turn:
        last = completions[-1]
        call = CALL.search(last)
        if call is None:  # the final answer
            numbers = re.findall(r"-?\d+(?:\.\d+)?", last)
            correct = row["answer"] in numbers
            return Turn(reward=1.0 if correct else 0.0, passed=correct)
        try:
            value = evaluate(call.group(1))
        except ValueError:  # a tool error ends the rollout
            return Turn(reward=0.0, passed=False, tool_calls=1, tool_errors=1)
        if len(completions) >= self.max_turns:  # a call where the answer had to be
            return Turn(reward=0.0, passed=False, tool_calls=1)
        return Turn(observation=f"<result>{format_number(value)}</result>", done=False, tool_calls=1)

    def demonstration(self, row: dict) -> list[tuple[str, bool]]:
        """Call the tool on the row's expression, then answer with its result."""
        if "expression" not in row:
            raise ValueError(f"calculator row {row.get('index')}: no 'expression' to demonstrate a call with")
        result = format_number(evaluate(row["expression"]))
        return [(f"<calc>{row['expression']}</calc>", True), (f"<result>{result}</result>", False), (result, True)]


def _text_rows(dataset: str) -> list[dict]:
    """The dataset's rows (envs/datasets.py); the calculator appends its instruction to the
    prompt, so a prompt must be text, not a list of messages."""
    rows = load_rows(dataset)
    for number, row in enumerate(rows, 1):
        if not isinstance(row["prompt"], str):
            raise ValueError(f"{dataset}: row {number}: the calculator's prompts are text, not a list of messages")
    return rows
