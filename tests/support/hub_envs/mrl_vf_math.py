"""A single-turn math taskset over a local JSONL dataset (`data_path`): two weighted rewards (the
answer, and a short-answer format bonus), a metric, and a reward that raises on request (rows
whose `answer` is "raise"), as an installed verifiers 0.4 environment package is written."""

from __future__ import annotations

import json
from pathlib import Path

import verifiers.v1 as vf


class MathData(vf.TaskData):
    answer: str = ""


class MathTask(vf.Task[MathData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        if self.data.answer == "raise":
            raise ZeroDivisionError("the grader divided by zero")
        return float(trace.last_reply.strip() == self.data.answer)

    @vf.reward(weight=0.25)
    async def brief(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply) <= 8)

    @vf.metric
    async def reply_chars(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply))


class MathConfig(vf.TasksetConfig):
    data_path: str = ""
    """A JSONL file of {"question", "answer"} rows."""
    system_prompt_text: str = "Answer with the number only."


class MathTaskset(vf.Taskset[MathTask, MathConfig]):
    def load(self) -> list[MathTask]:
        if not self.config.data_path:
            raise ValueError("mrl-vf-math needs taskset.data_path (a JSONL of question/answer rows)")
        rows = [json.loads(line) for line in Path(self.config.data_path).read_text().splitlines() if line.strip()]
        return [
            MathTask(MathData(prompt=row["question"], answer=str(row["answer"]),
                              system_prompt=self.config.system_prompt_text), self.config.task)
            for row in rows
        ]  # fmt: skip


__all__ = ["MathTaskset"]
