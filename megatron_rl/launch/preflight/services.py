"""Preflight of the models beside the policy: a distillation teacher and an LLM judge.

- one the user serves (`url`): it answers `GET /v1/models` with the configured model name (with
  its API key), the teacher's tokenizer (`distillation.teacher.model_dir`) is the student's;
- one the run serves (config/services.py): its `model_dir` holds a config and a tokenizer that
  load, the teacher's tokenizer is the student's (inference/teacher.py `check_same_tokenizer`,
  the orchestrator's start-up check, run before the job), and on a one-node CUDA deployment the
  GPUs visible cover every role's, the served models' included (`gpu_totals`; the memory check
  judges each GPU's free memory against the served models' plan as against every role's).
"""

from __future__ import annotations

import os

from megatron_rl.config.memory_plan import gpu_totals
from megatron_rl.inference.pool import served_model_dir
from megatron_rl.inference.teacher import check_same_tokenizer
from megatron_rl.inference.vllm_control import VllmControl, VllmControlError
from megatron_rl.launch.preflight.base import CheckFailed, Context, NotRun


def external_models(context: Context) -> dict[str, tuple[str, str, str | None]]:
    """name -> (config key, url, model name) of a teacher and a judge the user serves."""
    resolved, out = context.resolved, {}
    if resolved.distillation is not None and resolved.distillation.teacher.url is not None:
        teacher = resolved.distillation.teacher
        out["teacher"] = ("distillation.teacher", teacher.url, teacher.served_model_name)
    judge = resolved.orchestrator.judge
    if judge is not None and judge.url is not None:
        out["judge"] = ("orchestrator.judge", judge.url, judge.model)
    return out


def _api_key(context: Context, name: str) -> str | None:
    resolved = context.resolved
    return (resolved.distillation.teacher if name == "teacher" else resolved.orchestrator.judge).api_key()


def _visible_gpus() -> int:
    import torch

    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    return len([d for d in listed.split(",") if d.strip()]) if listed is not None else torch.cuda.device_count()


def check_served_models(context: Context) -> str:
    from transformers import AutoConfig

    from megatron_rl.models.tokenizer import load_tokenizer

    resolved = context.resolved
    external, served = external_models(context), resolved.layout.services
    if not external and not served:
        raise NotRun("no teacher and no judge in the config")
    problems, figures = [], []
    for name, (key, url, model) in external.items():
        try:
            models = VllmControl(url, api_key=_api_key(context, name)).models(timeout_s=10)
        except VllmControlError as exc:
            problems.append(f"{key}.url {url} does not answer /v1/models: {exc}")
            continue
        if model not in models:
            problems.append(f"{key}.url {url} serves {models}, not {model!r}")
        else:
            figures.append(f"{name} at {url} serves {model!r}")
    student = None
    for name, service in served.items():
        try:
            AutoConfig.from_pretrained(service.model_dir)
            load_tokenizer(service.model_dir, resolved.model.trust_remote_code)
        except (OSError, ValueError) as exc:
            problems.append(f"{service.key}.model_dir {service.model_dir}: does not load ({type(exc).__name__}: {exc})")
            continue
        figures.append(f"{name} served from {service.model_dir} on {service.gpus} GPU(s)")
    if resolved.distillation is not None:  # the teacher's token ids must be the student's, served or not
        teacher_dir = resolved.distillation.teacher.model_dir
        try:
            student = load_tokenizer(served_model_dir(resolved), resolved.model.trust_remote_code)
            check_same_tokenizer(student, load_tokenizer(teacher_dir, resolved.model.trust_remote_code), teacher_dir)
            figures.append("the teacher's tokenizer is the student's")
        except (OSError, ValueError) as exc:
            problems.append(str(exc))
    if served and context.cuda and resolved.deployment.nodes == 1:
        totals, visible = gpu_totals(resolved), _visible_gpus()
        if visible < sum(totals.values()):
            problems.append(f"{visible} GPUs visible, the run needs {sum(totals.values())} ("
                            + ", ".join(f"{role} {gpus}" for role, gpus in totals.items()) + ")")  # fmt: skip
    if problems:
        raise CheckFailed("; ".join(problems))
    return "; ".join(figures)
