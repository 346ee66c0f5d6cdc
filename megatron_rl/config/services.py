"""Models the run serves beside the policy: a distillation teacher (`distillation.teacher`
without `url`) and an LLM judge (`orchestrator.judge` without `url`).

Each is vLLM servers plus a vllm-router of its own, on GPUs of its own (`serve.num_servers` x
`serve.tp`), started by `megatron-rl run` and the SLURM job as the policy's inference servers
are; or, for a teacher with `megatron`, the run's forward-only Megatron teacher service
(megatron_rl/teacher/: one torchrun group of `megatron.gpus` ranks on its own layout, its
service on `megatron.host:megatron.port`; `ServiceLayout.kind` "megatron", its parallel layout
in `ServiceLayout.megatron`). `served_models(config)` names the vLLM-served ones and their
sections; `service_layouts` derives what every process reads from the layout instead (ports,
addresses, the URL the orchestrator sends to, the model's architecture for the memory plan,
vLLM's max_model_len). A teacher or judge at a `url` the user gives is not served: no GPUs, no
ports of the run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from megatron_rl.config.base import Strict
from megatron_rl.config.inference import ServeConfig
from megatron_rl.config.model import Architecture
from megatron_rl.config.model_layout import ModelLayout, model_layout
from megatron_rl.config.run import Config

SERVICES = ("teacher", "judge")  # in start and placement order, after the policy's servers


class ServiceLayout(Strict):
    """A served model (teacher or judge), resolved: what the launcher starts and the
    orchestrator reaches."""

    key: str  # its config section: distillation.teacher, orchestrator.judge
    kind: Literal["vllm", "megatron"] = "vllm"  # megatron: the teacher's Megatron service (one "server")
    model_dir: str  # absolute
    served_model_name: str
    num_servers: int
    tp: int
    gpus: int  # num_servers x tp
    ports: list[int]  # server i: serve.base_port + i
    server_urls: list[str]  # http://HOST:PORT of each server
    url: str  # the router's: http://serve.host:serve.router_port
    max_model_len: int  # megatron: the longest sequence it scores (model.seq_len)
    architecture: Architecture
    megatron: ModelLayout | None = None  # kind megatron: its ranks' parallel layout (gpus = world_size)

    @property
    def is_vllm(self) -> bool:
        return self.kind == "vllm"


MEGATRON_TEACHER_KEY = "distillation.teacher.megatron"


def vllm_services(services: dict[str, ServiceLayout]) -> dict[str, ServiceLayout]:
    """The served models that are vLLM servers behind a router of their own (not the Megatron teacher)."""
    return {name: service for name, service in services.items() if service.is_vllm}


def megatron_service(services: dict[str, ServiceLayout]) -> ServiceLayout | None:
    """The Megatron teacher's layout among the served models, or None."""
    return next((service for service in services.values() if not service.is_vllm), None)


def megatron_teacher(config: Config):
    """The `distillation.teacher.megatron` block, or None (no distillation, or a vLLM teacher)."""
    return config.distillation.teacher.megatron if config.distillation is not None else None


def served_models(config: Config) -> dict[str, tuple[str, ServeConfig, str | None, str]]:
    """name -> (config key, its serve block, its model_dir, its served model name) for each
    model the run serves (teacher, judge, in SERVICES order)."""
    out = {}
    if config.distillation is not None and config.distillation.teacher.serve is not None:
        teacher = config.distillation.teacher
        out["teacher"] = ("distillation.teacher", teacher.serve, teacher.model_dir, teacher.served_model_name)
    judge = config.orchestrator.judge
    if judge is not None and judge.serve is not None:
        out["judge"] = ("orchestrator.judge", judge.serve, judge.model_dir, judge.model)
    return out


def served_gpus(config: Config) -> dict[str, int]:
    """GPUs of each served model: num_servers x tp (vLLM), megatron.gpus (a Megatron teacher)."""
    out = {name: serve.num_servers * serve.tp for name, (_, serve, _, _) in served_models(config).items()}
    megatron = megatron_teacher(config)
    if megatron is not None:
        out["teacher"] = megatron.world_size()
    return {name: out[name] for name in SERVICES if name in out}


def service_ports(config: Config) -> dict[str, int]:
    """Every port the served models listen on, by the key that sets it."""
    ports = {}
    for key, serve, _, _ in served_models(config).values():
        ports[f"{key}.serve.router_port"] = serve.router_port
        for i in range(serve.num_servers):
            ports[f"{key}.serve.base_port+{i}"] = serve.base_port + i
    megatron = megatron_teacher(config)
    if megatron is not None:
        ports[f"{MEGATRON_TEACHER_KEY}.port"] = megatron.port
    return ports


def _architecture(key: str, model_dir: Path, errors: list[str]) -> Architecture | None:
    path = model_dir / "config.json"
    if not path.is_file():
        errors.append(f"{key}.model_dir: no config.json in {model_dir} (the run serves this model from it)")
        return None
    try:
        return Architecture.from_hf_config(json.loads(path.read_text()), str(path))
    except (ValueError, KeyError) as exc:
        errors.append(f"{key}.model_dir: {path}: {exc}")
        return None


def _model_dir(model_dir: str, base_dir: Path) -> Path:
    directory = Path(model_dir)
    return directory if directory.is_absolute() else (base_dir / directory).resolve()


def megatron_teacher_layout(config: Config, base_dir: Path, errors: list[str]) -> ServiceLayout | None:
    """The Megatron teacher's layout (None without one, or on a problem, which goes to `errors`):
    its ranks' parallel layout from `megatron` at the student's `model.seq_len`, checked as the
    critic's is (divisibility of heads, layers, experts by its degrees)."""
    megatron = megatron_teacher(config)
    if megatron is None:
        return None
    teacher = config.distillation.teacher
    directory = _model_dir(teacher.model_dir, base_dir)
    arch = _architecture("distillation.teacher", directory, errors)
    if arch is None:
        return None
    seq_len = config.model.seq_len
    if seq_len > arch.max_position_embeddings:
        errors.append(f"{MEGATRON_TEACHER_KEY}: the run sends the teacher samples of up to model.seq_len = {seq_len} "
                      f"tokens, more than its max_position_embeddings ({arch.max_position_embeddings})")  # fmt: skip
    model = megatron.as_model_config(str(directory), seq_len)
    layout = model_layout(model, arch, megatron.world_size(), MEGATRON_TEACHER_KEY, errors, config.deployment.device)
    if layout is None:
        return None
    url = f"http://{megatron.host}:{megatron.port}"
    return ServiceLayout(
        key="distillation.teacher", kind="megatron", model_dir=str(directory), served_model_name=teacher.served_model_name,
        num_servers=1, tp=megatron.tp, gpus=layout.world_size, ports=[megatron.port], server_urls=[url], url=url,
        max_model_len=seq_len, architecture=arch, megatron=layout,
    )  # fmt: skip


def service_layouts(config: Config, base_dir: Path, errors: list[str]) -> dict[str, ServiceLayout]:
    """The layout of every served model; one line in `errors` per problem."""
    out = {}
    teacher = megatron_teacher_layout(config, base_dir, errors)
    if teacher is not None:
        out["teacher"] = teacher
    for name, (key, serve, model_dir, served_name) in served_models(config).items():
        directory = _model_dir(model_dir, base_dir)
        arch = _architecture(key, directory, errors)
        if arch is None:
            continue
        hosts = serve.server_hosts or [serve.host] * serve.num_servers
        if len(hosts) != serve.num_servers:
            errors.append(f"{key}.serve.server_hosts has {len(hosts)} addresses for serve.num_servers = "
                          f"{serve.num_servers} servers")  # fmt: skip
            continue
        if arch.num_key_value_heads % serve.tp and serve.tp % arch.num_key_value_heads:
            errors.append(f"{key}.serve.tp ({serve.tp}): vLLM splits the model's {arch.num_key_value_heads} KV heads "
                          "over tp: one must divide the other")  # fmt: skip
        if serve.max_model_len is not None:
            longest = serve.max_model_len
        elif name == "teacher":  # a whole sample as the prompt, plus the one token vLLM generates
            longest = config.model.seq_len + 1
        else:
            longest = arch.max_position_embeddings
        if longest > arch.max_position_embeddings:
            errors.append(
                f"{key}.serve.max_model_len: the run sends sequences of up to {longest} tokens"
                + (" (model.seq_len + 1)" if serve.max_model_len is None else "")
                + f", more than the model's max_position_embeddings ({arch.max_position_embeddings})"
            )
        ports = [serve.base_port + i for i in range(serve.num_servers)]
        out[name] = ServiceLayout(
            key=key, model_dir=str(directory), served_model_name=served_name, num_servers=serve.num_servers,
            tp=serve.tp, gpus=serve.num_servers * serve.tp, ports=ports,
            server_urls=[f"http://{host}:{port}" for host, port in zip(hosts, ports, strict=True)],
            url=f"http://{serve.host}:{serve.router_port}", max_model_len=longest, architecture=arch,
        )  # fmt: skip
    return {name: out[name] for name in SERVICES if name in out}


def service_serve(config: Config, name: str) -> ServeConfig:
    """The serve block of served model `name` (SERVICES)."""
    return served_models(config)[name][1]
