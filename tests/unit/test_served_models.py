"""A teacher and a judge the run serves itself (config/services.py): the config's checks, their
GPUs and ports in the layout, the memory plan's rows for them (weights against the HF model's
own parameter count) and check-config's GPU totals, the local launcher's plan (disjoint devices,
their servers and routers, the orchestrator reaching them at their routers), the supervisor
waiting for each server's own model, the SLURM placement and script, and preflight's check."""

from __future__ import annotations

import asyncio
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megatron_rl.config import ConfigError, load_config, parse_config
from megatron_rl.config.memory_plan import GIB, VLLM_RESERVE_GIB, check_fits, format_plan, memory_plan
from megatron_rl.launch.local import Component, LaunchError, Supervisor, assign_devices, run_local
from megatron_rl.launch.preflight import Context
from megatron_rl.launch.preflight.host_checks import listening_ports
from megatron_rl.launch.preflight.services import check_served_models
from megatron_rl.launch.slurm import gpu_use_per_node, place, render
from megatron_rl.orchestrator.run import service_url
from megatron_rl.parallel import free_port
from tests.support.fake_vllm import fake_vllm_command
from tests.support.shell import checked_script

JUDGE = {"model": "judge", "template": "Answer: {answer}. Score 0-10.", "verdict": "score"}


def run_config(tmp_path: Path, model: Path, teacher: dict | None = None, judge: dict | None = None,
               **deployment) -> dict:  # fmt: skip
    """A GRPO run on CUDA (8 GPUs) around the tiny model; `teacher` / `judge` the sections."""
    config = {
        "model": {"hf_config": str(model), "seq_len": 128},
        "algorithm": {"type": "grpo"},
        "orchestrator": {"num_steps": 2, "batch_size": 4, "group_size": 2, "max_prompt_tokens": 32,
                         "max_completion_tokens": 16},  # fmt: skip
        "inference": {"num_servers": 1, "weight_update": "safetensors", "publish_dir": str(tmp_path / "published")},
        "deployment": {"nodes": 1, "gpus_per_node": 8, "inference_gpus": 1, "policy_gpus": 2, **deployment},
        "logging": {"dir": str(tmp_path / "run")},
    }
    if teacher is not None:
        config["distillation"] = {"teacher": {"model_dir": str(model), **teacher}, "coef": 0.5}
    if judge is not None:
        config["orchestrator"]["judge"] = {**JUDGE, **judge}
    return config


def errors_of(data: dict) -> str:
    with pytest.raises(ConfigError) as caught:
        parse_config(data)
    return str(caught.value)


def test_a_teacher_without_url_is_served_by_the_run_with_its_own_gpus_ports_and_router(tmp_path, tiny_models):
    model = tiny_models["qwen3"]
    resolved = parse_config(run_config(tmp_path, model, teacher={"serve": {"num_servers": 2, "base_port": 9100,
                                                                          "router_port": 9150}}))  # fmt: skip
    teacher = resolved.layout.services["teacher"]
    assert (teacher.gpus, teacher.ports, teacher.url) == (2, [9100, 9101], "http://127.0.0.1:9150")
    assert teacher.server_urls == ["http://127.0.0.1:9100", "http://127.0.0.1:9101"]
    assert teacher.max_model_len == 128 + 1  # a whole sample as the prompt, plus the one token vLLM samples
    assert teacher.model_dir == str(model) and teacher.served_model_name == "teacher"
    assert resolved.layout.ports["distillation.teacher.serve.router_port"] == 9150
    assert resolved.layout.ports["distillation.teacher.serve.base_port+1"] == 9101
    assert service_url(resolved, "teacher") == "http://127.0.0.1:9150" and service_url(resolved, "judge") is None
    # the resolved file every process reads holds the same layout
    again = type(resolved).model_validate_json(resolved.to_json())
    assert again.layout.services == resolved.layout.services

    default = parse_config(run_config(tmp_path, model, teacher={}))  # no url: served, on the default block
    assert default.distillation.teacher.serve.base_port == 8300 and default.layout.services["teacher"].gpus == 1
    external = parse_config(run_config(tmp_path, model, teacher={"url": "http://teacher:8000"}))
    assert external.distillation.teacher.serve is None and external.layout.services == {}
    assert service_url(external, "teacher") is None  # the orchestrator takes the section's url


def test_served_models_are_checked_naming_the_key(tmp_path, tiny_models):
    model = tiny_models["qwen3"]
    both = errors_of(run_config(tmp_path, model, teacher={"url": "http://t:1", "serve": {}}))
    assert "distillation.teacher: url (http://t:1: a teacher you serve) and serve" in both
    judge = errors_of(run_config(tmp_path, model, judge={}))
    assert "orchestrator.judge.model_dir: a judge the run serves (no url)" in judge
    assert "exclude each other" in errors_of(run_config(tmp_path, model, judge={"url": "http://j:1", "serve": {}}))
    missing = errors_of(run_config(tmp_path, model, teacher={"model_dir": str(tmp_path / "nothing")}))
    assert f"distillation.teacher.model_dir: no config.json in {tmp_path / 'nothing'}" in missing
    crowded = errors_of(run_config(tmp_path, model, teacher={"serve": {"num_servers": 3, "tp": 2}},
                                   judge={"model_dir": str(model)}, gpus_per_node=9))  # fmt: skip
    assert ("deployment: inference_gpus + policy_gpus + critic GPUs + teacher GPUs + judge GPUs = "
            "1 + 2 + 0 + 6 + 1 = 10 exceeds nodes*gpus_per_node = 9") in crowded  # fmt: skip
    clash = errors_of(run_config(tmp_path, model, teacher={"serve": {"router_port": 8000}}))
    assert "distillation.teacher.serve.router_port: port 8000 is already used by inference.base_port+0" in clash
    long = errors_of(run_config(tmp_path, model, teacher={"serve": {"max_model_len": 4096}}))
    assert "distillation.teacher.serve.max_model_len: the run sends sequences of up to 4096 tokens" in long
    heads = errors_of(run_config(tmp_path, model, teacher={"serve": {"tp": 3}}))
    assert "distillation.teacher.serve.tp (3): vLLM splits the model's" in heads
    hosts = errors_of(run_config(tmp_path, model, teacher={"serve": {"server_hosts": ["a", "b"]}}))
    assert "distillation.teacher.serve.server_hosts has 2 addresses for serve.num_servers = 1" in hosts


def hf_parameters(model_dir: Path) -> int:
    """The parameter count of the HF model itself (an independent count)."""
    from transformers import AutoModelForCausalLM

    return sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model_dir).parameters())


def test_the_memory_plan_counts_the_teachers_and_judges_gpus_weights_and_kv(tmp_path, tiny_models):
    model = tiny_models["qwen3"]
    config = run_config(tmp_path, model, teacher={"serve": {"tp": 2, "gpu_memory_utilization": 0.5}},
                        judge={"model_dir": str(model)})  # fmt: skip
    resolved = parse_config(config)
    plan = {gpu.role: gpu for gpu in memory_plan(resolved)}
    assert set(plan) == {"policy", "inference", "teacher", "judge"}
    weights = hf_parameters(model) * 2 / GIB  # vLLM serves 16-bit weights
    budget = resolved.deployment.gpu_memory_gib
    assert plan["teacher"].parts["weights"] == pytest.approx(weights / 2)  # split by its tp
    assert plan["judge"].parts["weights"] == pytest.approx(weights)
    assert plan["teacher"].total == pytest.approx(budget * 0.5)
    assert plan["judge"].parts["kv_cache"] == pytest.approx(budget * 0.85 - weights - VLLM_RESERVE_GIB)
    assert plan["teacher"].where == "distillation.teacher" and plan["judge"].where == "orchestrator.judge"
    text = format_plan(resolved, memory_plan(resolved))
    assert "GPUs: inference 1 + policy 2 + teacher 2 + judge 1 = 6 of 1 node(s) x 8 = 8" in text
    assert any(line.startswith("teacher ") for line in text.splitlines())
    # check-config prints the same on stderr
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    result = subprocess.run([sys.executable, "-m", "megatron_rl.launch.cli", "check-config", str(path)],
                            capture_output=True, text=True)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "GPUs: inference 1 + policy 2 + teacher 2 + judge 1 = 6" in result.stderr
    assert json.loads(result.stdout)["layout"]["services"]["judge"]["url"] == "http://127.0.0.1:8450"


def test_a_served_model_that_does_not_fit_its_gpu_is_refused_naming_the_option(tmp_path, tiny_models):
    model = tiny_models["qwen3"]
    config = run_config(tmp_path, model, teacher={"serve": {"gpu_memory_utilization": 0.9}})
    resolved = parse_config(config)
    resolved.deployment.gpu_memory_gib = 4.0  # the reserve alone is 4 GiB
    errors = [e for e in check_fits(resolved, memory_plan(resolved)) if e.startswith("distillation.teacher")]
    assert any("leave 0.0 GiB of KV cache" in e and "raise distillation.teacher.serve.tp" in e for e in errors), errors
    assert any("lower distillation.teacher.serve.gpu_memory_utilization" in e for e in errors), errors


def served_yaml(tmp_path: Path, model: Path) -> Path:
    config = run_config(tmp_path, model, teacher={"serve": {"base_port": 9300, "router_port": 9350}},
                        judge={"model_dir": str(model), "serve": {"tp": 2, "base_port": 9400, "router_port": 9450}})  # fmt: skip
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def blocks_of(text: str) -> dict[str, str]:
    blocks, name = {}, None
    for line in text.splitlines():
        if line.startswith("[") and line.endswith("]"):
            name, blocks[line[1:-1]] = line[1:-1], ""
        elif name is not None:
            blocks[name] += line + "\n"
    return blocks


def test_megatron_rl_run_plans_the_served_models_servers_and_routers_on_devices_of_their_own(
    tmp_path, tiny_models, monkeypatch
):
    model = tiny_models["qwen3"]
    path = served_yaml(tmp_path, model)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7,6,5,4,3,2,1,0")
    out = io.StringIO()
    assert run_local(str(path), dry_run=True, out=out) == 0
    blocks = blocks_of(out.getvalue())
    assert list(blocks) == ["inference_0", "router", "teacher_0", "teacher_router", "judge_0", "judge_router",
                            "policy", "orchestrator"]  # fmt: skip
    assert "devices: 7\n" in blocks["inference_0"] and "devices: 6\n" in blocks["teacher_0"]
    assert "devices: 5,4\n" in blocks["judge_0"] and "devices: 3,2\n" in blocks["policy"]
    teacher, judge = blocks["teacher_0"], blocks["judge_0"]
    assert f"--model {model}" in teacher and "--served-model-name teacher" in teacher
    assert "--port 9300" in teacher and "--max-model-len 129" in teacher and "CUDA_VISIBLE_DEVICES=6" in teacher
    assert "--served-model-name judge" in judge and "--tensor-parallel-size 2" in judge
    assert "--max-model-len 2048" in judge  # the tiny model's max_position_embeddings
    assert "--worker-urls http://127.0.0.1:9300 --host 127.0.0.1 --port 9350" in blocks["teacher_router"]
    assert "--worker-urls http://127.0.0.1:9400 --host 127.0.0.1 --port 9450" in blocks["judge_router"]
    resolved = load_config(path)
    with pytest.raises(LaunchError, match=r"needs 6 devices \(inference 1, teacher 1, judge 2, critic 0, policy 2\)"):
        assign_devices(resolved, ["0", "1", "2", "3", "4"])


def test_the_supervisor_waits_for_each_server_to_serve_its_own_model(tmp_path):
    """The policy's server and a teacher's are started together; the rest only once both serve
    their own model (a teacher answering with the policy's name would not be ready)."""
    ports = [free_port() for _ in range(2)]

    def server(name, port, model):
        return Component(name, fake_vllm_command("--port", port, "--name", name, "--model", model),
                         tmp_path / f"{name}.log", url=f"http://127.0.0.1:{port}", model=model)  # fmt: skip

    marker = tmp_path / "started"
    after = Component("orchestrator", [sys.executable, "-c", f"open({str(marker)!r}, 'w').close()"],
                      tmp_path / "orchestrator.log")  # fmt: skip
    components = [server("inference_0", ports[0], "policy"), server("teacher_0", ports[1], "teacher"), after]
    out = io.StringIO()
    assert Supervisor(components, grace_s=5, out=out).run("policy", startup_timeout_s=60) == 0, out.getvalue()
    assert marker.exists()
    wrong = [server("inference_0", free_port(), "policy"), server("teacher_0", free_port(), "policy"),
             Component("orchestrator", [sys.executable, "-c", "pass"], tmp_path / "o2.log")]  # fmt: skip
    wrong[1].model = "teacher"  # it serves 'policy'
    out = io.StringIO()
    assert Supervisor(wrong, grace_s=5, out=out).run("policy", startup_timeout_s=4) == 1
    assert "teacher_0 not ready within 4s" in out.getvalue()


def test_the_slurm_job_places_and_starts_the_served_models(tmp_path, tiny_models):
    model = tiny_models["qwen3"]
    config = run_config(tmp_path, model, teacher={"serve": {"num_servers": 2}}, judge={"model_dir": str(model),
                        "serve": {"tp": 4}}, nodes=2, inference_gpus=4, policy_gpus=4)  # fmt: skip
    config["inference"].update(num_servers=2, tp=2)
    resolved = parse_config(config)
    placement = place(resolved)
    assert [(s.name, s.nodes, s.gpus_per_node) for s in placement["services"]["teacher"]] == [
        ("teacher_0", [0], 1), ("teacher_1", [0], 1)]  # fmt: skip
    assert [(s.name, s.nodes, s.gpus_per_node) for s in placement["services"]["judge"]] == [("judge_0", [1], 4)]
    use = gpu_use_per_node(placement)
    assert use == [{"inference_0": 2, "inference_1": 2, "teacher_0": 1, "teacher_1": 1, "policy": 2},
                   {"judge_0": 4, "policy": 2}]  # fmt: skip
    text = checked_script(tmp_path / "job.sbatch", render(resolved, tmp_path / "run.yaml"))
    assert "inference-server --config \"$JOB_CONFIG\" --service teacher --index 1" in text
    assert "inference-server --config \"$JOB_CONFIG\" --service judge --index 0" in text
    assert "router --config \"$JOB_CONFIG\" --service judge" in text
    assert '--set distillation.teacher.serve.host="${ADDRS[0]}"' in text
    assert '--set "orchestrator.judge.serve.server_hosts=[${ADDRS[1]}]"' in text
    assert text.index("step judge_0") < text.index("wait-inference") < text.index("step judge_router")


def test_preflight_checks_a_served_teacher_and_a_judge_the_user_serves(tmp_path, tiny_models):
    model = tiny_models["qwen3"]
    port = free_port()
    config = run_config(tmp_path, model, teacher={}, judge={"url": f"http://127.0.0.1:{port}"})
    config["inference"]["model_dir"] = str(model)
    resolved = parse_config(config)
    context = Context(resolved, "gloo")
    with pytest.raises(Exception, match=rf"orchestrator.judge.url http://127.0.0.1:{port} does not answer"):
        check_served_models(context)
    judge = subprocess.Popen(fake_vllm_command("--port", port, "--name", "j", "--model", "judge"))
    try:
        from megatron_rl.inference.vllm_control import VllmControl

        async def up():
            for _ in range(100):
                try:
                    VllmControl(f"http://127.0.0.1:{port}").models(timeout_s=1)
                    return
                except Exception:  # noqa: BLE001  (not up yet)
                    await asyncio.sleep(0.1)

        asyncio.run(up())
        figures = check_served_models(context)
        assert f"judge at http://127.0.0.1:{port} serves 'judge'" in figures
        assert f"teacher served from {model} on 1 GPU(s)" in figures and "tokenizer is the student's" in figures
    finally:
        judge.terminate()
        judge.wait()
    ports = listening_ports(context)
    assert ports["distillation.teacher.serve.base_port+0"] == ("127.0.0.1", 8300)
    assert ports["distillation.teacher.serve.router_port"] == ("127.0.0.1", 8350)


def test_preflight_refuses_a_teacher_whose_tokenizer_is_not_the_students(tmp_path, tiny_models):
    from megatron_rl.models.tiny import make_tiny_model

    characters = make_tiny_model("qwen3", tmp_path / "char", seed=1, vocab_size=64, tokenizer="char")
    config = run_config(tmp_path, tiny_models["qwen3"], teacher={"model_dir": str(characters)})
    resolved = parse_config(config)
    with pytest.raises(Exception, match=rf"distillation.teacher.model_dir {characters}: the teacher's tokenizer"):
        check_served_models(Context(resolved, "gloo"))

