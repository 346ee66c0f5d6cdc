"""The Megatron teacher's config (distillation.teacher.megatron): its layout, GPUs, port and
URL in the resolved layout, the refusals naming the key, its memory plan row (weights of its own
dtype split by its layout, no gradients or optimizer) and the client the orchestrator builds."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_rl.config import ConfigError, parse_config
from megatron_rl.config.memory_plan import BYTES, GIB, check_fits, format_plan, memory_plan
from megatron_rl.inference.teacher import VllmTeacher, make_teacher
from megatron_rl.orchestrator.run import service_url
from megatron_rl.teacher.client import MegatronTeacher
from tests.unit.test_served_models import hf_parameters, run_config


def errors_of(data: dict) -> str:
    with pytest.raises(ConfigError) as caught:
        parse_config(data)
    return str(caught.value)


def test_a_megatron_teacher_gets_its_layout_gpus_port_and_url(tmp_path, tiny_models):
    model = tiny_models["qwen3"]
    resolved = parse_config(run_config(tmp_path, model, teacher={"megatron": {"tp": 2, "gpus": 4, "port": 9400}}))
    teacher = resolved.layout.services["teacher"]
    assert (teacher.kind, teacher.gpus, teacher.url, teacher.max_model_len) == ("megatron", 4, "http://127.0.0.1:9400", 128)
    assert (teacher.megatron.tp, teacher.megatron.dp, teacher.megatron.world_size) == (2, 2, 4)
    assert resolved.distillation.teacher.serve is None  # not served by vLLM
    assert resolved.layout.ports["distillation.teacher.megatron.port"] == 9400
    assert service_url(resolved, "teacher") == "http://127.0.0.1:9400"
    client = make_teacher(resolved, service_url(resolved, "teacher"))
    assert isinstance(client, MegatronTeacher) and client.url == "http://127.0.0.1:9400"
    assert client.max_batch_sequences == 512 and client.timeout_s == 600.0
    vllm = parse_config(run_config(tmp_path, model, teacher={"url": "http://t:8000"}))
    assert isinstance(make_teacher(vllm, service_url(vllm, "teacher")), VllmTeacher)
    default = parse_config(run_config(tmp_path, model, teacher={"megatron": {}}))
    assert default.layout.services["teacher"].gpus == 1  # tp x cp x pp


def test_megatron_teacher_refusals_name_the_key(tmp_path, tiny_models):
    model = tiny_models["qwen3"]
    url = errors_of(run_config(tmp_path, model, teacher={"megatron": {}, "url": "http://t:1"}))
    assert "distillation.teacher: megatron (the run's Megatron teacher service) and url exclude each other" in url
    serve = errors_of(run_config(tmp_path, model, teacher={"megatron": {}, "serve": {}}))
    assert "megatron (the run's Megatron teacher service) and serve exclude each other" in serve
    heads = errors_of(run_config(tmp_path, model, teacher={"megatron": {"tp": 3}}))
    assert "distillation.teacher.megatron: num_key_value_heads (2) must be divisible by tp (3)" in heads
    uneven = errors_of(run_config(tmp_path, model, teacher={"megatron": {"tp": 2, "gpus": 3}}))
    assert "distillation.teacher.megatron: 3 GPUs are not divisible by tp*cp*pp = 2*1*1 = 2" in uneven
    clash = errors_of(run_config(tmp_path, model, teacher={"megatron": {"port": 8000}}))
    assert "distillation.teacher.megatron.port: port 8000 is already used by inference.base_port+0" in clash
    crowded = errors_of(run_config(tmp_path, model, teacher={"megatron": {"gpus": 6}}))
    assert "inference_gpus + policy_gpus + critic GPUs + teacher GPUs = 1 + 2 + 0 + 6 = 9 exceeds" in crowded
    missing = errors_of(run_config(tmp_path, model, teacher={"megatron": {}, "model_dir": str(tmp_path / "none")}))
    assert f"distillation.teacher.model_dir: no config.json in {tmp_path / 'none'}" in missing
    data = run_config(tmp_path, model, teacher={"megatron": {}})
    data["model"]["seq_len"] = 8192
    data["orchestrator"]["max_completion_tokens"] = 4096
    long = errors_of(data)
    assert "distillation.teacher.megatron: the run sends the teacher samples of up to model.seq_len = 8192" in long
    unknown = errors_of(run_config(tmp_path, model, teacher={"megatron": {"tensor_parallel": 2}}))
    assert "distillation.teacher.megatron.tensor_parallel: unknown key" in unknown


def test_the_memory_plan_counts_the_megatron_teachers_gpus_and_weights(tmp_path, tiny_models):
    model = tiny_models["qwen3"]
    resolved = parse_config(run_config(tmp_path, model, teacher={"megatron": {"tp": 2, "dtype": "float32"}}))
    plan = {gpu.role: gpu for gpu in memory_plan(resolved)}
    teacher = plan["teacher"]
    assert teacher.where == "distillation.teacher.megatron"
    # float32 weights split by tp 2: within the replicated norms of the HF model's count
    assert teacher.parts["weights"] == pytest.approx(hf_parameters(model) * BYTES["float32"] / 2 / GIB, rel=0.05)
    assert "gradients" not in teacher.parts and "optimizer" not in teacher.parts
    assert teacher.parts["activations"] > 0 and teacher.parts["nccl"] == 1.0  # its tensor-parallel group
    assert "GPUs: inference 1 + policy 2 + teacher 2 = 5 of 1 node(s) x 8 = 8" in format_plan(resolved, [*plan.values()])
    resolved.deployment.gpu_memory_gib = 3.0  # under the fixed allowances
    errors = [e for e in check_fits(resolved, memory_plan(resolved)) if e.startswith("distillation.teacher")]
    assert len(errors) == 1 and "a larger distillation.teacher.megatron.tp or pp" in errors[0], errors


def test_the_teacher_command_needs_a_megatron_teacher(tmp_path, tiny_models, capsys):
    from megatron_rl.launch import cli

    resolved = parse_config(run_config(tmp_path, tiny_models["qwen3"], teacher={"url": "http://t:8000"}))
    path = Path(tmp_path / "resolved.json")
    path.write_text(resolved.to_json())
    assert cli.main(["teacher", "--config", str(path)]) == 2
    assert "no Megatron teacher (distillation.teacher.megatron)" in capsys.readouterr().err
