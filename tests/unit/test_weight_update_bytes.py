"""check-config's weight update per policy version: the bytes the publishers send, counted by hand
here; tests/distributed/test_memory_plan.py compares the same figure with the files of a version
the project's own publishers wrote. A LoRA policy served as adapters sends PEFT's tensors, one A
per Hugging Face module (q_proj, k_proj, v_proj; gate_proj, up_proj), where the trainer's fused
linear_qkv and linear_fc1 hold one; only `lora.target_modules`'; both the adapters and the whole
model in the model's dtype."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_rl.config import ModelLayout, load_config
from megatron_rl.config.memory_plan import (
    GIB,
    format_plan,
    lora_parameters,
    memory_plan,
    published_lora_elements,
    rank_parameters,
    weight_update_gib,
)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "configs"
LORA_30B = EXAMPLES / "qwen3_30b_a3b_sao_lora.yaml"
TINY = (
    EXAMPLES / "tiny_cpu_sao.yaml"
)  # the demo's layer shapes: hidden 128, 2 layers, 4 + 2 heads of 32, MLP 256
SINGLE = ModelLayout(world_size=1, tp=1, cp=1, pp=1, ep=1, dp=1, expert_dp=1)


def update_line(resolved) -> str:
    return next(line for line in format_plan(resolved, memory_plan(resolved)).splitlines()
                if line.startswith("weight update per policy version"))  # fmt: skip


def test_the_30b_lora_example_prints_the_bytes_each_version_sends():
    """Qwen3-30B-A3B, rank 16 on attention and all 128 experts of 48 layers, bfloat16: 1.57 GiB,
    2.76% of the model (the trainer's fused layers would say 1.19 GiB, 2.1%)."""
    resolved = load_config(LORA_30B)
    r, h = 16, 2048
    attention = r * (h + 32 * 128) + 2 * r * (h + 4 * 128) + r * (32 * 128 + h)  # q, k, v, o: one A each
    experts = 128 * (2 * r * (h + 768) + r * (768 + h))  # gate, up, down of every expert
    sent = 48 * (attention + experts) * 2
    whole = 30_532_122_624 * 2  # Qwen3-30B-A3B's parameters (model card: 30.5B), bfloat16
    assert rank_parameters(resolved.layout.policy_architecture, SINGLE).total == 30_532_122_624
    assert weight_update_gib(resolved) == (whole / GIB, sent / GIB)
    assert update_line(resolved) == (
        "weight update per policy version: 1.57 GiB of LoRA adapters in PEFT's format "
        "(2.76% of the 56.87 GiB whole model, both bfloat16)"
    )
    trainer = lora_parameters(resolved.layout.policy_architecture, 1, 1, r) * 48 * 2
    assert (
        trainer / GIB == pytest.approx(1.19, abs=0.005)
        and sent - trainer == 48 * (2 * r * h + 128 * r * h) * 2
    )


def test_only_the_targets_adapters_are_counted():
    """Attention-only adapters on the same model: q, k, v and o, no expert's."""
    resolved = load_config(LORA_30B, ["lora.target_modules=[linear_qkv, linear_proj]"])
    r, h = 16, 2048
    attention = r * (h + 32 * 128) + 2 * r * (h + 4 * 128) + r * (32 * 128 + h)
    assert weight_update_gib(resolved)[1] * GIB == 48 * attention * 2
    assert "0.02 GiB of LoRA adapters in PEFT's format (0.04% of the 56.87 GiB whole model" in update_line(
        resolved
    )


def test_the_demos_versions_hold_32768_adapter_parameters_where_the_trainer_has_26624():
    """The demo's model (the tiny CPU example's layers) at rank 8 on every linear: the trainer holds
    26,624 adapter parameters, each version 32,768 (two more A for q/k/v, one for gate/up, per
    layer), float32 on both sides of the ratio."""
    resolved = load_config(TINY, ["lora.rank=8", "lora.alpha=16"])
    arch = resolved.layout.policy_architecture
    assert lora_parameters(arch, 1, 1, 8) * arch.num_layers == 26_624
    assert published_lora_elements(arch, 8, resolved.lora.target_modules) == 32_768
    assert 26_624 + arch.num_layers * 3 * 8 * 128 == 32_768  # the extra A: [8, 128] each
    whole, adapters = weight_update_gib(resolved)
    total = rank_parameters(arch, SINGLE).total
    assert (whole, adapters) == (total * 4 / GIB, 32_768 * 4 / GIB)  # float32 both: the ratio is elements'
    assert f"({32_768 / total:.2%} of the {whole:.2f} GiB whole model, both float32)" in update_line(resolved)


def test_a_merged_or_full_update_is_the_whole_model_in_its_dtype():
    full = load_config(TINY)
    total = rank_parameters(full.layout.policy_architecture, SINGLE).total
    assert weight_update_gib(full) == (total * 4 / GIB, None)
    assert (
        update_line(full)
        == f"weight update per policy version: {total * 4 / GIB:.2f} GiB (the whole model, float32)"
    )
    merged = load_config(LORA_30B, ["lora.serve=merged"])
    assert weight_update_gib(merged) == (30_532_122_624 * 2 / GIB, None)
    assert update_line(merged).endswith("56.87 GiB (the whole model, bfloat16)")
