"""A recording `on_shipped` hook for the orchestrator's tests: every shipped TrainingSample with
its training step. Only tests keep samples: a production Orchestrator gets no hook and holds no
sample past its step (tests/unit/test_orchestrator.py checks that)."""

from __future__ import annotations

from megatron_rl.data.types import TrainingSample


class ShippedSamples:
    """`Orchestrator(..., on_shipped=ShippedSamples())`; `items` is [(step, TrainingSample)] in
    shipping order."""

    def __init__(self):
        self.items: list[tuple[int, TrainingSample]] = []

    def __call__(self, step: int, samples: list[TrainingSample]) -> None:
        self.items += [(step, sample) for sample in samples]
