"""The orchestrator's resumable state: the next step, and the first group id (= dataset row)
of every step it started, saved atomically after each step under `checkpoint.dir/orchestrator`.
A restarted run resumes at the trainers' step with the same prompts it would have used: groups
are numbered in dataset order and shipped in id order (see dispatcher). Under
`orchestrator.batch_order: finish` the first group id is the watermark (the lowest id not
consumed) and `consumed_ahead[step]` the ids past it that were consumed: a resume starts the
others again and never a consumed one."""

from __future__ import annotations

import json
import os
from pathlib import Path


class OrchestratorState:
    def __init__(self, path: str | Path | None, seed: int = 0):
        self.path = Path(path) if path else None
        self.step = 0
        self.first_group: dict[int, int] = {0: 0}  # step -> first group id of its batch
        self.consumed_ahead: dict[int, list[int]] = {}  # step -> ids past first_group consumed before it
        self.seed = seed
        if self.path is not None and self.path.is_file():
            data = json.loads(self.path.read_text())
            self.step = int(data["step"])
            self.first_group = {int(k): int(v) for k, v in data["first_group"].items()}
            self.consumed_ahead = {int(k): [int(i) for i in v] for k, v in data.get("consumed_ahead", {}).items()}

    def group_for_step(self, step: int) -> int:
        if step not in self.first_group:
            raise ValueError(
                f"orchestrator state {self.path}: no record of step {step} (known: {sorted(self.first_group)})"
            )
        return self.first_group[step]

    def resume_at(self, step: int) -> None:
        """Continue at `step` (the trainers' resume step), forgetting later records."""
        self.group_for_step(step)
        self.step = step
        self.first_group = {k: v for k, v in self.first_group.items() if k <= step}
        self.consumed_ahead = {k: v for k, v in self.consumed_ahead.items() if k <= step}

    def consumed_for_step(self, step: int) -> tuple[int, ...]:
        """Group ids past `group_for_step(step)` consumed before `step` (finish order)."""
        return tuple(self.consumed_ahead.get(step, ()))

    def advance(self, step: int, first_group: int, next_group: int, consumed_ahead=()) -> None:
        self.first_group[step] = first_group
        self.first_group[step + 1] = next_group
        self.consumed_ahead[step + 1] = sorted(consumed_ahead)
        self.step = step + 1
        self.save()

    def save(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"step": self.step, "first_group": self.first_group,
                                   "consumed_ahead": self.consumed_ahead, "seed": self.seed}))
        os.replace(tmp, self.path)
