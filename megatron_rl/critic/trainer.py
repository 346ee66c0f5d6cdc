"""The critic's model and training on its own ranks: value loss, K epochs per step, head-only
phases, attention freezing, LoRA, value pretraining, policy snapshots, checkpoints.

`CriticTrainer(resolved)` is built collectively by every critic rank (after the process group
exists). Its methods are collectives too; the worker's main loop (worker.py) calls them in the
same order on every rank.

Head-only phases: the first `value.head_only_warmup_steps` RL steps, and the
`value.snapshot.head_only_retune_steps` steps starting at every snapshot step. During them the
backbone does not require gradients (no backward through it) and its optimizer groups get
learning rate 0 (AdamW then leaves it exactly unchanged); when a full step follows, Adam state
of parameters that never had a gradient restarts at step 0.
"""

from __future__ import annotations

import logging
import time

import megatron_rl.compat  # noqa: F401  (megatron-core on CPU needs its patches first)

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_rl.config import ResolvedConfig
from megatron_rl.critic.loss import value_loss_func
from megatron_rl.critic.pretrain import pretrain_batches, read_pretrain_jsonl
from megatron_rl.critic.scoring import score_sequences
from megatron_rl.data.packing import pack_into_grid
from megatron_rl.data.types import MicroBatch, ScoreResult, TrainingSample
from megatron_rl.models.builder import transformer_engine_choice
from megatron_rl.models.value_model import build_value_model, freeze_attention, set_head_only
from megatron_rl.trainer.optimizer import Trainable, reload_main_params, restart_untouched_adam_state
from megatron_rl.trainer.resume import CheckpointMismatch, complete_steps, run_resume_step
from megatron_rl.trainer.role import RoleTrainer
from megatron_rl.trainer.snapshot import wait_for_snapshot
from megatron_rl.trainer.step import train_step
from megatron_rl.trainer.weights import load_backbone


class CriticTrainer(RoleTrainer):
    role = "critic"
    log = logging.getLogger("megatron_rl.critic")
    value_model = True

    def __init__(self, resolved: ResolvedConfig):
        if resolved.value is None:
            raise ValueError("the critic needs a value section in the config")
        self.value = resolved.value
        num_steps = resolved.orchestrator.num_steps
        super().__init__(
            resolved,
            arch=resolved.layout.critic_architecture,
            model_config=self.value.model,
            optimizer_config=self.value.optimizer,
            seed=resolved.layout.critic_seed,
            checkpoint_dir=resolved.layout.paths.critic_checkpoints,
            total_optimizer_steps=self.value.pretrain_steps + num_steps * self.value.epochs_per_step,
            head_pattern="*value_head.*",
            where="value.model.checkpoint",
        )
        self.loss = value_loss_func(resolved.algorithm.value_clip)
        self.pretrain_loss = value_loss_func(None)  # pretraining data has no old values to clip around
        self.trained_step = -1
        self.pretrain_steps_done = 0
        self.head_only = False
        self.snapshots_loaded: list[int] = []
        self.dp = ps.get_data_parallel_world_size()
        self.data_rank = ps.get_data_parallel_rank()
        self.cp = ps.get_context_parallel_world_size()
        self.sp = ps.get_tensor_model_parallel_world_size() if self.model.config.sequence_parallel else 1
        self._pretrain_batches: list[list[TrainingSample]] | None = None

    def build_model(self) -> torch.nn.Module:
        layout, model_config = self.layout, self.value.model
        return build_value_model(
            self.arch,
            seq_len=model_config.seq_len,
            head_init_std=self.value.head_init_std,
            head_init_seed=self.resolved.orchestrator.seed,
            tp=layout.tp,
            cp=layout.cp,
            pp=layout.pp,
            ep=layout.ep,
            dtype=model_config.dtype,
            transformer_engine=transformer_engine_choice(
                model_config.transformer_engine, self.resolved.deployment.device, layout.cp,
                "value.model.transformer_engine",
            ),
            **model_config.recompute.transformer_fields(),
            **self.model_options(),  # the transforms' (`value.lora` on experts: one linear per expert)
        )

    def prepare_model(self) -> None:
        """After the transforms (`value.lora`: adapters, the backbone frozen): `freeze_attention`."""
        if self.value.freeze_attention:
            freeze_attention(self.model)
        self.frozen = frozenset(name for name, p in self.model.named_parameters() if not p.requires_grad)

    # -- info -----------------------------------------------------------------------------------
    def info(self) -> dict:
        trainable = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        return {
            "model": {
                "family": self.arch.family,
                "num_layers": self.arch.num_layers,
                "hidden_size": self.arch.hidden_size,
                "vocab_size": self.arch.vocab_size,
                "seq_len": self.value.model.seq_len,
                "dtype": self.value.model.dtype,
                "loaded": self.loaded,
                "lora": self.resolved.layout.critic_lora is not None,
                "freeze_attention": self.value.freeze_attention,
                "trainable_parameters_on_rank0": trainable,
            },
            "layout": self.layout.model_dump(),
            "num_steps": self.num_steps,
            "epochs_per_step": self.value.epochs_per_step,
        }

    # -- phases ---------------------------------------------------------------------------------
    def head_only_at(self, step: int) -> bool:
        if step < self.value.head_only_warmup_steps:
            return True
        snapshot = self.value.snapshot
        if snapshot is not None:
            return any(s <= step < s + snapshot.head_only_retune_steps for s in snapshot.steps)
        return False

    def set_head_only(self, head_only: bool) -> None:
        set_head_only(self.model, head_only, self.frozen)
        if self.head_only and not head_only:
            restart_untouched_adam_state(self.trainable)
        self.trainable.head_only = head_only
        self.head_only = head_only

    # -- training -------------------------------------------------------------------------------
    def _epochs(self, micro_batches: list[MicroBatch], epochs: int, loss) -> list[dict]:
        return [train_step(self.trainable, micro_batches, loss) for _ in range(epochs)]

    def train(self, step: int, micro_batches: list[MicroBatch]) -> dict:
        """`value.epochs_per_step` optimizer steps on this rank's grid item for `step`."""
        began = time.perf_counter()
        snapshot = self.value.snapshot
        if snapshot is not None and step in snapshot.steps and step not in self.snapshots_loaded:
            self.load_snapshot(step)
        self.set_head_only(self.head_only_at(step))
        results = self._epochs(micro_batches, self.value.epochs_per_step, self.loss)
        self.trained_step = step
        return _summary("rl", step, results, self.head_only, time.perf_counter() - began)

    def pretrain_step(self, index: int) -> dict:
        """Pretraining step `index` (0-based) on its batch from `value.pretrain_jsonl`."""
        began = time.perf_counter()
        batches = self._load_pretrain_batches()
        grid = pack_into_grid(
            batches[index], self.value.model.seq_len, self.dp, self.cp, sequence_parallel_size=self.sp
        )
        self.set_head_only(False)
        results = self._epochs(grid[self.data_rank], 1, self.pretrain_loss)
        self.pretrain_steps_done = index + 1
        return _summary("pretrain", index, results, False, time.perf_counter() - began)

    def _load_pretrain_batches(self) -> list[list[TrainingSample]]:
        if self._pretrain_batches is None:
            samples = read_pretrain_jsonl(
                self.value.pretrain_jsonl,
                self.arch.vocab_size,
                self.value.model.seq_len,
                self.resolved.algorithm.gamma,
            )
            self._pretrain_batches = list(
                pretrain_batches(
                    samples,
                    self.value.pretrain_batch_size,
                    self.value.pretrain_steps,
                    self.resolved.orchestrator.seed,
                )
            )
        return self._pretrain_batches

    @property
    def pretraining_left(self) -> int:
        return self.value.pretrain_steps - self.pretrain_steps_done

    # -- snapshots ------------------------------------------------------------------------------
    def load_snapshot(self, step: int) -> None:
        """Waits for policy snapshot version `step`, loads its backbone into the model and into
        the weights the optimizer steps from (fp32 masters, or the hybrid optimizer's copies under
        CPU offload), restarts the backbone's Adam state (the old moments belong to other weights)."""
        path = wait_for_snapshot(self.resolved.layout.paths.policy_snapshots, step, self.value.snapshot.wait_timeout_s)
        load_snapshot_backbone(self.model, self.trainable, path)
        self.snapshots_loaded.append(step)
        if dist.get_rank() == 0:
            self.log.info("critic: loaded the policy snapshot version %d from %s", step, path)

    # -- scoring --------------------------------------------------------------------------------
    def score(self, request: list[list[int]] | None, request_sizes: list[int] | None = None) -> ScoreResult | None:
        result = score_sequences(self.model, request, self.value.model.seq_len, request_sizes)
        if result is not None:
            result.step = self.trained_step
        return result

    # -- checkpoints ----------------------------------------------------------------------------
    def checkpoint_extra(self, step: int) -> dict:
        return {
            "trained_step": self.trained_step,
            "pretrain_steps_done": self.pretrain_steps_done,
            "head_only": self.head_only,
            "snapshots_loaded": self.snapshots_loaded,
        }

    def restore_extra(self, meta: dict) -> None:
        extra = meta["extra"]
        self.trained_step = extra["trained_step"]
        self.pretrain_steps_done = extra["pretrain_steps_done"]
        self.snapshots_loaded = list(extra.get("snapshots_loaded", []))
        self.set_head_only(bool(extra["head_only"]))

    def resume_step(self) -> int | None:
        """The run's common resume step (`run_resume_step`), or before any training step the
        newest value-pretraining checkpoint (steps below 0)."""
        steps = complete_steps(self.checkpoint_dir)
        step = run_resume_step(self.resolved)
        if step is not None and step not in steps:
            raise CheckpointMismatch(
                f"{self.checkpoint_dir}: the policy resumes after its checkpoint of step {step}, "
                f"but the critic has no checkpoint of that step (it has {steps}); the orchestrator lets the "
                "policy train a step only after the critic checkpointed it, so the critic's checkpoints were "
                "removed or written under another checkpoint.dir"
            )
        if step is None:
            pretraining = [s for s in steps if s < 0]
            step = pretraining[-1] if pretraining else None
        return step

    def console_line(self, record: dict) -> str:
        return (
            f"[critic] {record['phase']} step {record['step']} loss {record['loss']:.4f} -> {record['final_loss']:.4f} "
            f"({len(record['epoch_losses'])} epochs) value {record['value_mean']:+.3f} grad_norm {record['grad_norm'] or 0:.3f} "
            f"lr {record['lr']:.2e}{' head-only' if record['head_only'] else ''} {record['seconds']:.2f}s"
            + (f" | {record['update_skipped']} optimizer step(s) SKIPPED: non-finite loss or gradients "
               f"({record['skipped_steps']} skipped so far)" if record.get("update_skipped") else "")
        )  # fmt: skip


def load_snapshot_backbone(model: torch.nn.Module, trainable: Trainable, path) -> None:
    """Collective. The backbone of the policy snapshot (a dist checkpoint directory) at `path`
    into `model` and into the weights its optimizer steps from (fp32 masters, or the hybrid
    optimizer's copies under CPU offload: `reload_main_params`); the backbone's Adam state
    restarts (its moments belong to other weights)."""
    load_backbone(model, path)
    reload_main_params(trainable)
    restart_untouched_adam_state(trainable, reset_moments=True)


def _summary(phase: str, step: int, results: list[dict], head_only: bool, seconds: float) -> dict:
    tokens = max(results[0]["num_tokens"], 1.0)
    return {
        "phase": phase,
        "step": step,
        "loss": results[0]["loss"],
        "final_loss": results[-1]["loss"],
        "epoch_losses": [r["loss"] for r in results],
        "num_tokens": results[0]["num_tokens"],
        "value_mean": results[-1].get("value_sum", 0.0) / tokens,
        "clip_fraction": results[-1].get("clipped_sum", 0.0) / tokens,
        "grad_norm": results[-1]["grad_norm"],
        "update_skipped": sum(not r.get("update_successful", True) for r in results),  # epochs skipped
        "skipped_steps": results[-1].get("skipped_steps", 0),
        "lr": results[-1]["lr"],
        "head_only": head_only,
        "seconds": seconds,
    }
