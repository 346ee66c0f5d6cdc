"""The tiny CPU stack for end-to-end tests and benchmarks: a run config around a pool's model,
the critic and policy as `megatron-rl` processes (one gloo rank each), and the orchestrator in
this process."""

from __future__ import annotations

import asyncio
import json

import yaml

from megatron_rl.config import load_config
from megatron_rl.orchestrator.run import orchestrate
from megatron_rl.parallel import free_port
from tests.support.processes import RankProcesses


def stack_config(tmp_path, model_dir, algorithm: str | dict, num_steps: int, pool, overrides=(), **orchestrator):
    """(resolved, resolved_json_path) of a tiny CPU run on `pool`'s model; `algorithm` is the
    preset's name or a whole algorithm section; keyword arguments override the orchestrator
    section, then `overrides` ("KEY=VALUE", as `--set` takes them) anything."""
    section = {"type": algorithm} if isinstance(algorithm, str) else dict(algorithm)
    algorithm = section["type"]
    ports = [free_port() for _ in range(4)]
    config = {
        "model": {
            "hf_config": str(model_dir),
            "checkpoint": str(model_dir),
            "seq_len": 128,
            "dtype": "float32",
        },
        "optimizer": {"lr": 1e-3, "grad_clip": 1.0},
        "algorithm": section,
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
            **orchestrator,
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
    if section.get("advantage", "gae" if algorithm != "grpo" else "grpo") == "gae":
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
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / f"config-{num_steps}.yaml"
    path.write_text(yaml.safe_dump(config))
    resolved = load_config(path, list(overrides))
    resolved_path = tmp_path / f"resolved-{num_steps}.json"
    resolved_path.write_text(resolved.to_json())
    return resolved, resolved_path


def reset_pool(pool, model_dir):
    """Every server back on the initial weights as version 0 (earlier tests moved them)."""
    for control in pool.controls:
        control.load_version(str(model_dir), 0)
    pool.sync.refresh()
    assert pool.sync.version == 0


def run_stack(tmp_path, resolved, resolved_path, pool, kill_when=None):
    """Critic and policy processes plus the orchestrator in this process; returns the records.
    `kill_when()`, polled while the run is up: once true, the critic and policy ranks get
    SIGKILL and the orchestrator is cancelled (the whole run dies mid-step)."""
    roles = [("policy", ["train-policy", "--config", str(resolved_path)])]
    if resolved.value is not None:
        roles.append(("critic", ["critic", "--config", str(resolved_path)]))
    processes = {name: RankProcesses(argv, 1, tmp_path / "logs" / name) for name, argv in roles}

    async def run() -> bool:
        task = asyncio.ensure_future(orchestrate(resolved, pool))
        while not task.done():
            if kill_when is not None and kill_when():
                for group in processes.values():
                    for process in group.processes:
                        process.kill()
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
                return True
            await asyncio.sleep(0.1)
        await task
        return False

    try:
        killed = asyncio.run(asyncio.wait_for(run(), 600))
        if not killed:
            code = processes["policy"].processes[0].wait(120)
            if code != 0:
                raise RuntimeError(
                    f"train-policy exited with {code}:\n{processes['policy'].output()[-3000:]}"
                )
    finally:
        for group in processes.values():
            group.stop()
    path = tmp_path / "logs" / "orchestrator_metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def policy_records(tmp_path):
    path = tmp_path / "logs" / "policy_metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]
