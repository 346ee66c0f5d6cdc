"""The policy's `lora` section: its fields and defaults, the refusals that name their key (dropout,
an unknown target), MoE layouts at tp > 1 (sequence parallel) accepted, expert adapters
building the model with one linear per expert instead of TE's grouped GEMM, the critic's `value.lora` sharing the same base, the memory plan without a
second model for the KL reference, and the round trip through the resolved JSON."""

from __future__ import annotations

import copy

import pytest

from megatron_rl.config import (
    LORA_TARGETS,
    ConfigError,
    LoraBase,
    LoraConfig,
    PolicyLoraConfig,
    adapts_experts,
    load_resolved,
    parse_config,
)
from megatron_rl.config.memory_plan import memory_plan
from megatron_rl.config.model_memory import rank_parameters
from tests.support.configs import ARCH, base

MOE = {**ARCH, "family": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}


def errors_of(data: dict) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(data, source="test.yaml")
    return str(info.value)


def grpo(**lora) -> dict:
    config = base("grpo")
    config["lora"] = lora
    return config


def test_defaults_and_the_shared_base():
    resolved = parse_config(grpo(rank=8))
    lora = resolved.lora
    assert isinstance(lora, PolicyLoraConfig) and isinstance(lora, LoraBase)
    assert (lora.rank, lora.alpha, lora.dropout) == (8, 16.0, 0.0)
    assert lora.target_modules == list(LORA_TARGETS) == ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
    assert parse_config(base("grpo")).lora is None  # full fine-tuning by default
    # the critic's section shares the base: the same fields, the same target check, no dropout key
    assert issubclass(LoraConfig, LoraBase) and "dropout" not in LoraConfig.model_fields
    critic = base("sao")
    critic["value"]["lora"] = {"rank": 4, "target_modules": ["linear_qkv", "linear_fc3"]}
    assert "value.lora.target_modules: Value error, unknown target module(s) ['linear_fc3']" in errors_of(critic)


def test_lora_is_a_top_level_section_not_a_model_key():
    config = base("grpo")
    config["model"]["lora"] = {"rank": 4}
    assert "model.lora: unknown key" in errors_of(config)


def test_dropout_other_than_zero_is_refused_naming_the_key_and_why():
    message = errors_of(grpo(rank=8, dropout=0.05))
    assert "lora.dropout: Value error, 0.05 is not supported: LoRA dropout must be 0.0" in message
    assert "the first update's ratio would be off the sampler's policy" in message
    assert parse_config(grpo(rank=8, dropout=0.0)).lora.dropout == 0.0


def test_unknown_duplicate_or_no_target_is_refused_naming_the_key():
    message = errors_of(grpo(rank=8, target_modules=["linear_qkv", "q_proj"]))
    assert "lora.target_modules: Value error, unknown target module(s) ['q_proj']" in message
    assert "choose from ['linear_qkv', 'linear_proj', 'linear_fc1', 'linear_fc2']" in message
    assert "lora.target_modules: Value error, ['linear_qkv', 'linear_qkv'] names a module more than once" in (
        errors_of(grpo(rank=8, target_modules=["linear_qkv", "linear_qkv"]))
    )
    assert "lora.target_modules: Value error, name at least one target module" in errors_of(
        grpo(rank=8, target_modules=[])
    )
    assert "lora.rank: Input should be greater than 0" in errors_of(grpo(rank=0))
    assert "lora.alpha: Input should be greater than 0" in errors_of(grpo(rank=4, alpha=0))


def test_moe_layouts_take_lora_at_every_tp_and_ep():
    config = grpo(rank=8)
    config["model"]["architecture"] = dict(MOE)
    config["model"]["tp"] = 2
    # sequence parallel (the layout turns it on for MoE at tp > 1), expert adapters on GPUs: the
    # policy is built with one linear per expert (moe_grouped_gemm off), which each adapter wraps
    resolved = parse_config(config)
    assert resolved.layout.policy.sp == 2 and adapts_experts(resolved.lora, resolved.layout.policy_architecture)
    config["model"]["tp"] = 1
    config["model"]["ep"] = 2
    resolved = parse_config(config)
    assert resolved.deployment.device == "cuda" and adapts_experts(resolved.lora, resolved.layout.policy_architecture)
    config["lora"]["target_modules"] = ["linear_qkv", "linear_proj"]  # attention only: grouped GEMM stays
    resolved = parse_config(config)
    assert not adapts_experts(resolved.lora, resolved.layout.policy_architecture)
    config["lora"]["target_modules"] = list(LORA_TARGETS)
    config["deployment"]["device"] = "cpu"
    assert parse_config(config).layout.policy.ep == 2
    # the critic's value.lora at tp 2 on an MoE model too
    critic = base("sao")
    critic["value"]["model"]["architecture"] = dict(MOE)
    critic["value"]["model"]["tp"] = 2
    critic["value"]["lora"] = {"rank": 4, "target_modules": ["linear_qkv"]}
    assert parse_config(critic).layout.critic.sp == 2


def test_the_memory_plan_drops_the_reference_copy_and_full_optimizer_state():
    full = base("grpo")
    full["algorithm"]["kl_coef"] = 0.1
    lora = copy.deepcopy(full)
    lora["lora"] = {"rank": 8}
    full_gpu = memory_plan(parse_config(full))[0]
    lora_gpu = memory_plan(parse_config(lora))[0]
    assert full_gpu.role == lora_gpu.role == "policy"
    assert full_gpu.parts["reference"] == full_gpu.parts["weights"] > 0 and "reference" not in lora_gpu.parts
    assert lora_gpu.parts["weights"] > full_gpu.parts["weights"]  # the adapters are added to the weights
    # gradients (fp32) of the adapters only. Per layer of the tiny model (hidden 64, 8 query and
    # 4 key/value heads of 8 channels, MLP 128) at rank 8, A [8, in] + B [out, 8] of each linear:
    # qkv 8*64 + 128*8, proj 8*64 + 64*8, fc1 8*64 + 256*8, fc2 8*128 + 64*8 = 6656; 4 layers.
    resolved = parse_config(lora)
    adapters = rank_parameters(resolved.layout.policy_architecture, resolved.layout.policy, lora_rank=8)
    assert adapters.trainable == 4 * 6656
    assert lora_gpu.parts["gradients"] == pytest.approx(4 * 6656 * 4 / 2**30)
    assert lora_gpu.parts["optimizer"] < full_gpu.parts["optimizer"] / 4


def test_the_section_round_trips_through_the_resolved_json(tmp_path):
    resolved = parse_config(grpo(rank=4, alpha=8.0, target_modules=["linear_qkv", "linear_fc2"]))
    path = tmp_path / "resolved.json"
    path.write_text(resolved.to_json())
    again = load_resolved(path)
    assert again.lora == resolved.lora and again == resolved
    assert again.lora.model_dump() == {"rank": 4, "alpha": 8.0, "target_modules": ["linear_qkv", "linear_fc2"],
                                       "serve": "auto", "dropout": 0.0}  # fmt: skip


def test_expert_adapters_build_the_policy_with_one_linear_per_expert(monkeypatch):
    """The policy's model is built with TE's grouped GEMM off exactly when the adapters wrap experts
    (the LoRA transform's build options; the layout's plan says so once: the TE spec with one linear
    per expert, tests/distributed/test_te_layouts.py checks LoRA there)."""
    from megatron_rl.policy import trainer
    from megatron_rl.transforms.plan import build_options, role_transforms

    seen = []
    monkeypatch.setattr(trainer, "build_gpt_model", lambda arch, **kwargs: seen.append(kwargs))
    config = grpo(rank=8)
    config["model"]["architecture"] = dict(MOE)
    config["model"]["ep"] = 2
    config["model"]["transformer_engine"] = "auto"  # device cuda without TE here: required would refuse
    for targets, grouped_off in ((list(LORA_TARGETS), True), (["linear_qkv", "linear_proj"], False)):
        config["lora"]["target_modules"] = targets
        resolved = parse_config(config)
        assert resolved.layout.policy_lora.adapts_experts == grouped_off
        trainer.build_policy_model(resolved, resolved.layout.policy, **build_options(role_transforms(resolved, "policy")))
        assert (seen[-1].get("moe_grouped_gemm") is False) == grouped_off


def test_the_30b_lora_example_fits_without_optimizer_offload_and_updates_a_fiftieth_of_the_model():
    from pathlib import Path

    from megatron_rl.config import load_config
    from megatron_rl.config.memory_plan import check_fits, format_plan, weight_update_gib

    examples = Path(__file__).resolve().parents[2] / "examples" / "configs"
    lora = load_config(examples / "qwen3_30b_a3b_sao_lora.yaml")
    full = load_config(examples / "qwen3_30b_a3b_sao.yaml")
    assert lora.optimizer.cpu_offload is False and full.optimizer.cpu_offload is True
    assert adapts_experts(lora.lora, lora.layout.policy_architecture)  # attention + every expert
    assert lora.layout.policy == full.layout.policy and lora.value == full.value  # the same layout, the same critic
    plan = {gpu.role: gpu for gpu in memory_plan(lora)}
    assert check_fits(lora, list(plan.values())) == []
    policy = plan["policy"]
    assert policy.host_gib == 0 and "reference" not in policy.parts
    assert policy.largest().total < 0.5 * {g.role: g for g in memory_plan(full)}["policy"].largest().total
    whole, adapters = weight_update_gib(lora)
    assert weight_update_gib(full) == (whole, None) and 0.01 < adapters / whole < 0.03
    assert f"weight update per policy version: {adapters:.2f} GiB of LoRA adapters" in format_plan(lora, list(plan.values()))
