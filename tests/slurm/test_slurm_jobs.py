"""The rendered sbatch scripts on a real SLURM (two pseudo-nodes on loopback, fake GPUs through
gres; tests/support/slurm_cluster.py), with a tiny CPU config for two steps: the shared and
the dedicated layout succeed with every component on the node and device set the layout says;
a step killed mid-job fails the job with that step named."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time

import pytest
import yaml

from megatron_rl.launch.slurm import render_and_submit
from megatron_rl.parallel import free_port
from tests.support.slurm_cluster import LocalSlurm

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    cluster = LocalSlurm(tmp_path_factory.mktemp("slurm"), port=free_port())
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from megatron_rl.models.tiny import make_tiny_model

    return make_tiny_model("qwen3", tmp_path_factory.mktemp("model") / "qwen3", seed=3, hidden_size=128)


def write_config(tmp_path, model, style: str, num_steps: int = 2):
    ports = [free_port() for _ in range(6)]
    deployment = {"device": "cpu", "nodes": 2, "gpus_per_node": 2, "inference_gpus": 1, "policy_gpus": 1}
    config = {
        "model": {"hf_config": str(model), "checkpoint": str(model), "seq_len": 128, "dtype": "float32"},
        "algorithm": {"type": "grpo" if style == "none" else "sao"},
        "orchestrator": {
            "num_steps": num_steps,
            "batch_size": 2,
            "group_size": 2 if style == "none" else 1,
            "max_prompt_tokens": 32,
            "max_completion_tokens": 8,
        },  # fmt: skip
        "inference": {
            "backend": "vllm-cpu",
            "weight_update": "safetensors",
            "publish_dir": str(tmp_path / "published"),
            "base_port": ports[0],
            "router_port": ports[1],
            "weight_broadcast_port": ports[2],
        },  # fmt: skip
        "deployment": deployment,
        "transport": {"policy_port": ports[3], "critic_port": ports[4], "receive_timeout_s": 300},
        "checkpoint": {"dir": str(tmp_path / "checkpoints")},
        "logging": {"dir": str(tmp_path / "run"), "console": False},
    }
    if style != "none":
        config["value"] = {"model": {"hf_config": str(model), "checkpoint": str(model), "seq_len": 128,
                                     "dtype": "float32"}, "service": {"port": ports[5]}}  # fmt: skip
        if style == "shared":
            deployment["num_value_gpus_per_train_node"] = 1
        else:
            deployment["num_value_nodes"] = 1
    path = tmp_path / f"{style}.yaml"
    path.write_text(yaml.safe_dump(config))
    script = tmp_path / f"{style}.sbatch"
    assert render_and_submit(str(path), str(script), submit=False) == 0
    return script


def step_places(log_dir) -> dict[str, list[tuple[str, str]]]:
    """name -> [(node, devices)] from the first lines every step's log starts with."""
    places = {}
    for log in log_dir.glob("*.log"):
        places[log.stem] = re.findall(r"^\[step\] node (\S+) devices (\S+)", log.read_text(), re.M)
    return places


def job_output(tmp_path, job_id) -> str:
    return (tmp_path / "run" / "logs" / f"slurm-{job_id}.out").read_text()


@pytest.mark.parametrize("style", ["shared", "dedicated"])
def test_rendered_job_runs_two_steps_with_components_where_the_layout_says(slurm, model, tmp_path, style):
    script = write_config(tmp_path, model, style)
    code, job_id = slurm.sbatch_wait(script)
    output = job_output(tmp_path, job_id)
    assert code == 0, output + "\n".join(
        f"{p.name}:\n{p.read_text()[-2000:]}" for p in (tmp_path / "run" / "logs").glob("*.log")
    )
    assert "the orchestrator finished its steps" in output
    places = step_places(tmp_path / "run" / "logs")
    assert places["inference_0"] == [("n1", "0")] and places["router"] == [("n1", "none")]
    if style == "shared":  # policy and critic share n2 on disjoint GPUs
        assert [p[0] for p in places["policy"]] == ["n2"] and [p[0] for p in places["critic"]] == ["n2"]
        assert places["policy"][0][1] != places["critic"][0][1]
        assert places["orchestrator"] == [("n2", "none")]
    else:  # the policy beside inference on n1, the critic alone on n2 with both its GPUs
        assert places["policy"] == [("n1", "1")] and places["critic"] == [("n2", "0,1")]
        assert places["orchestrator"] == [("n1", "none")]
    metrics = (tmp_path / "run" / "orchestrator_metrics.jsonl").read_text().splitlines()
    assert len(metrics) == 2
    assert (tmp_path / "published" / "latest").read_text().strip() == "version_00000002"


def test_a_step_killed_mid_job_fails_the_job_naming_it(slurm, model, tmp_path):
    """The policy's step is killed (SIGKILL) once it runs: the inference server and the router are
    up then (the job starts the trainers after the server answers). The job fails, names the
    step, and stops every other step."""
    script = write_config(tmp_path, model, "none", num_steps=1000)
    policy = f"train-policy --config {tmp_path}"

    def kill_the_policy():
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if subprocess.run(["pkill", "-9", "-f", policy], check=False).returncode == 0:
                return
            time.sleep(0.5)

    killer = threading.Thread(target=kill_the_policy, daemon=True)
    killer.start()
    code, job_id = slurm.sbatch_wait(script)
    killer.join(5)
    output = job_output(tmp_path, job_id)
    assert code != 0
    assert re.search(r"step 'policy' ended with exit code \d+: stopping every step", output), output
    leftover = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True).stdout.split()
    assert leftover == [], "the job's other steps were stopped"


def test_sys_executable_is_what_the_job_runs(tmp_path, model):
    script = write_config(tmp_path, model, "none")
    assert f"PY={sys.executable}" in script.read_text()
