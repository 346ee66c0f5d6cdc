"""Config builders for tests: a config dict that resolves without files (`base`), a CPU
SAO run around a tiny HF model written to disk and resolved (`write_config`), and any config dict
written, loaded and its resolved JSON written beside it (`write_resolved`)."""

from __future__ import annotations

import yaml

from megatron_rl.config import load_config

ARCH = {
    "family": "qwen3",
    "hidden_size": 64,
    "num_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "intermediate_size": 128,
    "vocab_size": 512,
}

def base(algorithm: str = "sao") -> dict:
    config = {
        "model": {"architecture": dict(ARCH), "seq_len": 256},
        "algorithm": {"type": algorithm},
        "orchestrator": {
            "batch_size": 4,
            "group_size": 4,
            "max_prompt_tokens": 64,
            "max_completion_tokens": 128,
        },
        "deployment": {"nodes": 1, "gpus_per_node": 8, "inference_gpus": 2, "policy_gpus": 4},
        "inference": {"num_servers": 2},
    }
    if algorithm != "grpo":
        config["value"] = {"model": {"architecture": dict(ARCH), "seq_len": 256}}
        config["deployment"]["num_value_gpus_per_train_node"] = 2
    return config


def write_config(tmp_path, hf_dir, num_steps, ports, **sections):
    """A CPU SAO config around `hf_dir` (policy on 2 ranks); `sections` update its sections."""
    config = {
        "model": {"hf_config": str(hf_dir), "checkpoint": str(hf_dir), "seq_len": 64, "dtype": "float32"},
        "optimizer": {"lr": 1e-3, "grad_clip": 1.0},
        "value": {
            "model": {"hf_config": str(hf_dir), "seq_len": 64, "dtype": "float32"},
            "snapshot": {"steps": [1]},
        },
        "algorithm": {"type": "sao", "kl_coef": 0.1},
        "orchestrator": {
            "num_steps": num_steps,
            "batch_size": 6,
            "group_size": 1,
            "max_prompt_tokens": 16,
            "max_completion_tokens": 40,
        },
        "inference": {
            "backend": "vllm-cpu",
            "weight_update": "safetensors",
            "publish_dir": str(tmp_path / "published"),
            "base_port": ports[2],
            "weight_broadcast_port": ports[3],
        },
        "deployment": {
            "device": "cpu",
            "nodes": 1,
            "gpus_per_node": 4,
            "inference_gpus": 1,
            "policy_gpus": 2,
            "num_value_gpus_per_train_node": 1,
        },
        "transport": {"policy_port": ports[0], "critic_port": ports[1], "receive_timeout_s": 120},
        "checkpoint": {"dir": str(tmp_path / "checkpoints"), "save_interval": 1},
        "logging": {"dir": str(tmp_path / "logs")},
    }
    for section, extra in sections.items():
        config[section].update(extra)
    return write_resolved(tmp_path, config, f"run{num_steps}.yaml", f"resolved{num_steps}.json")


def write_resolved(tmp_path, config: dict, name: str = "config.yaml", resolved_name: str = "resolved.json"):
    """(resolved, path of its JSON): `config` written to tmp_path/name and loaded, the resolved
    config written to tmp_path/resolved_name (what the roles' `--config` reads)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / name
    path.write_text(yaml.safe_dump(config))
    resolved = load_config(path)
    out = tmp_path / resolved_name
    out.write_text(resolved.to_json())
    return resolved, out
