"""Procedural single-turn tasks for tiny models, generated from a seed (no download).

`dataset` names the task (default `reverse`):

- `reverse`: "reverse: kuze" -> "ezuk"; reward = difflib similarity ratio of the answer to the
  reversed word (partial credit), passed when exact;
- `copy`: "copy: kuze" -> "kuze"; same reward;
- `count`: "count: 4" -> "xxxx"; reward = max(0, 1 - |#x - N| / 6 - 0.1 per other character).

A tiny random model learns `count` from scratch, `reverse` and `copy` after a short supervised
warm start (docs/components/orchestrator.md has the figures). The answer is read up to the first
newline.
"""

from __future__ import annotations

import difflib
import random

from megatron_rl.envs.base import Environment, Turn

LETTERS = "abcdefghijklmnopqrstuvwxyz"
TASKS = ("reverse", "copy", "count")


def answer_text(completion: str) -> str:
    return completion.strip().split("\n", 1)[0].strip()


class ProceduralTask(Environment):
    def __init__(self, dataset: str | None = None, seed: int = 0, min_len: int = 3, max_len: int = 5):
        self.task = dataset or "reverse"
        if self.task not in TASKS:
            raise ValueError(f"orchestrator.dataset: procedural task {self.task!r} is not one of {TASKS}")
        self.seed, self.min_len, self.max_len = seed, min_len, max_len

    def row(self, index: int) -> dict:
        rng = random.Random(f"{self.task}:{self.seed}:{index}")
        if self.task == "count":
            n = rng.randint(1, 6)
            return {"index": index, "n": n, "answer": "x" * n}
        word = "".join(rng.choice(LETTERS) for _ in range(rng.randint(self.min_len, self.max_len)))
        return {"index": index, "word": word, "answer": word[::-1] if self.task == "reverse" else word}

    def prompt(self, row: dict) -> str:
        if self.task == "count":
            return f"count: {row['n']}"
        return f"{self.task}: {row['word']}"

    def reward(self, row: dict, completion: str) -> float:
        answer = answer_text(completion)
        if self.task == "count":
            xs = answer.count("x")
            others = len(answer) - xs
            return max(0.0, 1.0 - abs(xs - row["n"]) / 6 - 0.1 * others)
        return difflib.SequenceMatcher(None, answer, row["answer"]).ratio()

    def step(self, row: dict, completions: list[str]) -> Turn:
        return Turn(
            reward=self.reward(row, completions[-1]), passed=answer_text(completions[-1]) == row["answer"]
        )

    def demonstration(self, row: dict) -> list[tuple[str, bool]]:
        return [(row["answer"], True)]
