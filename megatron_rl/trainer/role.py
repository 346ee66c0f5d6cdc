"""The skeleton both trainer processes (the policy and the critic) are built on.

`RoleTrainer.__init__` is collective over the role's ranks and does, in this order: the process
groups of the role's layout (with the lost-rank watchdog), the role's model transforms
(`transforms.plan.role_transforms`: LoRA, routing replay; transforms/base.py), the model
(`build_model`, with the transforms' build options), its initial weights (`model.checkpoint` /
`value.model.checkpoint`), each transform applied, what the role does to the model before its
optimizer exists (`prepare_model`: the critic's freezing), megatron DDP with the optimizer and
scheduler (the transforms' pass hooks in `Trainable.hooks`), a garbage collection (megatron builds its hybrid offload optimizer twice, and the first
one, kept alive by a reference cycle, holds an fp32 host copy of every offloaded parameter), and
what the role builds once the optimizer exists (`after_optimizer`: the KL reference, which must
not be resident while DDP allocates its buffers; see config/memory_plan.py). Then:

    resume()          the checkpoint of `resume_step()` (model, optimizer, scheduler, RNG, step)
                      and the role's own extras (`restore_extra`); sets `loaded`. The
                      transforms say what a checkpoint keeps and whether one resumes (a LoRA
                      role's holds its adapters and its base's identity, taken at
                      construction; another base is refused: trainer/checkpoint.py)
    should_save(s)    the `checkpoint.save_interval` cadence (and the last step)
    save(s)           a collective atomic checkpoint with `checkpoint_extra(s)`
    receiver(port)    this rank's end of the role's ZMQ grid stream
    write_metrics(r)  rank 0: one JSON line in `logging.dir/<role>_metrics.jsonl`, and one
                      console line (`console_line`) when `logging.console`
    close()           leaves the process groups (after `parallel.finished()` on a clean end)

A role supplies its model, its loss and what it does with a trained step (the policy publishes
weights and exports snapshots; the critic serves /score between steps).
"""

from __future__ import annotations

import gc
import json
import logging
from abc import ABC, abstractmethod
from pathlib import Path

import torch

from megatron_rl import parallel
from megatron_rl.config import Architecture, ModelConfig, OptimizerConfig, ResolvedConfig
from megatron_rl.parallel import Role
from megatron_rl.trainer.checkpoint import load_checkpoint, save_checkpoint
from megatron_rl.trainer.optimizer import build_trainable, offload_threads
from megatron_rl.trainer.receive import grid_receiver
from megatron_rl.trainer.resume import run_resume_step
from megatron_rl.trainer.weights import load_initial_weights
from megatron_rl.transforms.plan import build_options, role_transforms


class RoleTrainer(ABC):
    role: Role
    log: logging.Logger

    def __init__(
        self,
        resolved: ResolvedConfig,
        *,
        arch: Architecture,
        model_config: ModelConfig,
        optimizer_config: OptimizerConfig,
        seed: int,
        checkpoint_dir: str,
        total_optimizer_steps: int,
        head_pattern: str | None = None,
        where: str = "model.checkpoint",
    ):
        self.resolved = resolved
        self.arch = arch
        self.model_config = model_config
        self.num_steps = resolved.orchestrator.num_steps
        self.layout = parallel.initialize_role(resolved, self.role, seed=seed)
        self.is_rank0 = torch.distributed.get_rank() == 0
        self.transforms = role_transforms(resolved, self.role)
        self.model = self.build_model()
        self.loaded = load_initial_weights(
            self.model, model_config.checkpoint, arch, value_model=self.value_model, where=where
        )
        for transform in self.transforms:
            line = transform.apply(self.model)
            if line and self.is_rank0:
                self.log.info("%s: %s", self.role, line)
        self.prepare_model()
        threads = offload_threads(resolved, self.role, optimizer_config)
        if threads is not None:
            torch.set_num_threads(threads)
            if self.is_rank0:
                self.log.info("%s: the offloaded optimizer step runs on %d threads per rank", self.role, threads)
        hooks = tuple(hook for hook in (t.pass_hook() for t in self.transforms) if hook is not None)
        self.trainable = build_trainable(
            self.model, optimizer_config, total_steps=total_optimizer_steps, head_pattern=head_pattern, hooks=hooks
        )
        # Under cpu_offload megatron first builds a hybrid optimizer over the full parameters,
        # then replaces it by one over the shards; its step hooks close over it, so only the
        # cyclic collector frees the first one and its fp32 host copies (4 B per offloaded
        # element). Collect now, before the first step allocates the Adam moments.
        gc.collect()
        self.after_optimizer()
        self.checkpoint_dir = Path(checkpoint_dir)
        self.metrics_path = Path(resolved.logging.dir) / f"{self.role}_metrics.jsonl"
        if self.is_rank0:
            self.metrics_path.parent.mkdir(parents=True, exist_ok=True)

    def model_options(self) -> dict:
        """The model builder's keyword arguments the role's transforms ask for."""
        return build_options(self.transforms)

    # -- what a role supplies ------------------------------------------------------------------
    value_model = False  # a value head instead of the output layer (load_initial_weights)

    @abstractmethod
    def build_model(self) -> torch.nn.Module:
        """The role's model at `self.layout` with its transforms' options (`model_options`;
        collective: every rank of the role calls it)."""

    def prepare_model(self) -> None:  # noqa: B027  (an optional hook)
        """After the initial weights and the transforms, before DDP and the optimizer (nothing by
        default)."""

    def after_optimizer(self) -> None:  # noqa: B027  (an optional hook)
        """After DDP and the optimizer exist, before any resume (nothing by default): what must
        not be on the GPU while DDP builds its parameter and gradient buffers."""

    def checkpoint_extra(self, step: int) -> dict:
        """The role's own state saved with checkpoint `step` (besides model and optimizer)."""
        return {}

    def restore_extra(self, meta: dict) -> None:  # noqa: B027  (an optional hook)
        """Puts back what `checkpoint_extra` saved (`meta["extra"]`)."""

    def resume_step(self) -> int | None:
        """The checkpointed step to resume from: the one every role of the run checkpointed."""
        return run_resume_step(self.resolved)

    @abstractmethod
    def console_line(self, record: dict) -> str:
        """One human-readable line of a metrics `record`."""

    # -- what the skeleton does ----------------------------------------------------------------
    def resume(self, step: int | None = None) -> dict | None:
        """Collective: restores checkpoint `step` (default `resume_step()`) when
        `checkpoint.resume`; returns its meta, or None (training starts from the initial
        weights)."""
        if not self.resolved.checkpoint.resume:
            return None
        step = self.resume_step() if step is None else step
        meta = None if step is None else load_checkpoint(self.checkpoint_dir, self.trainable, step, self.transforms)
        if meta is not None:
            self.restore_extra(meta)
            self.loaded = f"checkpoint step {meta['step']} in {self.checkpoint_dir}"
        return meta

    def should_save(self, step: int) -> bool:
        interval = self.resolved.checkpoint.save_interval
        return bool(interval) and ((step + 1) % interval == 0 or step + 1 == self.num_steps)

    def save(self, step: int) -> Path:
        """Collective: checkpoint `step` (atomic; see trainer/checkpoint.py)."""
        return save_checkpoint(
            self.checkpoint_dir,
            step,
            self.trainable,
            extra=self.checkpoint_extra(step),
            keep_last=self.resolved.checkpoint.keep_last,
            transforms=self.transforms,
        )

    def receiver(self, port: int, wait_for_sender: bool = True):
        return grid_receiver(self.resolved.transport, port, wait_for_sender=wait_for_sender,
                             vocab_size=self.arch.vocab_size, num_experts=self.arch.num_experts or None)  # fmt: skip

    def write_metrics(self, record: dict) -> None:
        """Rank 0: appends `record` to the role's metrics JSONL (and prints its console line), with
        the seconds its optimizer steps took since the last record (`optimizer_step_s`, the host's
        share too when offloaded) and torch's threads (`optimizer_threads`)."""
        step_s, self.trainable.optimizer_step_s = self.trainable.optimizer_step_s, 0.0
        if not self.is_rank0:
            return
        record = {**record, "optimizer_step_s": round(step_s, 4), "optimizer_threads": torch.get_num_threads()}
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.resolved.logging.console:
            print(self.console_line(record), flush=True)

    def close(self) -> None:
        parallel.destroy()
