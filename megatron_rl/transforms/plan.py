"""A role's model transforms, decided from its config and the layout's plans: the only place outside
config/ that reads the LoRA and routing-replay settings (`lora`, `value.lora`,
`algorithm.routing_replay`, through the layout where it derived them), and the checks a
checkpoint's saved transforms get at a resume."""

from __future__ import annotations

from pathlib import Path

from megatron_rl.config import ResolvedConfig
from megatron_rl.transforms.base import ModelTransform
from megatron_rl.transforms.lora_base import base_identity
from megatron_rl.transforms.lora_transform import LoraTransform, refuse_without_lora
from megatron_rl.transforms.routing import RoutingReplay

# Transforms whose checkpoint entry (meta.json) a run without them cannot resume: name -> refusal.
REFUSED_WITHOUT = {LoraTransform.name: refuse_without_lora}


def role_transforms(resolved: ResolvedConfig, role: str) -> list[ModelTransform]:
    """The policy's: LoRA (`lora`; A from the policy's seed) and routing replay
    (`algorithm.routing_replay` measure or replay). The critic's: LoRA (`value.lora`; A from
    `orchestrator.seed`). A LoRA transform's base identity (path and fingerprint, or the role's
    seed for a random base) is taken here, once, at the trainer's construction."""
    layout = resolved.layout
    if role == "policy":
        transforms: list[ModelTransform] = []
        if layout.policy_lora is not None:
            base = base_identity(resolved.model.checkpoint, "model.checkpoint", layout.policy_seed)
            transforms.append(LoraTransform(layout.policy_lora, layout.policy_seed, base))
        if resolved.algorithm.routing_replay != "off":
            arch = layout.policy_architecture
            transforms.append(RoutingReplay(resolved.algorithm.routing_replay, arch.num_layers, arch.num_experts_per_tok))
        return transforms
    if role == "critic":
        if layout.critic_lora is None:
            return []
        base = base_identity(resolved.value.model.checkpoint, "value.model.checkpoint", layout.critic_seed)
        return [LoraTransform(layout.critic_lora, resolved.orchestrator.seed, base)]
    raise ValueError(f"role {role!r}: expected 'policy' or 'critic'")


def check_saved_transforms(meta: dict, transforms: list[ModelTransform], path: Path) -> None:
    """Before a checkpoint is read: each of the run's transforms checks its saved entry, and an
    entry of a transform the run lacks (a LoRA checkpoint, in a run without LoRA) is refused."""
    names = {transform.name for transform in transforms}
    for name, refuse in REFUSED_WITHOUT.items():
        if meta.get(name) is not None and name not in names:
            refuse(meta[name], path)
    for transform in transforms:
        transform.check_checkpoint(meta.get(transform.name), path)


def build_options(transforms: list[ModelTransform]) -> dict:
    """The model builder's keyword arguments every transform asks for."""
    options: dict = {}
    for transform in transforms:
        options.update(transform.build_options())
    return options
