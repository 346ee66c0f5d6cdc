"""The derived layout: what every process reads instead of computing it again.

`derive_layout` turns a validated `Config` into a `Layout`: each model's parallel layout (DP
sizes), the critic's GPU count and deployment style, inference ports and URLs, every fixed port
by its key, both architectures, the checkpoint / snapshot / publish directories and the seeds.
Each derivation that can fail appends one line per problem to `errors` (all problems are
reported at once by `load.resolve`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Literal

from megatron_rl.config.base import Strict
from megatron_rl.config.model import (
    Architecture,
    LoraBase,
    ModelConfig,
    adapts_experts,
    latent_attention_serving_refusal,
    lora_refusal,
    lora_serving,
    lora_targets,
    vllm_max_lora_rank,
)
from megatron_rl.config.model_layout import ModelLayout, latent_attention_local_spec_problems, model_layout
from megatron_rl.config.run import Config
from megatron_rl.config.services import ServiceLayout, service_ports

# defined in model_layout.py (services.py reads them too), imported from here
__all__ = ["ModelLayout", "latent_attention_local_spec_problems", "model_layout"]


class LoraPlan(Strict):
    """A LoRA role's settings, decided once from its section (`lora`, `value.lora`): what its model
    wraps and, for the policy, how each version reaches inference. Everything outside config/
    reads these instead of the section."""

    key: Literal["lora", "value.lora"]
    rank: int
    alpha: float
    target_modules: list[str]
    # The adapters wrap an MoE model's experts: the model is built with one linear per expert
    # (megatron's SequentialMLP, `moe_grouped_gemm` off): TE's grouped GEMM has no weight to wrap.
    adapts_experts: bool
    serve: Literal["adapter", "merged"] | None = None  # the policy's versions: adapters alone or merged
    serve_reason: str = ""  # why (`lora.serve` and what the inference backend can serve)
    vllm_max_lora_rank: int | None = None  # serve adapter: the servers' --max-lora-rank


def lora_plan(lora: LoraBase | None, key: str, arch: Architecture | None, backend: str | None,
              errors: list[str]) -> LoraPlan | None:  # fmt: skip
    """The plan of a LoRA section (None without it); `backend` (the policy's inference backend)
    decides how versions are served, None for the critic. A section that leaves target_modules
    unset gets the model's linears written into it (`model_lora_targets`: a multi-latent attention
    model's differ from the default), so that the resolved config names what is adapted."""
    if lora is None:
        return None
    refusal = lora_refusal(lora, arch, key)
    if refusal:
        errors.append(refusal)
    targets = lora_targets(lora, arch)
    if targets != lora.target_modules:
        lora.target_modules = targets
    plan = LoraPlan(key=key, rank=lora.rank, alpha=lora.alpha, target_modules=targets,
                    adapts_experts=adapts_experts(lora, arch))  # fmt: skip
    if backend is not None:
        if latent_attention_serving_refusal(lora, arch):
            errors.append(latent_attention_serving_refusal(lora, arch))
        plan.serve, plan.serve_reason = lora_serving(lora, arch, backend)
        if plan.serve == "adapter":
            try:
                plan.vllm_max_lora_rank = vllm_max_lora_rank(lora.rank)
            except ValueError as exc:
                errors.append(f"{exc}: set lora.serve: merged, or a smaller lora.rank")
    return plan


class RunPaths(Strict):
    """Directories derived from `checkpoint.dir` (absolute when the config's were)."""

    policy_checkpoints: str  # <checkpoint.dir>/policy
    critic_checkpoints: str  # <checkpoint.dir>/critic
    policy_snapshots: str  # value.snapshot.dir, default <checkpoint.dir>/policy_snapshots
    orchestrator_state: str  # <checkpoint.dir>/orchestrator/state.json


class Layout(Strict):
    policy: ModelLayout
    critic: ModelLayout | None
    value_gpus: int
    deployment_style: Literal["shared", "dedicated", "none"]
    inference_ports: list[int]
    inference_urls: list[str]  # http://HOST:PORT of each inference server
    ports: dict[str, int]  # every fixed port by the config key that sets it
    policy_architecture: Architecture
    critic_architecture: Architecture | None
    paths: RunPaths
    # Where inference workers reach policy rank 0 for path (b) weight broadcasts:
    # inference.weight_broadcast_host, default 127.0.0.1 (one node; a SLURM job sets it).
    weight_broadcast_host: str
    policy_seed: int  # orchestrator.seed
    critic_seed: int  # orchestrator.seed + 1: the critic's own dropout / init streams
    policy_lora: LoraPlan | None = None  # `lora`
    critic_lora: LoraPlan | None = None  # `value.lora`
    # The samples carry the sampler's routes (`algorithm.routing_replay` on): vLLM returns them,
    # the grids carry them, the memory plan counts them.
    sampler_routes: bool = False
    # The models the run serves beside the policy, by name (config/services.py: teacher, judge):
    # their servers, router URL, GPUs and architecture.
    services: dict[str, ServiceLayout] = {}


def read_architecture(model: ModelConfig, where: str, base_dir: Path, errors: list[str]) -> Architecture | None:
    if model.architecture is not None:
        return model.architecture
    directory = Path(model.hf_config)
    if not directory.is_absolute():
        directory = base_dir / directory
    path = directory / "config.json"
    if not path.is_file():
        errors.append(f"{where}.hf_config: no config.json in {directory}")
        return None
    try:
        return Architecture.from_hf_config(json.loads(path.read_text()), str(path))
    except (ValueError, KeyError) as exc:
        errors.append(f"{where}.hf_config: {path}: {exc}")
        return None


def value_gpus(config: Config, errors: list[str]) -> tuple[int, str]:
    """The critic's GPU count and deployment style (dedicated nodes, shared nodes, none)."""
    deployment = config.deployment
    dedicated, shared = deployment.num_value_nodes, deployment.num_value_gpus_per_train_node
    if config.value is None:
        if dedicated or shared:
            errors.append(
                "deployment: num_value_nodes / num_value_gpus_per_train_node are set but there is no value section"
            )
        return 0, "none"
    if dedicated and shared:
        errors.append(
            "deployment: set num_value_nodes (dedicated) or num_value_gpus_per_train_node (shared), not both"
        )
        return 0, "none"
    if dedicated:
        return dedicated * deployment.gpus_per_node, "dedicated"
    if not shared:
        errors.append(
            "deployment: the value section needs critic GPUs: set num_value_nodes or num_value_gpus_per_train_node"
        )
        return 0, "none"
    if shared >= deployment.gpus_per_node:
        errors.append(
            f"deployment.num_value_gpus_per_train_node ({shared}) must be less than gpus_per_node ({deployment.gpus_per_node})"
        )
        return 0, "none"
    train_nodes = math.ceil(deployment.policy_gpus / (deployment.gpus_per_node - shared))
    return train_nodes * shared, "shared"


def inference_urls(config: Config, ports: list[int], errors: list[str]) -> list[str]:
    hosts = config.inference.server_hosts or [config.inference.host] * len(ports)
    if len(hosts) != len(ports):
        errors.append(
            f"inference.server_hosts has {len(hosts)} addresses for inference.num_servers = {len(ports)} servers"
        )
        return []
    return [f"http://{host}:{port}" for host, port in zip(hosts, ports, strict=True)]


def fixed_ports(config: Config, errors: list[str]) -> tuple[dict[str, int], list[int]]:
    """Every fixed port by the key that sets it (all must differ), and the inference ports."""
    inference_ports = [config.inference.base_port + i for i in range(config.inference.num_servers)]
    ports = {
        "transport.policy_port": config.transport.policy_port,
        "transport.critic_port": config.transport.critic_port,
        "inference.weight_broadcast_port": config.inference.weight_broadcast_port,
        "inference.router_port": config.inference.router_port,
    }
    if config.value is None:
        del ports["transport.critic_port"]
    else:
        ports["value.service.port"] = config.value.service.port
    for i, port in enumerate(inference_ports):
        ports[f"inference.base_port+{i}"] = port
    ports.update(service_ports(config))  # a served teacher's and judge's servers and routers
    seen: dict[int, str] = {}
    for key, port in ports.items():
        if port in seen:
            errors.append(
                f"{key}: port {port} is already used by {seen[port]}; all configured ports must be distinct"
            )
        else:
            seen[port] = key
    return ports, inference_ports


def run_paths(config: Config) -> RunPaths:
    root = Path(config.checkpoint.dir)
    snapshot = config.value.snapshot if config.value is not None else None
    return RunPaths(
        policy_checkpoints=str(root / "policy"),
        critic_checkpoints=str(root / "critic"),
        policy_snapshots=snapshot.dir if snapshot is not None and snapshot.dir else str(root / "policy_snapshots"),
        orchestrator_state=str(root / "orchestrator" / "state.json"),
    )


class ResolvedConfig(Config):
    """A config with its derived layout: what the launcher writes for every process."""

    layout: Layout

    def to_json(self) -> str:
        return self.model_dump_json(indent=2)
