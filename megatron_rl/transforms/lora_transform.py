"""LoRA as a model transform (transforms/base.py): what a LoRA role's model, checkpoints and KL
reference are, from the layout's plan (`config/layout.LoraPlan`).

- the model is built with one linear per MoE expert when the adapters wrap experts;
- `apply` wraps the target linears (transforms/lora.py) after the initial weights are loaded and
  before DDP and the optimizer exist, so the frozen base gets neither gradient buffers nor
  optimizer state;
- checkpoints keep the adapters (and a critic's value head) and meta.json's `lora` names the base
  (transforms/lora_base.py); a resume refuses another base or other settings, and a run without
  LoRA refuses a LoRA checkpoint (`refuse_without_lora`);
- the frozen reference is the model itself with its adapters off (`AdaptersOff`): no copy;
- publishing: merged weights, W + (alpha / rank) B A (`merge`), or, when the plan serves adapters
  (`LoraPlan.serve`), the adapters alone in PEFT's format (`PeftAdapters`), which vLLM loads.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_rl.config.layout import LoraPlan
from megatron_rl.transforms.base import ModelTransform
from megatron_rl.transforms.lora import adapters_disabled, apply_lora, merge_adapter_tensors
from megatron_rl.transforms.lora_base import check_base, check_settings, is_trainable_key, lora_meta
from megatron_rl.transforms.peft import (
    adapter_config,
    hf_target_modules,
    is_adapter,
    megatron_adapters_to_peft,
    write_peft_adapter,
)


class LoraTransform(ModelTransform):
    """A role's LoRA adapters: `plan` (the layout's), A drawn from `seed` and each layer's name,
    `base` the identity of the base model the config loads (lora_base.base_identity)."""

    name = "lora"

    def __init__(self, plan: LoraPlan, seed: int, base: dict):
        self.plan, self.seed, self.base = plan, seed, base

    def build_options(self) -> dict:
        return {"moe_grouped_gemm": False} if self.plan.adapts_experts else {}

    def apply(self, model: torch.nn.Module) -> str:
        plan = self.plan
        wrapped = apply_lora(model, plan.rank, plan.alpha, tuple(plan.target_modules), seed=self.seed)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in model.parameters())
        return (
            f"LoRA on: rank {plan.rank}, alpha {plan.alpha:g}, targets {', '.join(plan.target_modules)} "
            f"({len(wrapped)} linears wrapped on rank 0); trainable parameters on rank 0: {trainable} of {total} "
            f"({100.0 * trainable / max(total, 1):.3f}%)"
        )

    def frozen_reference(self, model: torch.nn.Module) -> AdaptersOff:
        return AdaptersOff(model)

    def merge(self, tensors: dict) -> dict:
        return merge_adapter_tensors(tensors, self.plan.alpha)

    def served_alone(self) -> PeftAdapters | None:
        return PeftAdapters(self.plan.rank, self.plan.alpha) if self.plan.serve == "adapter" else None

    def serving_line(self) -> str:
        plan = self.plan
        form = "adapters" if plan.serve == "adapter" else "merged weights"
        return f"LoRA (rank {plan.rank}, alpha {plan.alpha:g}): versions reach inference as {form} ({plan.serve_reason})"

    def checkpoint_meta(self) -> dict:
        return lora_meta(self.plan, self.plan.key, self.base)

    def keeps(self, key: str) -> bool:
        return is_trainable_key(key)

    def check_checkpoint(self, saved: dict | None, path: Path) -> None:
        if saved is None:
            return  # every tensor is in the checkpoint (full fine-tuning, or LoRA before adapters-only ones)
        check_base(saved["base"], self.base, path)
        check_settings(saved, self.checkpoint_meta(), path)


def refuse_without_lora(saved: dict, path: Path) -> None:
    """A LoRA checkpoint resumes only a LoRA run (it holds adapters, not the whole model)."""
    key = saved.get("key", "lora")
    raise ValueError(
        f"{path}: a LoRA checkpoint ({key}: adapters of the base {saved['base'].get('checkpoint')}, not the "
        f"whole model); this run trains without {key}: set it as the checkpoint was written, or start a new "
        "run (another checkpoint.dir)"
    )


@dataclass(frozen=True)
class AdaptersOff:
    """The frozen reference of a LoRA model: `model` (the policy's own, unwrapped) within
    `adapters_disabled`, i.e. its frozen base, the initial policy. During its pass the model is in
    eval mode; it routes by its own router, as a separate reference model would (a pass is given
    no routing hook); both are restored after."""

    model: torch.nn.Module

    @contextmanager
    def active(self) -> Iterator[torch.nn.Module]:
        training = self.model.training
        with adapters_disabled(self.model) as count:
            if not count:
                raise ValueError("the KL reference 'adapters off' needs a LoRA-adapted policy; this one has no adapters")
            self.model.eval()
            try:
                yield self.model
            finally:
                self.model.train(training)


@dataclass(frozen=True)
class PeftAdapters:
    """LoRA adapters published alone (transforms/base.ExternalFormat) in PEFT's format: the
    tensors `lora_A`/`lora_B` under HF names, `adapter_config.json` with `rank` and `alpha`."""

    rank: int
    alpha: float

    def select(self, key: str) -> bool:
        return is_adapter(key)

    def convert(self, tensors: dict, arch) -> dict:
        return megatron_adapters_to_peft(tensors, arch, partial=True)

    def targets(self, tensors: dict) -> list[str]:
        return hf_target_modules(tensors)

    def config(self, targets: list[str], base_model: str | None) -> dict:
        return adapter_config(self.rank, self.alpha, targets, base_model)

    def write(self, directory: Path, tensors: dict, base_model: str | None) -> None:
        write_peft_adapter(directory, tensors, self.rank, self.alpha, base_model)
