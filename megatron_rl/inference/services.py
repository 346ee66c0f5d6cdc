"""The vLLM servers and the router of a model the run serves beside the policy (a distillation
teacher, an LLM judge; config/services.py), built as the policy's are (`InferencePool.from_config`,
`router_settings`) from the resolved layout (`layout.services[name]`) and its `serve` block.
The local launcher runs them as components, the SLURM job as steps; neither takes weight
updates (their weights never change). A teacher of distillation.mode top_k_kl is started with
vLLM's `--max-logprobs` distillation.top_k (vLLM refuses prompt_logprobs above it; default 20)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from megatron_rl.config import ResolvedConfig
from megatron_rl.config.services import served_models
from megatron_rl.inference.pool import router_settings
from megatron_rl.inference.router import RouterSettings
from megatron_rl.inference.vllm_server import VllmServer


def service_api_key(resolved: ResolvedConfig, name: str) -> str | None:
    """The API key the served model's servers and router take (its section's api_key_env)."""
    section = resolved.distillation.teacher if name == "teacher" else resolved.orchestrator.judge
    return section.api_key()


def service_servers(resolved: ResolvedConfig, name: str, devices: list[list[str]], log_dir: str | Path) -> list[VllmServer]:
    """The (unstarted) servers of served model `name`: one per entry of `devices` (each a list of
    its serve.tp device ids), logs `NAME_{i}.log` in `log_dir`."""
    from megatron_rl.models.tokenizer import vllm_remote_code_args  # transformers: not for every importer

    service = resolved.layout.services[name]
    serve = served_models(resolved)[name][1]
    if len(devices) != service.num_servers:
        raise ValueError(f"{service.key}.serve.num_servers is {service.num_servers} but {len(devices)} device sets were given")
    api_key = service_api_key(resolved, name)
    servers = []
    for i, (url, port, devs) in enumerate(zip(service.server_urls, service.ports, devices, strict=True)):
        if len(devs) != service.tp:
            raise ValueError(f"{name} server {i}: {len(devs)} devices {devs} for {service.key}.serve.tp = {service.tp}")
        host = url.removeprefix("http://").rsplit(":", 1)[0]
        servers.append(
            VllmServer(
                service.model_dir, port, Path(log_dir) / f"{name}_{i}.log", host=host, devices=list(devs),
                name=f"{name} server {i} ({url})", device="cpu" if resolved.deployment.device == "cpu" else "cuda",
                served_model_name=service.served_model_name, tp=service.tp, max_model_len=service.max_model_len,
                gpu_memory_utilization=serve.gpu_memory_utilization, kv_cache_gib=serve.cpu_kv_cache_gib,
                shutdown_timeout_s=resolved.inference.shutdown_timeout_s, seed=resolved.orchestrator.seed,
                http_log_level=resolved.logging.inference_level, api_key=api_key,
                extra_args=[*vllm_remote_code_args(resolved.model), *service_vllm_args(resolved, name), *serve.extra_args],
                launch=False,
            )  # fmt: skip
        )
    return servers


def service_vllm_args(resolved: ResolvedConfig, name: str) -> list[str]:
    """The vLLM arguments served model `name` needs for the run: a teacher of distillation.mode
    top_k_kl `--max-logprobs` distillation.top_k (the top k it returns a position); ValueError
    when the serve block's extra_args set a lower --max-logprobs (vLLM takes the last one)."""
    distillation = resolved.distillation
    if name != "teacher" or distillation is None or distillation.mode != "top_k_kl":
        return []
    extra = served_models(resolved)[name][1].extra_args
    for i, arg in enumerate(extra):
        value = arg.split("=", 1)[1] if arg.startswith("--max-logprobs=") else None
        if arg == "--max-logprobs" and i + 1 < len(extra):
            value = extra[i + 1]
        limit = int(value) if value is not None and value.strip().lstrip("-").isdigit() else None
        if limit is not None and limit != -1 and limit < distillation.top_k:  # -1: the whole vocabulary
            raise ValueError(
                f"distillation.teacher.serve.extra_args sets --max-logprobs {value}, below distillation.top_k "
                f"({distillation.top_k}): vLLM would refuse the teacher's top {distillation.top_k}; remove it or raise it"
            )
    return ["--max-logprobs", str(distillation.top_k)]


def service_router_settings(resolved: ResolvedConfig, name: str) -> RouterSettings:
    """The policy router's settings (timeouts, queue sized from the batches in flight), with the
    served model's API key."""
    return dataclasses.replace(router_settings(resolved), api_key=service_api_key(resolved, name))
