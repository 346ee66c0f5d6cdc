"""check-config's memory plan: the 30B examples fit only with the seed's options, a layout that
cannot fit is refused with the numbers and the fixes, every example config prints a plan with its
steady, start-up and resume peaks; the offloaded optimizer's host share includes the pinned
gradient copy, rounded as torch's pinned allocator rounds it, summed per node; the KL reference
model and the REINFORCE++ example's start-up peak; a LoRA policy's expert adapters' optimizer
state over expert-DP and its adapters' activations."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_rl.config import ConfigError, ModelLayout, load_config
from megatron_rl.config.host_memory import ShardTensor, offloaded_host_memory, pinned_bytes
from megatron_rl.config.memory_plan import (
    CUDA_CONTEXT_GIB,
    FRAGMENTATION_GIB,
    GIB,
    LOGPROB_CHUNK_BYTES,
    NCCL_GIB_PER_COMMUNICATOR,
    activation_bytes,
    adam_tensor_elements,
    format_plan,
    memory_plan,
    node_host_memory,
    rank_parameters,
    route_bytes_per_token,
)
from megatron_rl.config.model import Architecture
from tests.support.cli import run_cli
from tests.support.hf_configs import GLM_45_AIR

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
    assert policy.parts["optimizer"] == 0 and policy.host_gib > 200
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
    # ... and on the host with it, plus the pinned fp32 gradient copy (before: 12 B, not 16), which
    # torch's pinned allocator rounds up to a power of two (and the cached 16-bit staging copies)
    assert plans[1.0].parts["optimizer"] == 0
    host = plans[1.0].host.steady
    assert host["masters"] + host["moments"] == pytest.approx(12 * elements)
    assert 4 * elements < host["pinned_gradients"] < 8 * elements
    assert plans[1.0].host_gib * GIB == pytest.approx(sum(host.values()))
    assert plans[0.5].parts["optimizer"] * GIB == pytest.approx(6 * elements)
    half = plans[0.5].host.steady
    assert half["masters"] + half["moments"] + half["pinned_gradients"] == pytest.approx(
        0.5 * (host["masters"] + host["moments"] + host["pinned_gradients"])
    )


def test_a_kl_reference_model_is_a_second_copy_of_the_policy_weights():
    grpo = next(p for p in EXAMPLES if p.name == "qwen3_30b_a3b_grpo.yaml")
    without = memory_plan(load_config(grpo))[0]
    with_kl = memory_plan(load_config(grpo, ["algorithm.kl_coef=0.05", "deployment.gpu_memory_gib=1000"]))[0]
    assert "reference" not in without.parts
    assert with_kl.parts["reference"] == with_kl.parts["weights"] == without.parts["weights"]
    assert with_kl.total == pytest.approx(without.total + without.parts["weights"])
    # 139.9 GiB: it fits the H200's 140.4 GiB since the log-prob kernel's logits cost 4 B, not 10
    # (with 1 GiB of CUDA context, 2 of fragmentation and 3 NCCL communicators: DP, EP, weight broadcast).
    assert with_kl.total == pytest.approx(139.86, abs=0.01)
    load_config(grpo, ["algorithm.kl_coef=0.05"])
    refused = r"the policy needs about 139\.\d GiB per GPU \(weights 29\.9, .*reference 29\.9, .*nccl 3\.0 GiB\)"
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
    assert "peaks (GiB per GPU; the largest must fit in" in result.stderr
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


def test_top_k_distillation_adds_the_teachers_top_k_on_the_last_stage_and_no_logits_gradient(tmp_path):
    teacher = ["distillation.teacher.url=http://teacher:8000", f"distillation.teacher.model_dir={tmp_path}",
               "distillation.top_k=64"]  # fmt: skip
    off = memory_plan(load_config(SAO_30B, teacher))[0]
    resolved = load_config(SAO_30B, [*teacher, "distillation.mode=top_k_kl"])
    policy, critic = memory_plan(resolved)[:2]
    assert "top_k_kl" not in off.parts and "top_k_kl" not in critic.parts
    layout, model = resolved.layout.policy, resolved.model
    tokens = model.seq_len / layout.cp
    # 29 B a teacher entry and token; the fused kernel writes no second logits-sized gradient
    # (tests/distributed/test_logprobs.py measures it), so nothing scales with the vocabulary.
    assert policy.parts["top_k_kl"] == pytest.approx(tokens * 64 * 29 / GIB)
    assert policy.total == pytest.approx(off.total + policy.parts["top_k_kl"])
    assert "top_k_kl" in format_plan(resolved, memory_plan(resolved))


def test_the_old_budget_key_is_refused_naming_the_new_one():
    with pytest.raises(ConfigError, match=r"deployment.gpu_memory_gb \(= 141\) is now deployment.gpu_memory_gib, in GiB"):
        load_config(SAO_30B, ["deployment.gpu_memory_gb=141"])


REINFORCE_PP_30B = next(p for p in EXAMPLES if p.name == "qwen3_30b_a3b_reinforce_pp.yaml")
FIXED_GIB = CUDA_CONTEXT_GIB + FRAGMENTATION_GIB  # per GPU, besides NCCL


def peak_rows(stderr: str) -> dict[str, tuple[float | None, ...]]:
    """check-config's peaks table: role -> (steady, start-up, resume) GiB (None: no such peak)."""
    lines = stderr.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("peaks (GiB per GPU"))
    rows = {}
    for line in lines[start + 2 :]:
        if line.startswith((" ", "host memory", "weight update")):
            continue
        cells = line.split()
        rows[cells[0]] = tuple(None if c == "-" else float(c) for c in cells[1:4])
    return rows


def test_reinforce_pp_30b_check_config_shows_its_start_up_peak_and_fits_it():
    result = run_cli("check-config", str(REINFORCE_PP_30B))
    assert result.returncode == 0, result.stderr
    steady, start_up, resume = peak_rows(result.stderr)["policy"]
    # By hand: Qwen3-30B-A3B at EP=2 on 2 GPUs, bf16, fp32 gradients, optimizer on the host.
    experts = 48 * 64 * 3 * 2048 * 768  # per rank
    dense = 48 * (2048 + 2048 * (32 + 8) * 128 + 32 * 128 * 2048 + 2048 + 2 * 128 + 128 * 2048) + 2 * 151936 * 2048 + 2048
    weights, gradients = (experts + dense) * 2 / GIB, (experts + dense) * 4 / GIB
    nccl = 3 * NCCL_GIB_PER_COMMUNICATOR  # data-parallel, expert all-to-all, weight broadcast
    # The reference is built after DDP and the optimizer: the start-up peak is that moment ...
    assert start_up == pytest.approx(2 * weights + gradients + FIXED_GIB + nccl, abs=0.01)
    assert "policy start-up (when the KL reference is built)" in result.stderr
    assert start_up <= 140.4 and steady <= 140.4 and resume <= 140.4
    # ... where building it before DDP (the old order) peaked while DDP built the expert
    # buffers, with the reference resident: over the H200's 140.4 GiB.
    old_order = weights + experts * 2 / GIB + gradients + weights + FIXED_GIB + nccl
    assert old_order == pytest.approx(152.5, abs=0.05) and old_order > 140.4
    # resume: no activations yet; the state initialisation's one gradient buffer is on the host
    # at offload fraction 1 (megatron's dummy_step put a gradient of every shard on the GPU: +28.4)
    assert resume == pytest.approx(start_up, abs=0.01)
    assert "policy resume (when a checkpoint is loaded): weights 29.87, gradients 59.74, optimizer 0.00, reference 29.87" in result.stderr


def test_a_layout_over_its_start_up_peak_but_not_its_steady_state_is_refused_naming_the_peak():
    roomy = {gpu.role: gpu for gpu in memory_plan(load_config(SAO_30B))}
    policy = roomy["policy"]
    start_up = next(peak for peak in policy.peaks if peak.name == "start-up")
    assert policy.total < 115 < start_up.total  # the steady state fits 115 GiB, DDP's buffers do not
    experts = 48 * 64 * 3 * 2048 * 768
    assert start_up.parts["new_expert_weights"] == pytest.approx(experts * 2 / GIB)
    assert start_up.total == pytest.approx(
        policy.parts["weights"] + experts * 2 / GIB + policy.parts["gradients"] + FIXED_GIB + policy.parts["nccl"]
    )
    with pytest.raises(ConfigError) as refused:
        load_config(SAO_30B, ["deployment.gpu_memory_gib=115"])
    message = str(refused.value)
    assert (
        "model: the policy's start-up peak (when DDP builds the expert buffers) needs about 122.6 GiB per GPU "
        "(weights 29.9, new_expert_weights 27.0, gradients 59.7," in message
    )
    assert "7.6 GiB more than deployment.gpu_memory_gib = 115" in message
    assert "value.model: the critic's start-up peak (when DDP builds the expert buffers)" in message


def test_resume_peak_adds_one_gradient_buffer_and_nothing_rebuilt():
    resolved = load_config(SAO_30B, ["optimizer.offload_fraction=0.5", "deployment.gpu_memory_gib=1000"])
    policy = memory_plan(resolved)[0]
    resume = next(peak for peak in policy.peaks if peak.name == "resume")
    arch, layout = resolved.layout.policy_architecture, resolved.layout.policy
    elements = adam_tensor_elements(rank_parameters(arch, layout), layout)
    # one fp32 zero gradient as large as the largest parameter stepped on the GPU: the embedding
    assert resume.parts["state_init_gradient"] == pytest.approx(151936 * 2048 * 4 / GIB)
    assert set(resume.parts) - set(policy.parts) == {"state_init_gradient"}  # the sub-optimizers are kept
    assert elements > 0
    assert "activations" not in resume.parts and "logprob_chunk" not in resume.parts
    steady_without_step = policy.total - policy.parts["activations"] - policy.parts["logprob_chunk"]
    extra = resume.parts["state_init_gradient"]
    assert resume.total == pytest.approx(steady_without_step + extra)


def test_pinned_allocations_round_up_to_powers_of_two():
    assert [pinned_bytes(n) for n in (1, 4096, 4097, 12 << 20)] == [1, 4096, 8192, 16 << 20]
    # An expert's fc1 of Qwen3-30B-A3B: 2 x 768 x 2048 elements; its pinned fp32 gradient is 12 MiB,
    # taken as 16 MiB. A dense tensor of 1000 elements sharded over 2 ranks: 4000 B -> 4096, half each.
    fc1, small = ShardTensor(2 * 768 * 2048, 1), ShardTensor(1000, 2)
    host = offloaded_host_memory([fc1, small], dtype_bytes=2, fraction=1.0)
    assert host.steady["pinned_gradients"] == (16 << 20) + 4096 / 2
    assert host.steady["masters"] == 4 * (2 * 768 * 2048 + 500)  # pageable fp32 masters: exact
    assert host.steady["moments"] == 8 * (2 * 768 * 2048 + 500)
    assert host.steady["pinned_cache"] == (8 << 20) + 2048  # the dropped bf16 staging copies, one per class
    # megatron's first optimizer (full tensors) and the second one's masters at start-up
    assert host.start_up["first_optimizer_copies"] == 4 * (2 * 768 * 2048 + 1000)
    assert set(host.resume) - set(host.steady) == {"state_init_gradient"}  # the masters are kept
    assert host.resume["state_init_gradient"] == 4 * 2 * 768 * 2048  # one fp32 buffer, the largest tensor
    with pytest.raises(ValueError, match="offload fraction must be within"):
        offloaded_host_memory([fc1], dtype_bytes=2, fraction=1.5)


def test_host_memory_is_summed_per_node_and_refused_naming_the_node_figure():
    plan = {gpu.role: gpu for gpu in memory_plan(load_config(SAO_30B))}
    policy, critic = plan["policy"].host, plan["critic"].host
    # Every expert tensor of the policy rank whole (expert-DP 1): 48 x 64 x (16 + 8) MiB pinned.
    assert policy.steady["pinned_gradients"] >= 48 * 64 * (24 << 20)
    assert policy.steady["pinned_gradients"] > 1.3 * policy.steady["masters"]  # 16 B a element was 4 B of it
    node = 2 * sum(policy.resume.values()) + 2 * sum(critic.resume.values())  # resume is the largest moment
    result = run_cli("check-config", str(SAO_30B))
    assert f"host memory of a policy node (2 policy, 2 critic ranks): {node / GIB:.0f} GiB" in result.stderr
    assert node / GIB > 950  # the old 16 B per element said 892 GiB: pinned rounding adds about 84
    with pytest.raises(ConfigError, match=rf"deployment.host_memory_gib: a policy node needs about {node / GIB:.0f} "
                                          r"GiB of host memory .* 2 policy ranks, 2 critic ranks .* "
                                          r"deployment.host_memory_gib = 900"):  # fmt: skip
        load_config(SAO_30B, ["deployment.host_memory_gib=900"])


def test_inference_plans_its_weight_update_beside_vllms_share():
    result = run_cli("check-config", str(SAO_30B))
    assert result.returncode == 0, result.stderr
    steady, start_up, resume = peak_rows(result.stderr)["inference"]
    assert steady == start_up and resume is None  # vLLM's start-up stays within its utilization
    # one decoder layer of Qwen3-30B-A3B in bf16, split by inference.tp 2, and its communicator
    layer = (2048 + 2048 * 40 * 128 + 32 * 128 * 2048 + 2048 + 2 * 128 + 128 * 2048 + 128 * 3 * 2048 * 768) * 2 / 2
    update = steady + layer / GIB + NCCL_GIB_PER_COMMUNICATOR
    assert f"{'inference':<10}{steady:>10.2f}{start_up:>10.2f}{'-':>10}  weight update {update:.2f}" in result.stderr
    with pytest.raises(ConfigError, match=r"inference: the weight update peak \(when a new policy version is "
                                          r"received\) needs about 140\.\d GiB .* lower inference.gpu_memory_utilization"):  # fmt: skip
        load_config(SAO_30B, ["inference.gpu_memory_utilization=0.99"])


LORA_30B = next(p for p in EXAMPLES if p.name == "qwen3_30b_a3b_sao_lora.yaml")


def test_lora_expert_adapters_optimizer_state_is_sharded_over_expert_dp():
    """The 30B LoRA example's policy at EP = 2 on 2 GPUs (DP 2, expert-DP 1): rank 16 on attention
    and this rank's 64 experts of 48 layers. Adam's 12 B per element (fp32 master and two moments
    of a bfloat16 model): the attention adapters over DP, the expert adapters unsharded, 3.57 GiB
    (the plan said 1.81 with every adapter over DP). tests/distributed/test_memory_plan.py checks
    the sharding against megatron's distributed optimizer."""
    policy = memory_plan(load_config(LORA_30B))[0]
    r, h = 16, 2048
    attention = 48 * (r * h + 5120 * r + r * 4096 + h * r)  # the trainer's fused qkv: one A
    experts = 48 * 64 * (r * h + 2 * 768 * r + r * 768 + h * r)
    assert policy.parts["optimizer"] * GIB == pytest.approx(12 * (attention / 2 + experts))
    assert round(policy.parts["optimizer"], 2) == 3.57
    assert policy.parts["gradients"] * GIB == pytest.approx(4 * (attention + experts))  # unsharded, fp32


@pytest.mark.parametrize("tp, ep", [(1, 2), (2, 1)])
def test_lora_adapters_activations_are_counted_under_full_recomputation_once(tp, ep):
    """One layer is rebuilt at a time (recompute full, uniform, 1 layer), so the adapters add one
    layer's worth: per token of the 16,384, the fused linear_qkv norm's fp32 copy of x, inverse
    RMS and bf16 normalised x (4h + 4 + 2h bytes), and the rank-16 products of qkv, proj and the
    8 routed copies through fc1 and fc2, in bf16. At TP = 2 (sequence parallel) the norm and
    proj's product are this rank's half of the sequence."""
    resolved = load_config(LORA_30B, [f"model.tp={tp}", f"model.ep={ep}"])
    arch, layout, model = resolved.layout.policy_architecture, resolved.layout.policy, resolved.model
    policy = memory_plan(resolved)[0]
    without = activation_bytes(arch, layout, model.seq_len, model.dtype, model.recompute, value_model=False)
    adapters = policy.parts["activations"] * GIB + LOGPROB_CHUNK_BYTES - without
    h, share = 2048, 1 / tp
    per_token = (4 * h + 4 + 2 * h) * share + 16 * 2 * (1 + share + 8 + 8)
    assert adapters == pytest.approx(16384 * per_token)
    assert round(adapters / GIB, 3) == (0.196 if tp == 1 else 0.102)
    # the local spec (model.transformer_engine off) has separate norms: the products alone
    local = load_config(LORA_30B, [f"model.tp={tp}", f"model.ep={ep}", "model.transformer_engine='off'"])
    products = memory_plan(local)[0].parts["activations"] * GIB + LOGPROB_CHUNK_BYTES - without
    assert products == pytest.approx(16384 * 16 * 2 * (1 + share + 8 + 8))


GLM45_AIR = next(p for p in EXAMPLES if p.name == "glm45_air_sao_4nodes.yaml")


def test_glm45_air_example_is_the_published_model_and_its_parameter_count():
    """The example's inline architecture is what the builder reads from GLM-4.5-Air's config.json,
    and its parameters are the published 106B in total (the MTP layer, dropped, not counted) and
    12B active (the 8 routed experts of 128, the shared expert, attention and the dense layer,
    without the embedding and output layers: 13.4B with them)."""
    resolved = load_config(GLM45_AIR)
    arch = resolved.layout.policy_architecture
    assert arch == Architecture.from_hf_config(GLM_45_AIR, "GLM-4.5-Air")
    assert resolved.value.model.architecture == arch
    single = ModelLayout(world_size=1, tp=1, cp=1, pp=1, ep=1, dp=1, expert_dp=1)
    params = rank_parameters(arch, single)
    assert params.total == pytest.approx(106.85e9, rel=1e-3)
    embeddings = 2 * arch.vocab_size * arch.hidden_size
    active = params.dense + params.expert * arch.num_experts_per_tok / arch.num_experts
    assert active - embeddings == pytest.approx(12.2e9, rel=0.01)


def test_glm45_air_example_fits_on_four_h200_nodes_and_not_on_three():
    """The layout its header explains, as check-config plans it: 2 vLLM servers at TP=4 on node 0,
    the policy at EP=16 on nodes 1-2, the critic at EP=8 on node 3 with a tenth of its Adam state
    on the GPUs; the policy on one node (EP=8) is refused: 1810 GiB of host memory."""
    resolved = load_config(GLM45_AIR)
    assert resolved.layout.deployment_style == "dedicated" and resolved.deployment.nodes == 4
    assert (resolved.layout.policy.ep, resolved.layout.policy.dp, resolved.layout.policy.expert_dp) == (16, 16, 1)
    assert (resolved.layout.critic.world_size, resolved.layout.critic.ep) == (8, 8)
    result = run_cli("check-config", str(GLM45_AIR))
    assert result.returncode == 0, result.stderr
    peaks = peak_rows(result.stderr)
    assert peaks["policy"] == (100.24, 92.61, 81.01)
    assert peaks["critic"] == (116.40, 115.86, 109.11)
    assert peaks["inference"][:2] == (119.34, 119.34) and "weight update 121.43" in result.stderr
    assert "GPUs: inference 8 + critic 8 + policy 16 = 32 of 4 node(s) x 8 = 32" in result.stderr
    hosts = {name: round(gib) for name, gib, _ in node_host_memory(resolved, memory_plan(resolved))}
    assert hosts == {"policy node": 924, "critic node": 1552}
    full_offload = load_config(GLM45_AIR, ["value.optimizer.offload_fraction=1.0"])
    assert {n: round(g) for n, g, _ in node_host_memory(full_offload, memory_plan(full_offload))}["critic node"] == 1720
    with pytest.raises(ConfigError, match=r"a policy node needs about 1810 GiB of host memory .* more than "
                                          r"deployment.host_memory_gib = 1800"):  # fmt: skip
        load_config(GLM45_AIR, ["model.ep=8", "deployment.policy_gpus=8", "deployment.nodes=3"])
