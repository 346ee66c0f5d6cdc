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

import json
import logging
import time
from pathlib import Path

import torch.distributed as dist

from megatron_rl import parallel
from megatron_rl.config import ResolvedConfig
from megatron_rl.data.types import MicroBatch, ScoreResult, TrainingSample

log = logging.getLogger("megatron_rl.critic")

HEAD_PREFIX = "value_head."


def critic_checkpoint_dir(resolved: ResolvedConfig) -> Path:
    return Path(resolved.checkpoint.dir) / "critic"


class CriticTrainer:
    def __init__(self, resolved: ResolvedConfig):
        from megatron.core import parallel_state as ps

        from megatron_rl.models.lora import apply_lora
        from megatron_rl.models.value_model import build_value_model, freeze_attention
        from megatron_rl.trainer.optimizer import build_trainable
        from megatron_rl.trainer.step import value_loss_func
        from megatron_rl.trainer.weights import load_initial_weights

        if resolved.value is None:
            raise ValueError("the critic needs a value section in the config")
        self.resolved = resolved
        self.value = resolved.value
        self.layout = parallel.initialize_role(resolved, "critic", seed=resolved.orchestrator.seed + 1)
        self.arch = resolved.layout.critic_architecture
        layout, model_config = self.layout, self.value.model
        model = build_value_model(
            self.arch,
            seq_len=model_config.seq_len,
            head_init_std=self.value.head_init_std,
            head_init_seed=resolved.orchestrator.seed,
            tp=layout.tp,
            cp=layout.cp,
            pp=layout.pp,
            ep=layout.ep,
            dtype=model_config.dtype,
            **model_config.recompute.transformer_fields(),
        )
        self.loaded = load_initial_weights(
            model, model_config.checkpoint, self.arch, value_model=True, where="value.model.checkpoint"
        )
        if self.value.lora is not None:
            lora = self.value.lora
            apply_lora(
                model, lora.rank, lora.alpha, tuple(lora.target_modules), seed=resolved.orchestrator.seed
            )
        if self.value.freeze_attention:
            freeze_attention(model)
        self.model = model
        self.frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
        num_steps = resolved.orchestrator.num_steps
        total = self.value.pretrain_steps + num_steps * self.value.epochs_per_step
        self.trainable = build_trainable(
            model, self.value.optimizer, total_steps=total, head_pattern="*value_head.*"
        )
        self.loss = value_loss_func(resolved.algorithm.value_clip)
        self.pretrain_loss = value_loss_func(None)  # pretraining data has no old values to clip around
        self.num_steps = num_steps
        self.trained_step = -1
        self.pretrain_steps_done = 0
        self.head_only = False
        self.snapshots_loaded: list[int] = []
        self.dp = ps.get_data_parallel_world_size()
        self.data_rank = ps.get_data_parallel_rank()
        self.cp = ps.get_context_parallel_world_size()
        self.sp = ps.get_tensor_model_parallel_world_size() if model.config.sequence_parallel else 1
        self._pretrain_batches: list[list[TrainingSample]] | None = None

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
                "lora": self.value.lora is not None,
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
        from megatron_rl.trainer.optimizer import restart_untouched_adam_state

        for name, param in self.model.named_parameters():
            if name not in self.frozen:
                param.requires_grad_(not head_only or name.startswith(HEAD_PREFIX))
        if self.head_only and not head_only:
            restart_untouched_adam_state(self.trainable)
        self.trainable.head_only = head_only
        self.head_only = head_only

    # -- training -------------------------------------------------------------------------------
    def _epochs(self, micro_batches: list[MicroBatch], epochs: int, loss) -> list[dict]:
        from megatron_rl.trainer.step import train_step

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
        from megatron_rl.data.packing import pack_into_grid

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
        from megatron_rl.critic.pretrain import pretrain_batches, read_pretrain_jsonl

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
        """Waits for policy snapshot version `step`, loads its backbone, restarts the backbone's
        Adam state (the old moments belong to other weights)."""
        from megatron_rl.trainer.optimizer import restart_untouched_adam_state
        from megatron_rl.trainer.snapshot import snapshot_dir, wait_for_snapshot
        from megatron_rl.trainer.weights import load_backbone

        path = wait_for_snapshot(snapshot_dir(self.resolved), step, self.value.snapshot.wait_timeout_s)
        load_backbone(self.model, path)
        self.trainable.optimizer.reload_model_params()
        restart_untouched_adam_state(self.trainable, reset_moments=True)
        self.snapshots_loaded.append(step)
        if dist.get_rank() == 0:
            log.info("critic: loaded the policy snapshot version %d from %s", step, path)

    # -- scoring --------------------------------------------------------------------------------
    def score(self, request: list[list[int]] | None) -> ScoreResult | None:
        from megatron_rl.critic.scoring import score_sequences

        result = score_sequences(self.model, request, self.value.model.seq_len)
        if result is not None:
            result.step = self.trained_step
        return result

    # -- checkpoints ----------------------------------------------------------------------------
    def save(self) -> Path:
        from megatron_rl.trainer.checkpoint import save_checkpoint

        return save_checkpoint(
            critic_checkpoint_dir(self.resolved),
            self.trained_step,
            self.trainable,
            extra={
                "trained_step": self.trained_step,
                "pretrain_steps_done": self.pretrain_steps_done,
                "head_only": self.head_only,
                "snapshots_loaded": self.snapshots_loaded,
            },
            keep_last=self.resolved.checkpoint.keep_last,
        )

    def resume(self, together: bool = True) -> dict | None:
        """Restores the critic checkpoint of the run's common resume step (model, optimizer,
        scheduler, RNG, step; see `run_resume_step`), or before any training step the newest
        value-pretraining checkpoint. `together=False`: the critic's own latest checkpoint (a
        critic trained on its own, without a policy)."""
        from megatron_rl.trainer.checkpoint import (
            CheckpointMismatch,
            complete_steps,
            load_checkpoint,
            run_resume_step,
        )

        steps = complete_steps(critic_checkpoint_dir(self.resolved))
        step = run_resume_step(self.resolved) if together else (steps[-1] if steps else None)
        if together and step is not None and step not in steps:
            raise CheckpointMismatch(
                f"{critic_checkpoint_dir(self.resolved)}: the policy resumes after its checkpoint of step {step}, "
                f"but the critic has no checkpoint of that step (it has {steps}); the orchestrator lets the "
                "policy train a step only after the critic checkpointed it, so the critic's checkpoints were "
                "removed or written under another checkpoint.dir"
            )
        if step is None:
            pretraining = [s for s in steps if s < 0]
            step = pretraining[-1] if pretraining else None
            if step is None:
                return None
        meta = load_checkpoint(critic_checkpoint_dir(self.resolved), self.trainable, step)
        if meta is None:
            return None
        extra = meta["extra"]
        self.trained_step = extra["trained_step"]
        self.pretrain_steps_done = extra["pretrain_steps_done"]
        self.snapshots_loaded = list(extra.get("snapshots_loaded", []))
        self.set_head_only(bool(extra["head_only"]))
        return meta

    def should_save(self, step: int) -> bool:
        interval = self.resolved.checkpoint.save_interval
        return bool(interval) and ((step + 1) % interval == 0 or step + 1 == self.num_steps)


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


def write_metrics(path: Path, record: dict, console: bool) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
    if console:
        print(
            f"[critic] {record['phase']} step {record['step']} loss {record['loss']:.4f} -> {record['final_loss']:.4f} "
            f"({len(record['epoch_losses'])} epochs) value {record['value_mean']:+.3f} grad_norm {record['grad_norm'] or 0:.3f} "
            f"lr {record['lr']:.2e}{' head-only' if record['head_only'] else ''} {record['seconds']:.2f}s"
            + (f" | {record['update_skipped']} optimizer step(s) SKIPPED: non-finite loss or gradients "
               f"({record['skipped_steps']} skipped so far)" if record.get("update_skipped") else ""),  # fmt: skip
            flush=True,
        )
