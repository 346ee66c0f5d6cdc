"""Reading a config: YAML -> validated sections -> every rule -> the derived layout -> the
memory plan. `load_config` for a user's YAML (with `KEY=VALUE` overrides), `load_resolved` for
the JSON the launcher writes (read back as is, nothing derived again)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from megatron_rl.config.base import ConfigError
from megatron_rl.config.layout import (
    Layout,
    ResolvedConfig,
    fixed_ports,
    inference_urls,
    lora_plan,
    model_layout,
    read_architecture,
    run_paths,
    value_gpus,
)
from megatron_rl.config.memory_plan import check_fits, memory_plan
from megatron_rl.config.parts import builtin_parts
from megatron_rl.config.run import Config
from megatron_rl.config.services import service_layouts
from megatron_rl.config.validators import RULES, Context


def resolve(config: Config, base_dir: Path = Path("."), source: str = "<config>") -> ResolvedConfig:
    """Runs every rule and derives the layout; raises ConfigError listing every problem."""
    errors: list[str] = []
    policy_arch = read_architecture(config.model, "model", base_dir, errors)
    critic_arch = read_architecture(config.value.model, "value.model", base_dir, errors) if config.value else None
    critic_gpus, style = value_gpus(config, errors)
    context = Context(config, policy_arch, critic_arch, critic_gpus, builtin_parts())
    for rule in RULES:
        errors += rule(context)
    device = config.deployment.device
    policy_layout = model_layout(config.model, policy_arch, config.deployment.policy_gpus, "model", errors, device)
    critic_layout = None
    if config.value is not None and critic_gpus:
        critic_layout = model_layout(config.value.model, critic_arch, critic_gpus, "value.model", errors, device)
    ports, inference_ports = fixed_ports(config, errors)
    urls = inference_urls(config, inference_ports, errors)
    policy_lora = lora_plan(config.lora, "lora", policy_arch, config.inference.backend, errors)
    critic_lora = lora_plan(config.value.lora if config.value else None, "value.lora", critic_arch, None, errors)
    services = service_layouts(config, base_dir, errors)
    if errors:
        raise ConfigError(source, errors)
    data = config.model_dump()
    if data["inference"]["weight_update"] == "safetensors" and not data["inference"]["publish_dir"]:
        # Path (a) needs a directory: without one the policy would publish nothing.
        data["inference"]["publish_dir"] = str(Path(data["checkpoint"]["dir"]) / "published")
    # Every process reads the resolved file from its own working directory: the model files a
    # config names (HF config, weights, the servers' HF directory) are relative to its file.
    def absolute(path: str | None) -> str | None:
        return str((base_dir / path).resolve()) if path and not Path(path).is_absolute() else path

    for section in (data["model"], data["value"]["model"] if data["value"] else None):
        if section:
            section["hf_config"], section["checkpoint"] = absolute(section["hf_config"]), absolute(section["checkpoint"])
    data["inference"]["model_dir"] = absolute(data["inference"]["model_dir"])
    if data["distillation"]:
        data["distillation"]["teacher"]["model_dir"] = absolute(data["distillation"]["teacher"]["model_dir"])
    if data["orchestrator"]["judge"]:
        data["orchestrator"]["judge"]["model_dir"] = absolute(data["orchestrator"]["judge"]["model_dir"])
    template = data["orchestrator"]["chat_template"]
    if isinstance(template, str):  # a template file, like the model files relative to the config
        data["orchestrator"]["chat_template"] = template = absolute(template)
        if not Path(template).is_file():
            raise ConfigError(source, [f"orchestrator.chat_template: no template file {template}"])
    layout = Layout(
        policy=policy_layout,
        critic=critic_layout,
        value_gpus=critic_gpus,
        deployment_style=style,
        inference_ports=inference_ports,
        inference_urls=urls,
        ports=ports,
        policy_architecture=policy_arch,
        critic_architecture=critic_arch,
        paths=run_paths(config),
        weight_broadcast_host=config.inference.weight_broadcast_host or "127.0.0.1",
        policy_seed=config.orchestrator.seed,
        critic_seed=config.orchestrator.seed + 1,
        policy_lora=policy_lora,
        critic_lora=critic_lora,
        sampler_routes=config.algorithm.routing_replay != "off",
        services=services,
    )
    resolved = ResolvedConfig(**data, layout=layout)
    errors = check_fits(resolved, memory_plan(resolved))
    if errors:
        raise ConfigError(source, errors)
    return resolved


def _format_validation_error(exc: ValidationError) -> list[str]:
    lines = []
    for err in exc.errors():
        path = ".".join(str(p) for p in err["loc"]) or "<top>"
        message = err["msg"]
        if err["type"] == "extra_forbidden":
            message = "unknown key"
        elif err["type"] == "missing":
            message = "required key is missing"
        lines.append(f"{path}: {message}")
    return lines


def parse_config(data: Any, source: str = "<config>", base_dir: Path = Path(".")) -> ResolvedConfig:
    """Validates a dict (already loaded from YAML) and resolves it."""
    if not isinstance(data, dict):
        raise ConfigError(source, [f"<top>: expected a mapping of sections, got {type(data).__name__}"])
    try:
        config = Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(source, _format_validation_error(exc)) from None
    return resolve(config, base_dir=base_dir, source=source)


def apply_overrides(data: dict, assignments: list[str]) -> dict:
    """`a.b.c=VALUE` (VALUE read as YAML: numbers, lists, strings) into a copy of `data`."""
    data = copy.deepcopy(data)
    for assignment in assignments:
        key, sep, raw = assignment.partition("=")
        if not sep or not key:
            raise ConfigError("--set", [f"{assignment!r}: expected KEY=VALUE (e.g. transport.host=10.0.0.5)"])
        node = data
        *parents, last = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError("--set", [f"{key}: {part} is not a section"])
        try:
            node[last] = yaml.safe_load(raw)
        except yaml.YAMLError as exc:
            raise ConfigError("--set", [f"{key}: value {raw!r} is not valid YAML ({exc})"]) from None
    return data


def load_config(path: str | Path, overrides: list[str] = ()) -> ResolvedConfig:
    """Reads a user's YAML config, with `KEY=VALUE` overrides. Relative paths of model files
    (`hf_config`, `checkpoint` of each model, `inference.model_dir`, a chat template file
    `orchestrator.chat_template`) are relative to the file's
    directory; run outputs (`checkpoint.dir`, `logging.dir`, `inference.publish_dir`) and
    datasets to the working directory the run starts in."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(str(path), ["file not found"])
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(str(path), [f"not valid YAML: {exc}"]) from None
    if overrides:
        data = apply_overrides(data if isinstance(data, dict) else {}, list(overrides))
    return parse_config(data, source=str(path), base_dir=path.parent)


def load_resolved(path: str | Path) -> ResolvedConfig:
    """Reads the resolved JSON written by the launcher (no re-derivation)."""
    path = Path(path)
    try:
        return ResolvedConfig.model_validate_json(path.read_text())
    except (OSError, ValidationError) as exc:
        raise ConfigError(str(path), [f"not a resolved config: {exc}"]) from None
