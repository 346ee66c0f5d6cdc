"""Math over a prompt dataset (envs/datasets.py: JSONL, Parquet or a saved `datasets` directory;
prompts a string or a list of messages; the answer `answer` or verl's
`reward_model.ground_truth`, or the fields `environment_args` name), graded with math-verify:
reward 1 when the completion's final answer (a `\\boxed{}` one preferred) is mathematically equal
to the reference answer, else 0."""

from __future__ import annotations

import random

from megatron_rl.envs.base import Turn
from megatron_rl.envs.datasets import load_rows
from megatron_rl.envs.tools import ToolEnvironment


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


class MathEnvironment(ToolEnvironment):
    """`prompt_field` / `answer_field` (`orchestrator.environment_args`): dotted paths of the
    prompt and the answer in a record, when they are not the defaults (envs/datasets.py).
    `tools` (e.g. `python`, the sandboxed interpreter), `tool_parser` and `max_turns` make it
    tool-integrated reasoning (envs/tools.py): without tools it is one turn, graded."""

    def __init__(self, dataset: str | None = None, seed: int = 0, prompt_field: str | None = None,
                 answer_field: str | None = None, tools=(), tool_parser: str = "hermes",
                 max_turns: int | None = None):  # fmt: skip
        if dataset is None:
            raise ValueError(
                "orchestrator.dataset: the math environment needs a dataset of prompts and answers "
                "(JSONL, Parquet or a saved datasets directory)"
            )
        super().__init__(tools, tool_parser, max_turns)
        self.rows = load_rows(dataset, prompt_field, answer_field)
        self._row = ShuffledRows(self.rows, seed)

    def __len__(self) -> int:
        return len(self.rows)

    def row(self, index: int) -> dict:
        return self._row(index)

    def prompt(self, row: dict) -> str | list[dict]:
        return row["prompt"]

    def grade(self, row: dict, answer: str) -> Turn:
        correct = math_equal(answer, row["answer"])
        return Turn(reward=1.0 if correct else 0.0, passed=correct)
