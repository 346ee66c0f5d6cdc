"""The Megatron teacher's config (distillation.teacher.megatron): its layout, GPUs, port and
URL in the resolved layout, the refusals naming the key, its memory plan row (weights of its own
dtype split by its layout, no gradients or optimizer) and the client the orchestrator builds."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_rl.config import parse_config
from megatron_rl.config.memory_plan import BYTES, GIB, check_fits, format_plan, memory_plan
from megatron_rl.inference.teacher import VllmTeacher
from megatron_rl.orchestrator.run import service_url
from megatron_rl.teacher.client import MegatronTeacher, make_teacher
from tests.support.shell import checked_script
from tests.unit.test_served_models import errors_of, hf_parameters, run_config


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


def megatron_yaml(tmp_path: Path, model: Path, **deployment) -> Path:
    import yaml

    config = run_config(tmp_path, model, teacher={"megatron": {"tp": 2, "port": 9400}}, **deployment)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_megatron_rl_run_starts_the_teacher_as_a_torchrun_group_on_devices_of_its_own(tmp_path, tiny_models,
                                                                                       monkeypatch):  # fmt: skip
    import io

    from megatron_rl.launch.local import run_local, training_env
    from tests.unit.test_served_models import blocks_of

    path = megatron_yaml(tmp_path, tiny_models["qwen3"])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7,6,5,4,3,2,1,0")
    out = io.StringIO()
    assert run_local(str(path), dry_run=True, out=out) == 0
    blocks = blocks_of(out.getvalue())
    # no vLLM server or router of its own: one torchrun group, started after the policy's servers
    assert list(blocks) == ["inference_0", "router", "teacher", "policy", "orchestrator"]
    teacher = blocks["teacher"]
    assert "devices: 6,5\n" in teacher and "devices: 4,3\n" in blocks["policy"]
    assert "--nproc_per_node 2" in teacher and "megatron_rl.launch.cli teacher --config" in teacher
    assert "CUDA_VISIBLE_DEVICES=6,5" in teacher and "CUDA_DEVICE_MAX_CONNECTIONS=1" in teacher  # tp 2 on cuda
    assert "service=9400" in teacher
    resolved = parse_config(run_config(tmp_path, tiny_models["qwen3"], teacher={"megatron": {"tp": 2}}))
    assert training_env(resolved, "teacher") == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}


def test_the_slurm_job_places_and_starts_the_megatron_teacher(tmp_path, tiny_models):

    from megatron_rl.launch.job_steps import _service
    from megatron_rl.launch.slurm import SlurmError, gpu_use_per_node, place, render

    model = tiny_models["qwen3"]
    resolved = parse_config(run_config(tmp_path, model, teacher={"megatron": {"tp": 2, "gpus": 4}}, policy_gpus=3))  # fmt: skip
    placement = place(resolved)
    teacher = placement["teacher"]
    assert (teacher.name, teacher.nodes, teacher.gpus_per_node) == ("teacher", [0], 4)
    assert gpu_use_per_node(placement) == [{"inference_0": 1, "teacher": 4, "policy": 3}]
    text = checked_script(tmp_path / "job.sbatch", render(resolved, tmp_path / "run.yaml"))
    assert '--set distillation.teacher.megatron.host="${ADDRS[0]}"' in text
    assert "read -r POLICY_PORT TEACHER_PORT < <(probe 0 2)" in text  # one node: probed together
    assert 'torchrun_step teacher "${NODES[0]}" 1 4 0 "$TEACHER_PORT" teacher' in text
    assert "--service teacher" not in text  # no vLLM server or router for it
    assert text.index("torchrun_step teacher") < text.index("torchrun_step policy")
    with pytest.raises(SystemExit, match="its teacher is the Megatron service"):
        _service(resolved, "teacher")
    # over one node: whole nodes, a multiple of gpus_per_node
    big = parse_config(run_config(tmp_path, model, teacher={"megatron": {"tp": 2, "gpus": 16}}, nodes=3,
                                  policy_gpus=7))  # fmt: skip
    placed = place(big)
    assert (placed["teacher"].nodes, placed["teacher"].gpus_per_node) == ([1, 2], 8)
    odd = parse_config(run_config(tmp_path, model, teacher={"megatron": {"tp": 2, "gpus": 10}}, nodes=3,
                                  policy_gpus=7))  # fmt: skip
    with pytest.raises(SlurmError, match=r"distillation.teacher.megatron.gpus \(10\): a teacher over more than one"):
        place(odd)


def test_preflight_knows_the_teachers_port_group_and_layer_step(tmp_path, tiny_models):
    from megatron_rl.launch.preflight import Context
    from megatron_rl.launch.preflight.host_checks import listening_ports
    from megatron_rl.launch.preflight.rank_checks import _roles

    resolved = parse_config(run_config(tmp_path, tiny_models["qwen3"], teacher={"megatron": {"tp": 2, "port": 9400}}))
    context = Context(resolved, "gloo")
    assert listening_ports(context)["distillation.teacher.megatron.port"] == ("127.0.0.1", 9400)
    assert [(role, layout.tp) for role, layout in _roles(context)] == [("policy", 1), ("teacher", 2)]
