"""The Megatron teacher process: `megatron-rl teacher --config RESOLVED.json` under torchrun, on
the teacher's own ranks (`distillation.teacher.megatron`; `layout.services["teacher"]`).

Every rank builds the teacher's GPT model on its layout (tp, cp, pp, ep and data-parallel
replicas), loads `distillation.teacher.model_dir`'s HF weights into it (converted and sharded as
the policy's are: trainer/weights.py), and keeps it frozen in eval mode: no gradients, no
optimizer, no DDP. Rank 0 runs the HTTP service (service.py); every rank then runs the critic's
serving loop (critic/worker.py `ServingLoop`): rank 0 broadcasts IDLE, SCORE n (the merged
waiting requests, all of one `top_k`, which the command carries; scored by scoring.py on every
rank) or STOP, which SIGTERM or SIGINT turn into
after the command in progress, so every rank exits 0. A SCORE that raises on any rank answers
just its requests with HTTP 500 naming the cause; the teacher keeps serving. The teacher's
weights never change.
"""

from __future__ import annotations

import logging
import signal
import threading

import megatron_rl.compat  # noqa: F401  (megatron-core on CPU needs its patches first)

import torch
import torch.distributed as dist

from megatron_rl import parallel
from megatron_rl.config import ResolvedConfig
from megatron_rl.config.services import MEGATRON_TEACHER_KEY
from megatron_rl.critic.service import ScoreQueue, ServiceState
from megatron_rl.critic.worker import ServingLoop
from megatron_rl.models.builder import build_gpt_model, transformer_engine_choice
from megatron_rl.teacher.scoring import score_logprobs, score_top_k
from megatron_rl.teacher.service import TeacherService
from megatron_rl.trainer.weights import load_initial_weights

log = logging.getLogger("megatron_rl.teacher")


class TeacherModel:
    """The frozen teacher on this rank (collective to build: every teacher rank)."""

    def __init__(self, resolved: ResolvedConfig):
        service = resolved.layout.services.get("teacher")
        if service is None or service.kind != "megatron":
            raise ValueError("the config has no Megatron teacher (distillation.teacher.megatron)")
        megatron = resolved.distillation.teacher.megatron
        self.layout, self.arch, self.seq_len = service.megatron, service.architecture, service.max_model_len
        self.model_dir, self.dtype = service.model_dir, megatron.dtype
        deployment = resolved.deployment
        parallel.initialize_distributed(timeout_s=deployment.collective_timeout_s)
        parallel.start_watchdog("teacher", deployment.heartbeat_timeout_s)
        if dist.get_world_size() != self.layout.world_size:
            raise RuntimeError(f"teacher: started with {dist.get_world_size()} ranks but {MEGATRON_TEACHER_KEY} "
                               f"needs {self.layout.world_size}")  # fmt: skip
        layout = self.layout
        parallel.initialize_model_parallel(tp=layout.tp, cp=layout.cp, pp=layout.pp, ep=layout.ep,
                                           seed=resolved.orchestrator.seed + 2)  # fmt: skip
        self.is_rank0 = dist.get_rank() == 0
        te = transformer_engine_choice(megatron.transformer_engine, deployment.device, layout.cp,
                                       f"{MEGATRON_TEACHER_KEY}.transformer_engine")  # fmt: skip
        self.model = build_gpt_model(self.arch, transformer_engine=te, tp=layout.tp, cp=layout.cp, pp=layout.pp,
                                     ep=layout.ep, dtype=megatron.dtype, seq_len=self.seq_len)  # fmt: skip
        self.loaded = load_initial_weights(self.model, self.model_dir, self.arch, where="distillation.teacher.model_dir")
        self.model.requires_grad_(False)
        self.model.eval()

    def score(self, request: list[list[int]] | None, request_sizes: list[int] | None = None, top_k: int = 0):
        """Collective: on rank 0 each sequence's [T] float32 log-probabilities (top_k 0) or its
        TeacherTopK with `top_k` tokens a position (scoring.py); None elsewhere."""
        if top_k == 0:
            return score_logprobs(self.model, request, self.seq_len, request_sizes)
        return score_top_k(self.model, request, self.seq_len, request_sizes, top_k, self.arch.vocab_size)

    def info(self) -> dict:
        return {
            "model": {"family": self.arch.family, "num_layers": self.arch.num_layers, "hidden_size": self.arch.hidden_size,
                      "vocab_size": self.arch.vocab_size, "seq_len": self.seq_len, "dtype": self.dtype,
                      "model_dir": self.model_dir, "loaded": self.loaded},
            "layout": self.layout.model_dump(),
        }  # fmt: skip


class TeacherLoop(ServingLoop):
    """The serving loop's IDLE, SCORE and STOP, scoring with the teacher."""

    name = "teacher"

    def __init__(self, teacher: TeacherModel, service: TeacherService | None, signalled: threading.Event,
                 max_batch_sequences: int, isolate_requests: bool):  # fmt: skip
        super().__init__(teacher.is_rank0, service, signalled, max_batch_sequences, isolate_requests,
                         rows=lambda result, start, end: result[start:end])  # fmt: skip
        self.teacher = teacher

    def score_batch(self, request, sizes, option):
        return self.teacher.score(request, sizes, top_k=option)  # the merged requests' top_k


def start_service(teacher: TeacherModel, resolved: ResolvedConfig) -> TeacherService:
    """Rank 0's HTTP service, started, its state saying the teacher is ready."""
    megatron = resolved.distillation.teacher.megatron
    state = ServiceState(teacher.info())
    state.update(phase="ready")
    service = TeacherService(
        megatron.host,
        megatron.port,
        ScoreQueue(),
        state,
        vocab_size=teacher.arch.vocab_size,
        seq_len=teacher.seq_len,
        max_batch_sequences=megatron.max_batch_sequences,
        request_timeout_s=megatron.request_timeout_s,
        token=resolved.distillation.teacher.api_key(),
    )
    service.start()
    log.info("teacher: %s, layout %s, service %s", teacher.loaded, teacher.layout.model_dump(), service.url)
    return service


def run_teacher(resolved: ResolvedConfig) -> None:
    """Runs this teacher rank until rank 0 broadcasts STOP (after SIGTERM or SIGINT)."""
    signalled = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):  # every rank: leave on rank 0's STOP, not mid-pass
        signal.signal(sig, lambda *_: signalled.set())
    teacher = TeacherModel(resolved)
    megatron = resolved.distillation.teacher.megatron
    service = start_service(teacher, resolved) if teacher.is_rank0 else None
    try:
        with torch.no_grad():
            TeacherLoop(teacher, service, signalled, megatron.max_batch_sequences, megatron.isolate_requests).run()
    finally:
        if service is not None:
            service.stop()
        parallel.destroy()
    if teacher.is_rank0:
        log.info("teacher: stopped")
