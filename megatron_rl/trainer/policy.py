"""The policy trainer process: `megatron-rl train-policy --config RESOLVED.json` under torchrun.

Each step: receive this rank's grid item from the policy ZMQ stream, one train_step with the
configured algorithm's loss, publish the new weights (HF safetensors for vLLM `reload_weights`
when `inference.weight_update` is `safetensors`), export a policy snapshot for the critic when
the next version is one of `value.snapshot.steps` (trainer/snapshot.py), checkpoint to
`checkpoint.dir/policy` every `checkpoint.save_interval` steps, and append one metrics line
(JSON) per step to `logging.dir/policy_metrics.jsonl`.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch

from megatron_rl import faults, parallel
from megatron_rl.config import ResolvedConfig

log = logging.getLogger("megatron_rl.policy")


def build_policy_model(resolved: ResolvedConfig, layout):
    from megatron_rl.models.builder import build_gpt_model

    return build_gpt_model(
        resolved.layout.policy_architecture,
        tp=layout.tp,
        cp=layout.cp,
        pp=layout.pp,
        ep=layout.ep,
        dtype=resolved.model.dtype,
        seq_len=resolved.model.seq_len,
        **resolved.model.recompute.transformer_fields(),
    )


def policy_checkpoint_dir(resolved: ResolvedConfig) -> Path:
    return Path(resolved.checkpoint.dir) / "policy"


def run_policy(resolved: ResolvedConfig) -> None:
    from megatron_rl.algorithms import make_algorithm
    from megatron_rl.trainer.checkpoint import load_checkpoint, run_resume_step, save_checkpoint
    from megatron_rl.trainer.optimizer import build_trainable
    from megatron_rl.trainer.publish import publish_hf_weights
    from megatron_rl.trainer.receive import grid_receiver
    from megatron_rl.trainer.snapshot import export_snapshot, snapshot_dir, snapshot_versions
    from megatron_rl.trainer.step import policy_loss_func, train_step
    from megatron_rl.trainer.weights import load_initial_weights

    layout = parallel.initialize_role(resolved, "policy", seed=resolved.orchestrator.seed)
    arch = resolved.layout.policy_architecture
    model = build_policy_model(resolved, layout)
    loaded = load_initial_weights(model, resolved.model.checkpoint, arch)
    reference = build_reference(model, layout, resolved) if resolved.algorithm.kl_coef > 0 else None
    num_steps = resolved.orchestrator.num_steps
    trainable = build_trainable(model, resolved.optimizer, total_steps=num_steps)
    start = 0
    if resolved.checkpoint.resume:
        common = run_resume_step(resolved)  # with the critic, the step both roles checkpointed
        meta = None if common is None else load_checkpoint(policy_checkpoint_dir(resolved), trainable, common)
        if meta is not None:
            start = meta["step"] + 1
            loaded = f"checkpoint step {meta['step']} in {policy_checkpoint_dir(resolved)}"
    is_rank0 = torch.distributed.get_rank() == 0
    if is_rank0:
        log.info("policy: %s, layout %s, steps %d..%d", loaded, layout.model_dump(), start, num_steps - 1)
    # A scorer is not needed to train: advantages arrive with the grid.
    loss_func = policy_loss_func(make_algorithm(resolved.algorithm, _NoScorer()), resolved.algorithm.kl_coef)
    receiver = grid_receiver(resolved, resolved.transport.policy_port, vocab_size=arch.vocab_size)
    broadcaster = make_broadcaster(resolved) if resolved.inference.weight_update == "nccl" else None
    if broadcaster is not None and is_rank0:
        broadcaster.connect()
    # config.json and tokenizer files for the published versions (loadable by transformers/vLLM).
    side_files = Path(resolved.model.hf_config) if resolved.model.hf_config else None
    metrics_path = Path(resolved.logging.dir) / "policy_metrics.jsonl"
    if is_rank0:
        metrics_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        for step in range(start, num_steps):
            began = time.perf_counter()
            micro_batches = receiver.receive(step)
            faults.set_step(step)
            faults.kill_point("step.begin")
            metrics = train_step(trainable, micro_batches, loss_func, reference=reference)
            faults.kill_point("step.trained")
            if broadcaster is not None:
                broadcaster.publish(model, arch, step + 1)
            elif resolved.inference.publish_dir:
                publish_hf_weights(
                    model, arch, resolved.inference.publish_dir, step + 1, hf_side_files=side_files
                )
            if step + 1 in snapshot_versions(resolved):  # the critic loads this version at its step + 1
                export_snapshot(
                    model,
                    snapshot_dir(resolved),
                    step + 1,
                    info={"architecture": arch.model_dump(), "layout": layout.model_dump()},
                )
            interval = resolved.checkpoint.save_interval
            if interval and ((step + 1) % interval == 0 or step + 1 == num_steps):
                save_checkpoint(
                    policy_checkpoint_dir(resolved),
                    step,
                    trainable,
                    extra={"policy_version": step + 1},
                    keep_last=resolved.checkpoint.keep_last,
                )
            elapsed = time.perf_counter() - began
            if is_rank0:
                record = _summarise(step, metrics, elapsed)
                with open(metrics_path, "a") as f:
                    f.write(json.dumps(record) + "\n")
                if resolved.logging.console:
                    print(_console_line(record), flush=True)
        parallel.finished()
    finally:
        receiver.close()
        parallel.destroy()


def make_broadcaster(resolved: ResolvedConfig):
    """Path (b): BroadcastPublisher to every configured inference server's workers."""
    import os

    from megatron_rl.inference.vllm_control import VllmControl
    from megatron_rl.trainer.publish import BroadcastPublisher

    inference = resolved.inference
    api_key = inference.api_key()
    controls = [VllmControl(url, api_key=api_key) for url in resolved.layout.inference_urls]
    host = inference.weight_broadcast_host or os.environ.get("MASTER_ADDR", "127.0.0.1")
    return BroadcastPublisher(
        controls,
        host,
        inference.weight_broadcast_port,
        workers_per_server=inference.tp,
        bucket_bytes=inference.weight_bucket_mb << 20,
    )


def build_reference(model, layout, resolved: ResolvedConfig):
    """The frozen reference policy for `algorithm.kl_coef`: the initial weights (taken from the
    freshly initialised `model` before any checkpoint is resumed, so a resumed run keeps the
    same reference), same layout, no gradients, eval mode."""
    reference = build_policy_model(resolved, layout)
    reference.load_state_dict(model.state_dict())
    reference.requires_grad_(False)
    return reference.eval()


class _NoScorer:
    async def score(self, batched_token_ids):
        raise RuntimeError("the policy trainer does not score sequences")


def _summarise(step: int, metrics: dict, seconds: float) -> dict:
    """One metrics line: means over the step's global action tokens."""
    tokens = max(metrics["num_tokens"], 1.0)
    return {
        "step": step,
        "policy_version": step + 1,
        "loss": metrics["loss"],
        "num_tokens": metrics["num_tokens"],
        "clip_fraction": metrics.get("clipped_sum", 0.0) / tokens,
        "ratio_mean": metrics.get("ratio_sum", 0.0) / tokens,
        "approx_kl": metrics.get("approx_kl_sum", 0.0) / tokens,
        "entropy": metrics.get("entropy_sum", 0.0) / tokens,
        "kl_ref": metrics.get("kl_ref_sum", 0.0) / tokens,
        "grad_norm": metrics.get("grad_norm"),
        "update_skipped": not metrics.get("update_successful", True),
        "skipped_steps": metrics.get("skipped_steps", 0),
        "lr": metrics.get("lr"),
        "seconds": seconds,
        "tokens_per_s": metrics["num_tokens"] / seconds if seconds > 0 else None,
    }


def _console_line(record: dict) -> str:
    return (
        f"[policy] step {record['step']} loss {record['loss']:+.4f} clip {record['clip_fraction']:.3f} "
        f"ratio {record['ratio_mean']:.3f} kl {record['approx_kl']:.2e} kl_ref {record['kl_ref']:.2e} entropy {record['entropy']:.3f} "
        f"grad_norm {record['grad_norm'] or 0:.3f} lr {record['lr']:.2e} {record['tokens_per_s'] or 0:.0f} tok/s"
        + (f" | optimizer step SKIPPED: non-finite loss or gradients ({record['skipped_steps']} skipped so far)"
           if record.get("update_skipped") else "")
    )  # fmt: skip
