"""The critic process: `megatron-rl critic --config RESOLVED.json` under torchrun.

Every critic rank builds the CriticTrainer and runs the same loop (`CommandLoop`). Global rank 0
also runs the HTTP service (service.py) and decides what all ranks do next; it broadcasts one
command per iteration (a `Command`, its argument and the option of the requests a SCORE merges,
three int64s; the critic's option is always 0, the Megatron teacher's is a request's `top_k`),
which every rank hands to that command's handler:

    IDLE                nothing to do (sent every `IDLE_WAIT_S` so no rank waits forever)
    SCORE n             score the n sequences rank 0 broadcasts next (merged waiting requests)
    PRETRAIN i          value pretraining step i
    TRAIN s             every rank receives its grid item for step s from the critic's ZMQ
                        stream and trains `value.epochs_per_step` epochs; /status then reports
                        step s trained
    STOP                leave the loop

Rank 0 picks, in order: scoring (latency matters to the orchestrator), pretraining until done,
then training once its own grid item for the next step has arrived (GridReceiver.poll), so the
other ranks never block on ZMQ while requests wait. The loop ends after `orchestrator.num_steps`
steps only when a signal says so: after the last step the critic keeps answering /score and
/status (phase "finished") until SIGTERM or SIGINT, which rank 0 turns into STOP after the
command in progress, so a step being trained is never cut short and every rank exits 0.

The IDLE/SCORE/STOP part of the loop (`ServingLoop`) is the Megatron teacher's too
(teacher/worker.py); the critic's `CommandLoop` adds PRETRAIN and TRAIN.

A SCORE command that raises on any rank (every rank all-reduces a failure flag after it) answers
just the merged requests of that command with HTTP 500 naming the cause, and every rank keeps
serving. An exception while training or pretraining ends the critic: the cause is in its log
and the process exits non-zero.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from enum import IntEnum

import torch
import torch.distributed as dist

from megatron_rl import faults, parallel
from megatron_rl.config import ResolvedConfig, ValueConfig
from megatron_rl.critic.service import (
    CriticState,
    ModelService,
    PendingRequest,
    ScoreQueue,
    ScoringFailed,
    ScoringService,
    ServiceState,
    answer,
    score_rows,
)
from megatron_rl.critic.trainer import CriticTrainer
from megatron_rl.data.types import MicroBatch
from megatron_rl.transport import GridReceiver

log = logging.getLogger("megatron_rl.critic")


class Command(IntEnum):
    """What every critic rank does next (rank 0 decides and broadcasts it with its argument)."""

    IDLE = 0
    SCORE = 1
    PRETRAIN = 2
    TRAIN = 3
    STOP = 4


IDLE, SCORE, PRETRAIN, TRAIN, STOP = Command
IDLE_WAIT_S = 0.05


def _broadcast_command(kind: Command = IDLE, arg: int = 0, option: int = 0) -> tuple[Command, int, int]:
    """Rank 0's command, its argument and the option of the requests a SCORE merges
    (PendingRequest.option), on every rank."""
    command = torch.tensor([int(kind), arg, option], dtype=torch.int64, device=parallel.collective_device())
    dist.broadcast(command, src=0)
    kind, arg, option = command.tolist()
    return Command(kind), int(arg), int(option)


def run_critic(resolved: ResolvedConfig) -> None:
    """Runs this critic rank until rank 0 broadcasts STOP; raises what training or pretraining raised."""
    trainer = CriticTrainer(resolved)
    trainer.resume()
    signalled = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):  # every rank: leave on rank 0's STOP, not mid-step
        signal.signal(sig, lambda *_: signalled.set())
    service = _start_service(trainer, resolved.value) if trainer.is_rank0 else None
    # No waiting for the orchestrator's sender: requests are served before it exists.
    receiver = trainer.receiver(resolved.transport.critic_port, wait_for_sender=False)
    try:
        CommandLoop(trainer, receiver, service, signalled, resolved.value).run()
    finally:
        receiver.close()
        if service is not None:
            service.stop()
        trainer.close()
    if trainer.is_rank0:
        log.info("critic: stopped after step %d", trainer.trained_step)


def _start_service(trainer: CriticTrainer, value: ValueConfig) -> ScoringService:
    """Rank 0's HTTP service, started, with its queue and a state that says where the critic is."""
    state = CriticState(trainer.info())
    state.update(
        trained_step=trainer.trained_step,
        phase="pretraining" if trainer.pretraining_left > 0 else "ready",
        pretrain_step=trainer.pretrain_steps_done - 1,
    )
    service = ScoringService(
        value.service.host,
        value.service.port,
        ScoreQueue(),
        state,
        vocab_size=trainer.arch.vocab_size,
        seq_len=value.model.seq_len,
        max_batch_sequences=value.service.max_batch_sequences,
        request_timeout_s=value.service.request_timeout_s,
        token=value.service.token(),
    )
    service.start()
    log.info(
        "critic: %s, layout %s, steps %d..%d, service %s",
        trainer.loaded,
        trainer.layout.model_dump(),
        trainer.trained_step + 1,
        trainer.num_steps - 1,
        service.url,
    )
    return service


class ServingLoop:
    """One rank's loop of a model service (the critic, the Megatron teacher): rank 0 chooses the
    next command (`choose`), every rank receives it by broadcast and runs its handler (`handlers`:
    one method each). This base serves IDLE, SCORE (`score_batch`, the collective scoring of the
    merged requests) and STOP; a subclass adds its own commands."""

    name = "critic"  # in log lines

    def __init__(self, is_rank0: bool, service: ModelService | None, signalled: threading.Event,
                 max_batch_sequences: int, isolate_requests: bool, rows=score_rows):  # fmt: skip
        self.is_rank0, self.signalled = is_rank0, signalled
        self.max_batch_sequences = max_batch_sequences
        self.isolate_requests = isolate_requests
        self.rows = rows  # a request's rows of a merged result (service.answer)
        # Rank 0 only (None or empty elsewhere): the service's queue and state, the requests that
        # the SCORE being broadcast merges.
        self.queue: ScoreQueue | None = service.queue if service is not None else None
        self.state: ServiceState | None = service.state if service is not None else None
        self.taken: list[PendingRequest] = []
        self.option = 0  # every rank: the option of the requests the current SCORE merges
        self.running = True

    def handlers(self) -> dict:
        return {IDLE: self.idle, SCORE: self.score, STOP: self.stop}

    def run(self) -> None:
        """Serves commands until STOP; an exception from a handler ends the loop on this rank."""
        handlers = self.handlers()
        while self.running:
            if self.is_rank0:
                kind, arg = self.choose()
                command = _broadcast_command(kind, arg, self.taken[0].option if self.taken else 0)
            else:
                command = _broadcast_command()
            kind, arg, self.option = command
            handlers[kind](arg)

    def choose(self) -> tuple[Command, int]:
        """Rank 0's next command: STOP once signalled, else the waiting requests, else IDLE after
        waiting at most `IDLE_WAIT_S` for one."""
        if self.signalled.is_set():
            return STOP, 0
        if len(self.queue) or self.queue.wait(IDLE_WAIT_S):
            return self.take()
        return IDLE, 0

    def take(self) -> tuple[Command, int]:
        """SCORE of the waiting requests rank 0 takes (up to max_batch_sequences sequences)."""
        self.taken = self.queue.take(self.max_batch_sequences)
        return (SCORE, sum(len(t.sequences) for t in self.taken)) if self.taken else (IDLE, 0)

    def idle(self, _arg: int) -> None:
        """IDLE: nothing to do; the next command follows at once."""

    def stop(self, _arg: int) -> None:
        """STOP: this rank leaves the loop, its role ended normally."""
        parallel.finished()
        self.running = False

    def score_batch(self, request: list[list[int]] | None, sizes: list[int] | None, option: int):
        """Collective: the result of the merged `request` on rank 0 (None elsewhere); `option`
        (every rank) that of its requests."""
        raise NotImplementedError  # abstract: each role defines its pass (the critic's CommandLoop, teacher/worker.py)

    def score(self, count: int) -> None:
        """SCORE `count`: every rank scores the merged requests rank 0 took. A failure on any rank
        answers those requests with ScoringFailed (HTTP 500) and every rank keeps serving."""
        taken, self.taken = self.taken, []
        request = [ids for t in taken for ids in t.sequences] if self.is_rank0 else None
        sizes = [len(t.sequences) for t in taken] if self.is_rank0 and self.isolate_requests else None
        with self._busy():
            error = None
            try:
                result = self.score_batch(request, sizes, self.option)
            except Exception as exc:  # answered below; the ranks agree first
                log.exception("%s: scoring %d merged sequences failed on this rank", self.name, count)
                error = exc
            except BaseException as exc:
                for t in taken:
                    t.future.set_exception(exc)
                raise
            # Every rank learns whether any failed, so all skip the answer together and stay in
            # lockstep (a rank stuck inside a collective the others never enter is beyond this:
            # the process-group timeout ends it).
            if parallel.any_rank(error is not None):
                if self.is_rank0:
                    cause = (
                        f"{type(error).__name__}: {error}" if error else "another rank failed (see its log)"
                    )
                    failure = ScoringFailed(f"scoring {count} merged sequences failed: {cause}")
                    for t in taken:
                        t.future.set_exception(failure)
                return
            if self.is_rank0:
                answer(taken, result, self.rows)
                self.state.add(
                    scoring_passes=1,
                    requests_scored=len(taken),
                    sequences_scored=len(request),
                    tokens_scored=sum(len(ids) for ids in request),
                )

    @contextlib.contextmanager
    def _busy(self):
        """/status says busy while a command's work runs, however it ends."""
        self._report(busy=True)
        try:
            yield
        finally:
            self._report(busy=False)

    def _report(self, **changes) -> None:
        """Rank 0: updates the state /status serves; a no-op elsewhere."""
        if self.state is not None:
            self.state.update(**changes)


class CommandLoop(ServingLoop):
    """One critic rank's loop: the serving loop's commands plus PRETRAIN and TRAIN."""

    def __init__(
        self,
        trainer: CriticTrainer,
        receiver: GridReceiver,
        service: ScoringService | None,
        signalled: threading.Event,
        value: ValueConfig,
    ):
        super().__init__(trainer.is_rank0, service, signalled, value.service.max_batch_sequences,
                         value.service.isolate_requests)  # fmt: skip
        self.trainer, self.receiver = trainer, receiver
        self.state: CriticState | None
        # Rank 0 only: the grid item for the next step once it arrived.
        self.prefetched: list[MicroBatch] | None = None

    def handlers(self) -> dict:
        return {**super().handlers(), PRETRAIN: self.pretrain, TRAIN: self.train}

    def choose(self) -> tuple[Command, int]:
        """Rank 0's next command: STOP once signalled, else scoring, pretraining until done, then
        the next step once its grid item is here; IDLE after waiting at most `IDLE_WAIT_S`."""
        trainer, queue = self.trainer, self.queue
        next_step = trainer.trained_step + 1
        if self.signalled.is_set():
            return STOP, 0
        if len(queue):
            return self.take()
        if trainer.pretraining_left > 0:
            return PRETRAIN, trainer.pretrain_steps_done
        if next_step >= trainer.num_steps:
            self.state.update(phase="finished")
            queue.wait(IDLE_WAIT_S)
            return IDLE, 0
        if self.prefetched is None:
            self.prefetched = self.receiver.poll(next_step, timeout_s=0.0)
        if self.prefetched is None and not queue.wait(IDLE_WAIT_S):
            self.prefetched = self.receiver.poll(next_step, timeout_s=0.0)
        return (TRAIN, next_step) if self.prefetched is not None else (IDLE, 0)

    def score_batch(self, request, sizes, option):
        return self.trainer.score(request, sizes)  # the critic's requests have no option (0)

    def pretrain(self, index: int) -> None:
        """PRETRAIN `index`: value pretraining step `index` on every rank; an exception ends the critic."""
        with self._busy():
            record = self.trainer.pretrain_step(index)
            self.trainer.write_metrics(record)
            self._report(
                pretrain_step=index, phase="pretraining" if self.trainer.pretraining_left > 0 else "ready"
            )

    def train(self, step: int) -> None:
        """TRAIN `step`: every rank trains on its grid item for `step` (rank 0's arrived already),
        saves when due and writes its metrics; an exception ends the critic."""
        with self._busy():
            micro_batches = self.prefetched if self.is_rank0 else self.receiver.receive(step)
            self.prefetched = None
            faults.set_step(step)
            faults.kill_point("step.begin")
            record = self.trainer.train(step, micro_batches)
            faults.kill_point("step.trained")
            if self.trainer.should_save(step):
                self.trainer.save(step)
            self.trainer.write_metrics(record)
            self._report(trained_step=step, last_loss=record["final_loss"], head_only=record["head_only"])
