"""check-config's memory plan: the 30B examples fit only with the seed's options, a layout that
cannot fit is refused with the numbers and the fixes, every example config prints a plan; the
offloaded optimizer's host share includes the pinned gradient copy; the KL reference model."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_rl.config import ConfigError, ModelLayout, load_config
from megatron_rl.config.memory_plan import (
    GIB,
    adam_tensor_elements,
    format_plan,
    memory_plan,
    rank_parameters,
    route_bytes_per_token,
)
from tests.support.cli import run_cli

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples" / "configs").glob("*.yaml"))
SAO_30B = next(p for p in EXAMPLES if p.name == "qwen3_30b_a3b_sao.yaml")


def test_qwen3_30b_a3b_parameter_count_matches_the_published_total():
    arch = load_config(SAO_30B).layout.policy_architecture
    single = ModelLayout(world_size=1, tp=1, cp=1, pp=1, ep=1, dp=1, expert_dp=1)
    total = rank_parameters(arch, single).total
    assert total == pytest.approx(30.5e9, rel=0.005)  # "30.5B parameters in total" (model card)


def test_30b_example_fits_only_with_the_optimizer_offloaded():
    resolved = load_config(SAO_30B)
    plan = {gpu.role: gpu for gpu in memory_plan(resolved)}
    policy = plan["policy"]
    # EP=2 on 2 GPUs: about 16.0B parameters per GPU in bf16, fp32 gradients, the optimizer on the host.
    assert policy.parts["weights"] * GIB / 2 == pytest.approx(16.04e9, rel=0.01)
    assert policy.parts["gradients"] == pytest.approx(2 * policy.parts["weights"])
    assert policy.parts["optimizer"] == 0 and policy.host_gib > 150
    assert policy.total < 140.4 and plan["critic"].total < 140.4
    with pytest.raises(ConfigError) as refused:
        load_config(SAO_30B, ["optimizer.cpu_offload=false", "value.optimizer.cpu_offload=false"])
    message = str(refused.value)
    assert "model: the policy needs about" in message and "value.model: the critic needs about" in message
    assert "GiB more than deployment.gpu_memory_gib = 140.4" in message
    assert "options: optimizer.cpu_offload: true (offload_fraction 1 moves" in message
    assert "value.optimizer.cpu_offload: true" in message


@pytest.mark.parametrize("role", ["policy", "critic"])
def test_offload_moves_the_optimizer_to_the_host_and_adds_the_gradient_copy(role):
    roomy = ["deployment.gpu_memory_gib=1000"]
    key = "optimizer" if role == "policy" else "value.optimizer"
    plans = {
        fraction: {g.role: g for g in memory_plan(load_config(SAO_30B, [*roomy, *overrides]))}[role]
        for fraction, overrides in [
            (0.0, [f"{key}.cpu_offload=false"]),
            (0.5, [f"{key}.offload_fraction=0.5"]),
            (1.0, []),
        ]
    }
    resolved = load_config(SAO_30B)
    layout = resolved.layout.policy if role == "policy" else resolved.layout.critic
    arch = resolved.layout.policy_architecture
    params = rank_parameters(arch, layout, value_model=role == "critic",
                             freeze_attention=role == "critic" and resolved.value.freeze_attention)  # fmt: skip
    elements = adam_tensor_elements(params, layout)
    # bf16: an fp32 master and two moments per element on the GPU without offload ...
    assert plans[0.0].parts["optimizer"] * GIB == pytest.approx(12 * elements)
    assert plans[0.0].host_gib == 0
    # ... and on the host with it, plus the pinned fp32 gradient copy (before: 12 B, not 16)
    assert plans[1.0].parts["optimizer"] == 0
    assert plans[1.0].host_gib * GIB == pytest.approx(16 * elements)
    assert plans[0.5].parts["optimizer"] * GIB == pytest.approx(6 * elements)
    assert plans[0.5].host_gib * GIB == pytest.approx(8 * elements)


def test_a_kl_reference_model_is_a_second_copy_of_the_policy_weights():
    grpo = next(p for p in EXAMPLES if p.name == "qwen3_30b_a3b_grpo.yaml")
    without = memory_plan(load_config(grpo))[0]
    with_kl = memory_plan(load_config(grpo, ["algorithm.kl_coef=0.05", "deployment.gpu_memory_gib=1000"]))[0]
    assert "reference" not in without.parts
    assert with_kl.parts["reference"] == with_kl.parts["weights"] == without.parts["weights"]
    assert with_kl.total == pytest.approx(without.total + without.parts["weights"])
    # 138.9 GiB: it fits the H200's 140.4 GiB since the log-prob kernel's logits cost 4 B, not 10.
    assert with_kl.total == pytest.approx(138.86, abs=0.01)
    load_config(grpo, ["algorithm.kl_coef=0.05"])
    refused = r"the policy needs about 138\.\d GiB per GPU \(weights 29\.9, .*reference 29\.9 GiB\)"
    with pytest.raises(ConfigError, match=refused):
        load_config(grpo, ["algorithm.kl_coef=0.05", "deployment.gpu_memory_gib=130"])


def test_without_recomputation_the_activations_do_not_fit():
    with pytest.raises(ConfigError, match=r"model.recompute \{granularity: full"):
        load_config(SAO_30B, ["model.recompute={granularity: none}"])
    plan = memory_plan(
        load_config(SAO_30B, ["model.recompute={granularity: selective}", "deployment.gpu_memory_gib=1000"])
    )
    full = memory_plan(load_config(SAO_30B))
    assert plan[0].parts["activations"] > 2 * full[0].parts["activations"]


def test_inference_needs_room_for_one_sequence_of_kv_cache():
    with pytest.raises(
        ConfigError, match="inference: the weights .* leave .* KV cache .* raise inference.tp"
    ):
        load_config(SAO_30B, ["deployment.gpu_memory_gib=36"])


def test_cpu_configs_print_a_plan_but_are_not_checked_against_a_gpu():
    tiny = next(p for p in EXAMPLES if p.name == "tiny_cpu_sao.yaml")
    resolved = load_config(tiny, ["deployment.gpu_memory_gib=0.001"])
    assert "deployment.device cpu: not checked" in format_plan(resolved, memory_plan(resolved))


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_check_config_prints_the_plan_for_every_example(example):
    result = run_cli("check-config", str(example))
    assert result.returncode == 0, result.stderr
    assert "memory plan (GiB per GPU" in result.stderr and "policy" in result.stderr
    assert result.stdout.lstrip().startswith("{")  # stdout stays the resolved JSON


def test_routing_replay_adds_the_routes_of_a_steps_share_of_tokens():
    off = memory_plan(load_config(SAO_30B))[0]
    resolved = load_config(SAO_30B, ["algorithm.routing_replay=replay"])
    policy, critic = memory_plan(resolved)[:2]
    assert "routes" not in off.parts and "routes" not in critic.parts
    arch, layout, o = resolved.layout.policy_architecture, resolved.layout.policy, resolved.orchestrator
    assert route_bytes_per_token(arch) == 48 * 8 + 1  # Qwen3-30B-A3B: 48 MoE layers, top-8 of 128 (uint8)
    tokens = o.batch_size * o.group_size * resolved.model.seq_len / (layout.dp * layout.cp)
    targets = resolved.model.seq_len * arch.num_experts_per_tok * 8 * arch.num_layers  # int64, one micro-batch
    assert policy.parts["routes"] == pytest.approx((tokens * 385 + targets) / GIB)
    assert policy.total == pytest.approx(off.total + policy.parts["routes"])
    assert "routes" in format_plan(resolved, memory_plan(resolved))


def test_the_old_budget_key_is_refused_naming_the_new_one():
    with pytest.raises(ConfigError, match=r"deployment.gpu_memory_gb \(= 141\) is now deployment.gpu_memory_gib, in GiB"):
        load_config(SAO_30B, ["deployment.gpu_memory_gb=141"])
