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
from megatron_rl.envs.math import ShuffledRows, load_jsonl_rows

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


def format_number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


class CalculatorEnvironment(Environment):
    stop = ("</calc>",)

    def __init__(self, dataset: str | None = None, seed: int = 0, max_turns: int = 4):
        self.max_turns = max_turns
        self.seed = seed
        self._rows = ShuffledRows(load_jsonl_rows(dataset), seed) if dataset else None

    def row(self, index: int) -> dict:
        if self._rows is not None:
            return self._rows(index)
        rng = random.Random(f"calculator:{self.seed}:{index}")
        a, b, op = rng.randint(10, 999), rng.randint(10, 999), rng.choice("+-*")
        return {
            "index": index,
            "prompt": f"What is {a} {op} {b}?",
            "answer": format_number(evaluate(f"{a}{op}{b}")),
        }

    def prompt(self, row: dict) -> str:
        return row["prompt"] + " You may use <calc>expression</calc>."

    def step(self, row: dict, completions: list[str]) -> Turn:
        last = completions[-1]
        call = CALL.search(last)
        if call is None:  # the final answer
            numbers = re.findall(r"-?\d+(?:\.\d+)?", last)
            correct = row["answer"] in numbers
            return Turn(reward=1.0 if correct else 0.0, passed=correct)
        try:
            value = evaluate(call.group(1))
        except ValueError:
            return Turn(reward=0.0, passed=False)  # a tool error ends the rollout
        if len(completions) >= self.max_turns:
            return Turn(reward=0.0, passed=False)
        return Turn(observation=f"<result>{format_number(value)}</result>", done=False)
