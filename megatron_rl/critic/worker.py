"""The critic process: `megatron-rl critic --config RESOLVED.json` under torchrun.

Every critic rank builds the CriticTrainer and runs the same loop. Global rank 0 also runs the
HTTP service (service.py) and decides what all ranks do next; it broadcasts one command per
iteration (a `Command` and its argument, two int64s):

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

A SCORE command that raises on any rank (every rank all-reduces a failure flag after it) answers
just the merged requests of that command with HTTP 500 naming the cause, and every rank keeps
serving. An exception while training or pretraining ends the critic: the cause is in its log
and the process exits non-zero.
"""

from __future__ import annotations

import logging
import signal
import threading
from enum import IntEnum

import torch
import torch.distributed as dist

from megatron_rl import faults, parallel
from megatron_rl.config import ResolvedConfig
from megatron_rl.critic.service import CriticState, ScoreQueue, ScoringFailed, ScoringService, answer
from megatron_rl.critic.trainer import CriticTrainer

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


def _broadcast_command(kind: Command = IDLE, arg: int = 0) -> tuple[Command, int]:
    command = torch.tensor([int(kind), arg], dtype=torch.int64, device=parallel.collective_device())
    dist.broadcast(command, src=0)
    kind, arg = command.tolist()
    return Command(kind), int(arg)


def run_critic(resolved: ResolvedConfig) -> None:
    trainer = CriticTrainer(resolved)
    trainer.resume()
    is_rank0 = trainer.is_rank0
    value = resolved.value
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):  # every rank: leave on rank 0's STOP, not mid-step
        signal.signal(sig, lambda *_: stop.set())
    service = queue = state = None
    if is_rank0:
        queue = ScoreQueue()
        state = CriticState(trainer.info())
        state.update(
            trained_step=trainer.trained_step,
            phase="pretraining" if trainer.pretraining_left > 0 else "ready",
            pretrain_step=trainer.pretrain_steps_done - 1,
        )
        service = ScoringService(
            value.service.host,
            value.service.port,
            queue,
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
    # No waiting for the orchestrator's sender: requests are served before it exists.
    receiver = trainer.receiver(resolved.transport.critic_port, wait_for_sender=False)
    prefetched = None  # rank 0's grid item for the next step, once it arrived
    try:
        while True:
            kind, arg = IDLE, 0
            taken = []
            if is_rank0:
                next_step = trainer.trained_step + 1
                if stop.is_set():
                    kind = STOP
                elif len(queue):
                    taken = queue.take(value.service.max_batch_sequences)
                    if taken:
                        kind, arg = SCORE, sum(len(t.sequences) for t in taken)
                elif trainer.pretraining_left > 0:
                    kind, arg = PRETRAIN, trainer.pretrain_steps_done
                elif next_step >= trainer.num_steps:
                    state.update(phase="finished")
                    queue.wait(IDLE_WAIT_S)
                else:
                    if prefetched is None:
                        prefetched = receiver.poll(next_step, timeout_s=0.0)
                    if prefetched is None and not queue.wait(IDLE_WAIT_S):
                        prefetched = receiver.poll(next_step, timeout_s=0.0)
                    if prefetched is not None:
                        kind, arg = TRAIN, next_step
            kind, arg = _broadcast_command(kind, arg)
            if kind == STOP:
                parallel.finished()
                break
            if kind == IDLE:
                continue
            if is_rank0:
                state.update(busy=True)
            try:
                if kind == SCORE:
                    request = [ids for t in taken for ids in t.sequences] if is_rank0 else None
                    sizes = [len(t.sequences) for t in taken] if is_rank0 and value.service.isolate_requests else None
                    error = None
                    try:
                        result = trainer.score(request, sizes)
                    except Exception as exc:  # answered below; the ranks agree first
                        log.exception("critic: scoring %d merged sequences failed on this rank", arg)
                        error = exc
                    except BaseException as exc:
                        for t in taken:
                            t.future.set_exception(exc)
                        raise
                    # Every rank learns whether any failed, so all skip the answer together and stay
                    # in lockstep (a rank stuck inside a collective the others never enter is
                    # beyond this: the process-group timeout ends it).
                    if parallel.any_rank(error is not None):
                        if is_rank0:
                            cause = f"{type(error).__name__}: {error}" if error else "another rank failed (see its log)"
                            failure = ScoringFailed(f"scoring {arg} merged sequences failed: {cause}")
                            for t in taken:
                                t.future.set_exception(failure)
                        continue
                    if is_rank0:
                        answer(taken, result)
                        state.add(
                            requests_scored=len(taken),
                            sequences_scored=len(request),
                            tokens_scored=sum(len(ids) for ids in request),
                        )
                elif kind == PRETRAIN:
                    record = trainer.pretrain_step(arg)
                    trainer.write_metrics(record)
                    if is_rank0:
                        state.update(
                            pretrain_step=arg,
                            phase="pretraining" if trainer.pretraining_left > 0 else "ready",
                        )
                elif kind == TRAIN:
                    micro_batches = prefetched if is_rank0 else receiver.receive(arg)
                    prefetched = None
                    faults.set_step(arg)
                    faults.kill_point("step.begin")
                    record = trainer.train(arg, micro_batches)
                    faults.kill_point("step.trained")
                    if trainer.should_save(arg):
                        trainer.save(arg)
                    trainer.write_metrics(record)
                    if is_rank0:
                        state.update(
                            trained_step=arg, last_loss=record["final_loss"], head_only=record["head_only"]
                        )
            finally:
                if is_rank0:
                    state.update(busy=False)
    finally:
        receiver.close()
        if service is not None:
            service.stop()
        trainer.close()
    if is_rank0:
        log.info("critic: stopped after step %d", trainer.trained_step)
