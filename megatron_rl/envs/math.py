"""Math over a JSONL dataset (`{"prompt": ..., "answer": ...}` per line), graded with
math-verify: reward 1 when the completion's final answer (a `\\boxed{}` one preferred) is
mathematically equal to the reference answer, else 0."""

from __future__ import annotations

import json
import random
from pathlib import Path

from megatron_rl.envs.base import Environment, Turn


def load_jsonl_rows(path: str | Path, required=("prompt", "answer")) -> list[dict]:
    """Rows of a JSONL dataset; a bad line is an error naming the file and line."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"orchestrator.dataset: {path} does not exist")
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{number}: not JSON ({exc})") from None
        missing = [k for k in required if not isinstance(row, dict) or k not in row]
        if missing:
            raise ValueError(f"{path}:{number}: missing {missing} (each line needs {list(required)})")
        rows.append({"prompt": str(row["prompt"]), "answer": str(row["answer"])})
    if not rows:
        raise ValueError(f"orchestrator.dataset: {path} has no rows")
    return rows


class ShuffledRows:
    """Row `index` of an endless stream: each epoch a fresh seeded permutation of the rows."""

    def __init__(self, rows: list[dict], seed: int):
        self.rows, self.seed = rows, seed

    def __call__(self, index: int) -> dict:
        epoch, position = divmod(index, len(self.rows))
        order = list(range(len(self.rows)))
        random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return {"index": index, **self.rows[order[position]]}


def math_equal(completion: str, answer: str) -> bool:
    from math_verify import parse, verify

    gold = parse(answer if "\\boxed" in answer or "$" in answer else f"${answer}$")
    return bool(gold) and bool(verify(gold, parse(completion)))


class MathEnvironment(Environment):
    def __init__(self, dataset: str | None = None, seed: int = 0):
        if dataset is None:
            raise ValueError(
                "orchestrator.dataset: the math environment needs a JSONL file of {prompt, answer}"
            )
        self.rows = load_jsonl_rows(dataset)
        self._row = ShuffledRows(self.rows, seed)

    def __len__(self) -> int:
        return len(self.rows)

    def row(self, index: int) -> dict:
        return self._row(index)

    def prompt(self, row: dict) -> str:
        return row["prompt"]

    def step(self, row: dict, completions: list[str]) -> Turn:
        correct = math_equal(completions[-1], row["answer"])
        return Turn(reward=1.0 if correct else 0.0, passed=correct)
