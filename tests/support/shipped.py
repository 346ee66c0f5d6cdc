"""Records every TrainingSample an Orchestrator ships, with its training step, from outside: the
orchestrator keeps no sample past its step (tests/unit/test_orchestrator.py checks that), so a
test that inspects shipped samples attaches a recorder to the orchestrator's collaborators. The
recorder wraps the orchestrator's algorithm's `prepare_batch` (it receives the step's groups,
exactly the samples that ship, and completes them: advantages, returns) and its `send_policy`
(the step's last send: the samples count as shipped once it returned)."""

from __future__ import annotations

from megatron_rl.data.types import TrainingSample
from megatron_rl.orchestrator.loop import Orchestrator


class ShippedSamples:
    """`ShippedSamples().attach(orchestrator)` (then `orchestrator.shipped` is the recorder), or
    `.orchestrator_class()` in place of `Orchestrator` where a function builds one (monkeypatch
    `megatron_rl.orchestrator.run`); `items` is [(step, TrainingSample)] in shipping order."""

    def __init__(self):
        self.items: list[tuple[int, TrainingSample]] = []
        self._preparing: list[TrainingSample] = []

    def attach(self, orchestrator: Orchestrator) -> Orchestrator:
        prepare, send = orchestrator.algorithm.prepare_batch, orchestrator.send_policy

        async def prepare_batch(groups, version=None):
            self._preparing = [sample for group in groups for sample in group]
            return await prepare(groups, version)

        async def send_policy(step, grid):
            result = await send(step, grid)
            self.items += [(step, sample) for sample in self._preparing]
            self._preparing = []
            return result

        orchestrator.algorithm.prepare_batch = prepare_batch
        orchestrator.send_policy = send_policy
        orchestrator.shipped = self
        return orchestrator

    def orchestrator_class(self) -> type[Orchestrator]:
        recorder = self

        class RecordedOrchestrator(Orchestrator):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                recorder.attach(self)

        return RecordedOrchestrator
