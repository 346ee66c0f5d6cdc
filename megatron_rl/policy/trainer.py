"""The policy trainer process: `megatron-rl train-policy --config RESOLVED.json` under torchrun.

Built on the role skeleton (trainer/role.py). Each step: receive this rank's grid item from the
policy ZMQ stream, `policy_update` (policy/update.py: `policy_minibatches` x `policy_epochs`
optimizer steps with the configured algorithm's loss on softmax(logits / T), the KL term against
the frozen initial policy when `algorithm.kl_coef` > 0, old log-probs from the sampler or
recomputed, rollout correction, loss aggregation; a grid item cut into other mini-batches than
`algorithm.policy_minibatches` stops the trainer with an error naming both numbers, before any
update of that step), publish the new weights as policy version
step + 1 (policy/publish/: safetensors or NCCL broadcast), export a policy snapshot for the
critic when that version is one of `value.snapshot.steps` (trainer/snapshot.py), checkpoint every
`checkpoint.save_interval` steps, and append one metrics line per step to
`logging.dir/policy_metrics.jsonl`.

The model transforms (transforms/plan.py): LoRA (`lora`, transforms/lora_transform.py) wraps the
target linears after the initial weights are loaded and before DDP and the optimizer exist, so the
frozen base gets neither gradient buffers nor optimizer state; the KL reference is then the same
model with its adapters off (`AdaptersOff`); each version reaches inference as the layout's
`policy_lora.serve` says (policy/publish/), and snapshots hold merged weights
(trainer/snapshot.py); checkpoints hold the adapters and the base's identity (`model.checkpoint`,
its fingerprint), not the base. Routing replay (`algorithm.routing_replay`,
transforms/routing.py) takes part in every training and pi_old pass (`Trainable.hooks`).
"""

from __future__ import annotations

import logging
import time

import torch

from megatron_rl import faults, parallel
from megatron_rl.config import ModelLayout, ResolvedConfig
from megatron_rl.models.builder import build_gpt_model, transformer_engine_choice
from megatron_rl.policy.publish import make_publisher
from megatron_rl.policy.update import UpdateSettings, policy_update
from megatron_rl.trainer.role import RoleTrainer
from megatron_rl.trainer.snapshot import export_snapshot, snapshot_versions


def build_policy_model(resolved: ResolvedConfig, layout: ModelLayout, **options) -> torch.nn.Module:
    """The policy at `layout`, with the model transforms' `options` (LoRA on an MoE model's
    experts: one linear per expert, SequentialMLP, not TE's grouped GEMM, so that each can be
    wrapped)."""
    te = transformer_engine_choice(
        resolved.model.transformer_engine, resolved.deployment.device, layout.cp, "model.transformer_engine"
    )
    return build_gpt_model(
        resolved.layout.policy_architecture,
        transformer_engine=te,
        tp=layout.tp,
        cp=layout.cp,
        pp=layout.pp,
        ep=layout.ep,
        dtype=resolved.model.dtype,
        seq_len=resolved.model.seq_len,
        **resolved.model.recompute.transformer_fields(),
        **options,
    )


def build_reference(model: torch.nn.Module, layout: ModelLayout, resolved: ResolvedConfig) -> torch.nn.Module:
    """The frozen reference policy for `algorithm.kl_coef`: the initial weights (taken from
    `model` before any checkpoint is resumed or any step taken, so a resumed run keeps the same
    reference), same layout, no gradients, eval mode. `model` may already be wrapped by DDP (its
    weights are then views into DDP's buffer): the reference copies them into weights of its own."""
    reference = build_policy_model(resolved, layout)
    reference.load_state_dict(model.state_dict())
    reference.requires_grad_(False)
    return reference.eval()


class PolicyTrainer(RoleTrainer):
    role = "policy"
    log = logging.getLogger("megatron_rl.policy")

    def __init__(self, resolved: ResolvedConfig):
        super().__init__(
            resolved,
            arch=resolved.layout.policy_architecture,
            model_config=resolved.model,
            optimizer_config=resolved.optimizer,
            seed=resolved.layout.policy_seed,
            checkpoint_dir=resolved.layout.paths.policy_checkpoints,
            # The LR schedule counts optimizer steps: N mini-batches x E epochs per RL step.
            total_optimizer_steps=resolved.orchestrator.num_steps * resolved.algorithm.optimizer_steps_per_step,
        )
        self.settings = UpdateSettings.from_config(resolved)

    def build_model(self) -> torch.nn.Module:
        """The policy, with its transforms' options (one linear per expert for expert adapters).
        The transforms (LoRA, routing replay) apply to it after its initial weights, in
        `RoleTrainer`; never to the KL reference, which `build_reference` builds plain."""
        return build_policy_model(self.resolved, self.layout, **self.model_options())

    def after_optimizer(self) -> None:
        """The KL reference, built once DDP and the optimizer exist: DDP allocates a new
        parameter and fp32 gradient buffer before it frees the old weights, and a reference
        already resident then would add its weights to that peak (on the 30B REINFORCE++
        example: 146.5 GiB of tensors, 152.5 with the memory plan's allowances, on a 140.4 GiB
        GPU; config/memory_plan.py plans this order). A transform may give a frozen reference
        without a copy (LoRA: the policy's own model with its adapters off): nothing is built."""
        if self.resolved.algorithm.kl_coef <= 0:
            self.reference = None
            return
        frozen = [r for r in (t.frozen_reference(self.model) for t in self.transforms) if r is not None]
        self.reference = frozen[0] if frozen else build_reference(self.model, self.layout, self.resolved)

    def checkpoint_extra(self, step: int) -> dict:
        return {"policy_version": step + 1}

    def console_line(self, record: dict) -> str:
        return (
            f"[policy] step {record['step']} loss {record['loss']:+.4f} clip {record['clip_fraction']:.3f} "
            f"ratio {record['ratio_mean']:.3f} kl {record['approx_kl']:.2e} mismatch {record['mismatch_kl']:.2e} "
            f"kl_ref {record['kl_ref']:.2e} entropy {record['entropy']:.3f} "
            + (f"updates {record['optimizer_steps']} (ratio last {record['ratio_mean_last']:.3f}, "
               f"clip last {record['clip_fraction_last']:.3f}) " if record["optimizer_steps"] > 1 else "")
            + (f"router agreement {record['router_agreement']:.4f} (tokens differing {record['router_token_mismatch']:.3f}) "
               if record.get("router_agreement") is not None else "")
            + f"grad_norm {record['grad_norm'] or 0:.3f} lr {record['lr']:.2e} {record['tokens_per_s'] or 0:.0f} tok/s"
            + (f" | optimizer step SKIPPED: non-finite loss or gradients ({record['skipped_steps']} skipped so far)"
               if record.get("update_skipped") else "")
        )  # fmt: skip

    def run(self) -> None:
        """Trains from the resumed step to `orchestrator.num_steps`, publishing every version."""
        resolved = self.resolved
        meta = self.resume()
        start = 0 if meta is None else meta["step"] + 1
        if self.is_rank0:
            self.log.info(
                "policy: %s, layout %s, steps %d..%d, model transforms: %s", self.loaded, self.layout.model_dump(),
                start, self.num_steps - 1, ", ".join(t.name for t in self.transforms) or "none",
            )  # fmt: skip
        receiver = self.receiver(resolved.transport.policy_port)
        publisher = make_publisher(resolved, self.transforms)
        snapshots = snapshot_versions(resolved.value)
        try:
            for step in range(start, self.num_steps):
                began = time.perf_counter()
                micro_batches = receiver.receive(step)
                faults.set_step(step)
                faults.kill_point("step.begin")
                metrics = policy_update(self.trainable, micro_batches, self.settings, reference=self.reference)
                faults.kill_point("step.trained")
                published = time.perf_counter()
                publisher.publish(self.model, step + 1)
                metrics["time"]["publish"] = time.perf_counter() - published
                if step + 1 in snapshots:  # the critic loads this version at its step + 1
                    export_snapshot(
                        self.model,
                        resolved.layout.paths.policy_snapshots,
                        step + 1,
                        info={"architecture": self.arch.model_dump(), "layout": self.layout.model_dump()},
                    )
                if self.should_save(step):
                    self.save(step)
                self.write_metrics(_summarise(step, metrics, time.perf_counter() - began))
            parallel.finished()
        finally:
            publisher.close()
            receiver.close()
            self.close()


def run_policy(resolved: ResolvedConfig) -> None:
    PolicyTrainer(resolved).run()


def _summarise(step: int, metrics: dict, seconds: float) -> dict:
    """One metrics line: `policy_update`'s metrics (means over the step's global action tokens)
    with the step, the version it published and its time."""
    record = {"step": step, "policy_version": step + 1, **metrics}
    record["update_skipped"] = not metrics.get("update_successful", True)
    record["seconds"] = seconds
    record["tokens_per_s"] = metrics["trained_tokens"] / seconds if seconds > 0 else None
    return record
