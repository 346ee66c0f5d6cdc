"""A CPU SAO config around a local HF model and a live critic (`megatron-rl critic` on local
gloo ranks), for the critic tests and benchmarks/scoring.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from megatron_rl.critic.client import HttpValueScorer
from megatron_rl.parallel import free_port
from tests.support.configs import write_resolved
from tests.support.processes import RankProcesses, start_service_ranks


def critic_config(
    tmp_path: Path,
    hf_dir: Path,
    world: int = 1,
    cp: int = 1,
    tp: int = 1,
    ep: int = 1,
    pp: int = 1,
    seq_len: int = 64,
    deployment: dict | None = None,
    **value_options,
):
    """(resolved, resolved_json_path) for a SAO run whose critic has `world` ranks; keyword
    arguments override the value section (plus `num_steps`), `deployment` adds to that section."""
    ports = [free_port() for _ in range(5)]
    value = {
        "model": {
            "hf_config": str(hf_dir),
            "checkpoint": str(hf_dir),
            "seq_len": seq_len,
            "dtype": "float32",
            "cp": cp,
            "tp": tp,
            "pp": pp,
            "ep": ep,
        },
        "optimizer": {"lr": 1e-3, "grad_clip": 1.0},
        "head_init_std": 0.05,
        "service": {"port": ports[4], "max_batch_sequences": 64},
    }
    num_steps = value_options.pop("num_steps", 4)
    value.update(value_options)
    config = {
        "model": {
            "hf_config": str(hf_dir),
            "checkpoint": str(hf_dir),
            "seq_len": seq_len,
            "dtype": "float32",
        },
        "value": value,
        "algorithm": {"type": "sao"},
        "orchestrator": {
            "num_steps": num_steps,
            "batch_size": 4,
            "group_size": 1,
            "max_prompt_tokens": seq_len // 4,
            "max_completion_tokens": seq_len // 2,
        },
        "inference": {"backend": "vllm-cpu", "base_port": ports[2], "weight_broadcast_port": ports[3]},
        "deployment": {
            "device": "cpu",
            "nodes": 1,
            "gpus_per_node": 8,
            "inference_gpus": 1,
            "policy_gpus": 1,
            "num_value_gpus_per_train_node": world,
            **(deployment or {}),
        },
        "transport": {"policy_port": ports[0], "critic_port": ports[1], "receive_timeout_s": 120},
        "checkpoint": {"dir": str(tmp_path / "checkpoints"), "save_interval": 1},
        "logging": {"dir": str(tmp_path / "logs")},
    }
    return write_resolved(tmp_path, config)


def value_loss(result, samples) -> float:
    """0.5 * mean squared error of scored values (a ScoreResult) against the samples' returns on
    their action tokens."""
    errors = [(np.asarray(v) - s.returns)[s.loss_mask] for v, s in zip(result.values, samples, strict=True)]
    return 0.5 * float(np.mean(np.concatenate(errors) ** 2))


def critic_url(resolved) -> str:
    return f"http://{resolved.value.service.host}:{resolved.value.service.port}"


def start_critic(resolved, resolved_path: Path, log_dir: Path, timeout_s: float = 240.0) -> RankProcesses:
    """Starts the critic on its ranks and waits until /health answers."""
    return start_service_ranks(["critic", "--config", str(resolved_path)], resolved.layout.critic.world_size, log_dir,
                               lambda: HttpValueScorer(critic_url(resolved), retries=0, timeout_s=5), timeout_s)  # fmt: skip
