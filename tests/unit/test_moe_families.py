"""config/model.py and models/builder.py for the sigmoid-router MoE families (GLM-4.5's glm4_moe):
what an HF config maps to, what is refused (naming the field), and the megatron settings it
gives. Pure: the models themselves are compared with transformers in tests/distributed."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.config import Architecture
from megatron_rl.conversion.hf_mapping import ConversionError, hf_to_megatron, megatron_to_hf
from megatron_rl.models import builder
from tests.support.hf_configs import DEEPSEEK_V3, GLM_45_AIR, MOONLIGHT

TINY_GLM = {
    **GLM_45_AIR, "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 6, "num_key_value_heads": 2,
    "head_dim": 20, "intermediate_size": 106, "vocab_size": 96, "n_routed_experts": 6, "num_experts_per_tok": 4,
    "moe_intermediate_size": 28, "n_group": 3, "topk_group": 2, "routed_scaling_factor": 1.7, "use_qk_norm": True,
}  # fmt: skip


def arch_of(config: dict) -> Architecture:
    return Architecture.from_hf_config(config, "config.json")


def test_glm_air_maps_its_moe_attention_and_rope_fields():
    arch = arch_of(GLM_45_AIR)
    assert (arch.family, arch.num_experts, arch.num_experts_per_tok) == ("glm4_moe", 128, 8)
    assert arch.moe_score_function == "sigmoid" and arch.moe_expert_bias
    assert (arch.moe_num_groups, arch.moe_group_topk) == (0, 0)  # one group: plain top-k
    assert arch.shared_expert_intermediate_size == 1408 and arch.first_k_dense_layers == 1
    assert arch.moe_layers == list(range(1, 46))
    assert arch.attention_bias and not arch.qk_norm
    assert (arch.partial_rotary_factor, arch.rotary_dim) == (0.5, 64)
    assert arch.mtp_layers == 1


def test_transformers_rope_parameters_give_the_partial_rotary_factor():
    config = {k: v for k, v in TINY_GLM.items() if k not in ("partial_rotary_factor", "rope_theta")}
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 5e5, "partial_rotary_factor": 0.25}
    arch = arch_of({**config, "head_dim": 24})
    assert (arch.partial_rotary_factor, arch.rotary_dim, arch.rope_theta) == (0.25, 6, 5e5)


@pytest.mark.parametrize(
    "change, named",
    [
        ({"num_experts_per_tok": 3}, r"num_experts_per_tok \(3\) must be 2 x topk_group \(2\)"),
        ({"n_group": 4}, r"n_group \(4\) to divide the experts \(6\)"),
        ({"norm_topk_prob": False}, "norm_topk_prob=False with num_experts_per_tok=4"),
        ({"first_k_dense_replace": 3}, r"first_k_dense_layers \(3\) needs an MoE model"),
        ({"partial_rotary_factor": 0.45}, "RoPE needs an even number"),
        ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "rope_scaling="),
        ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
        ({"mlp_only_layers": [1]}, "mlp_only_layers"),
    ],
)
def test_what_megatron_would_compute_otherwise_is_refused_naming_the_field(change, named):
    with pytest.raises(ValueError, match=named):
        arch_of({**TINY_GLM, **change})


def test_other_families_still_refuse_attention_bias_and_partial_rotary():
    qwen3 = {k: TINY_GLM[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                      "num_key_value_heads", "intermediate_size", "vocab_size")}  # fmt: skip
    with pytest.raises(ValueError, match="attention_bias=True is not supported by the qwen3 builder"):
        arch_of({**qwen3, "model_type": "qwen3", "attention_bias": True})
    with pytest.raises(ValueError, match="partial_rotary_factor=0.5 is not supported by the llama builder"):
        arch_of({**qwen3, "model_type": "llama", "partial_rotary_factor": 0.5})


def test_megatron_settings_route_as_transformers_with_the_bias_frozen():
    config = builder.transformer_config(arch_of(TINY_GLM))
    assert config.moe_router_score_function == "sigmoid"
    assert config.moe_router_enable_expert_bias and config.moe_router_bias_update_rate == 0.0
    assert (config.moe_router_num_groups, config.moe_router_group_topk) == (3, 2)
    assert config.moe_router_topk_scaling_factor == 1.7
    assert config.moe_shared_expert_intermediate_size == 28 and config.moe_shared_expert_gate is False
    assert config.moe_layer_freq == [0, 1, 1] and config.add_qkv_bias and config.qk_layernorm
    # without dense first layers the layers stay homogeneous (checkpoint keys of the other families)
    plain = builder.transformer_config(arch_of({**TINY_GLM, "first_k_dense_replace": 0}))
    assert plain.moe_layer_freq == 1


def test_partial_rotary_with_context_parallelism_is_refused():
    with pytest.raises(ValueError, match=r"partial_rotary_factor 0.5: the Ulysses core attention rotates whole"):
        builder.layer_spec(arch_of(TINY_GLM), context_parallel_size=2, transformer_engine=False)


def random_hf_state(arch: Architecture, extra_layers: int = 0) -> dict[str, torch.Tensor]:
    """Random HF tensors of every name the mapping has, plus `extra_layers` MTP layers' worth."""
    from megatron_rl.conversion.hf_mapping import family_mapping

    generator = torch.Generator().manual_seed(0)
    shapes = {
        "q_proj.weight": (arch.num_attention_heads * arch.kv_channels, arch.hidden_size),
        "q_proj.bias": (arch.num_attention_heads * arch.kv_channels,),
        "k_proj.weight": (arch.num_key_value_heads * arch.kv_channels, arch.hidden_size),
        "k_proj.bias": (arch.num_key_value_heads * arch.kv_channels,),
    }
    state = {}
    for mapped in family_mapping(arch).tensors:
        for name in mapped.hf:
            suffix = ".".join(name.split(".")[-2:])
            kind = suffix.replace("v_proj", "k_proj")
            shape = shapes.get(kind, (5, 3) if name.endswith("weight") else (arch.num_experts,))
            state[name] = torch.randn(shape, generator=generator)
    for layer in range(arch.num_layers, arch.num_layers + extra_layers):
        state[f"model.layers.{layer}.eh_proj.weight"] = torch.randn(4, 4, generator=generator)
    return state


def test_mapping_round_trips_qkv_biases_expert_bias_shared_experts_and_drops_mtp_layers():
    arch = arch_of(TINY_GLM)
    state = random_hf_state(arch, extra_layers=1)
    megatron = hf_to_megatron(state, arch)
    assert "decoder.layers.1.mlp.router.expert_bias" in megatron
    assert "decoder.layers.2.mlp.shared_experts.linear_fc1.weight" in megatron
    assert "decoder.layers.0.mlp.linear_fc1.weight" in megatron and "decoder.layers.0.mlp.router.weight" not in megatron
    bias = megatron["decoder.layers.0.self_attention.linear_qkv.bias"]
    d, per_group = arch.kv_channels, arch.num_attention_heads // arch.num_key_value_heads
    # group 1's first query head, then its key head follow group 0's q, k, v heads
    first = (per_group + 2) * d
    assert torch.equal(bias[first : first + d], state["model.layers.0.self_attn.q_proj.bias"][per_group * d :][:d])
    assert torch.equal(bias[per_group * d : per_group * d + d], state["model.layers.0.self_attn.k_proj.bias"][:d])
    back = megatron_to_hf(megatron, arch)
    assert set(back) == {n for n in state if ".layers.3." not in n}  # the MTP layer is dropped
    for name, tensor in back.items():
        assert torch.equal(tensor, state[name]), name
    with pytest.raises(ConversionError, match="does not use"):
        hf_to_megatron(state, arch.model_copy(update=dict(mtp_layers=0)))


TINY_DEEPSEEK = {
    **DEEPSEEK_V3, "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 6, "num_key_value_heads": 6,
    "intermediate_size": 106, "vocab_size": 96, "n_routed_experts": 6, "num_experts_per_tok": 4,
    "moe_intermediate_size": 28, "n_shared_experts": 2, "n_group": 3, "topk_group": 2, "first_k_dense_replace": 1,
    "q_lora_rank": 22, "kv_lora_rank": 18, "qk_nope_head_dim": 10, "qk_rope_head_dim": 6, "v_head_dim": 14,
    "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 8.0,
                     "beta_slow": 1.0, "mscale": 0.9, "mscale_all_dim": 0.7},
}  # fmt: skip


def test_deepseek_v3_and_moonlight_map_latent_attention_routing_and_yarn():
    arch = arch_of(DEEPSEEK_V3)
    assert (arch.family, arch.num_experts, arch.num_experts_per_tok) == ("deepseek_v3", 256, 8)
    assert arch.moe_score_function == "sigmoid" and arch.moe_expert_bias and arch.moe_routed_scaling_factor == 2.5
    assert (arch.moe_num_groups, arch.moe_group_topk) == (8, 4)  # topk 8 = 2 x topk_group: megatron's groups agree
    assert arch.shared_expert_intermediate_size == 2048 and arch.moe_layers == list(range(3, 61))
    assert arch.multi_latent_attention and (arch.q_lora_rank, arch.kv_lora_rank) == (1536, 512)
    assert (arch.qk_nope_head_dim, arch.qk_rope_head_dim, arch.v_head_dim, arch.kv_channels) == (128, 64, 128, 192)
    assert not arch.rope_halves and arch.mtp_layers == 1  # transformers' default rope_interleave: pairs
    assert arch.rope_yarn.model_dump() == {"factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                                           "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}  # fmt: skip
    moonlight = arch_of(MOONLIGHT)
    assert moonlight.q_lora_rank is None and moonlight.rope_yarn is None and moonlight.rope_theta == 50000.0
    # one group with topk_group 1 is plain top-k (6 experts of 64), not refused as 6 != 2 x 1
    assert (moonlight.moe_num_groups, moonlight.moe_group_topk, moonlight.num_experts_per_tok) == (0, 0, 6)
    assert moonlight.shared_expert_intermediate_size == 2 * 1408 and moonlight.mtp_layers == 0


def test_megatron_latent_attention_settings_give_transformers_softmax_and_rope_scales():
    import math

    from megatron.core.transformer.transformer_config import MLATransformerConfig

    config = builder.transformer_config(arch_of(TINY_DEEPSEEK))
    assert isinstance(config, MLATransformerConfig) and config.multi_latent_attention
    assert (config.q_lora_rank, config.kv_lora_rank, config.qk_head_dim, config.qk_pos_emb_head_dim,
            config.v_head_dim) == (22, 18, 10, 6, 14)  # fmt: skip
    assert (config.rope_type, config.rotary_scaling_factor, config.original_max_position_embeddings) == ("yarn", 4.0, 16)
    assert (config.beta_fast, config.beta_slow, config.mscale, config.mscale_all_dim) == (8.0, 1.0, 0.9, 0.7)
    assert config.moe_shared_expert_intermediate_size == 56 and config.moe_layer_freq == [0, 1, 1]
    assert config.moe_router_topk_scaling_factor == 2.5 and config.moe_router_bias_update_rate == 0.0
    plain = builder.transformer_config(arch_of(MOONLIGHT))
    assert (plain.rope_type, plain.q_lora_rank, plain.rotary_base) == ("rope", None, 50000.0)
    # megatron's softmax scale is yarn(rotary_scaling_factor, mscale_all_dim)^2 / sqrt(q head dim): 1 / sqrt(192)
    # for plain RoPE (mscale_all_dim 0), as transformers' DeepseekV3Attention.scaling
    from megatron.core.models.common.embeddings import _yarn_get_mscale

    assert _yarn_get_mscale(plain.rotary_scaling_factor, plain.mscale_all_dim) == 1.0
    yarn = 0.1 * 0.7 * math.log(4.0) + 1.0
    assert _yarn_get_mscale(config.rotary_scaling_factor, config.mscale_all_dim) == pytest.approx(yarn)


@pytest.mark.parametrize(
    "change, named",
    [
        ({"moe_layer_freq": 2}, "moe_layer_freq=2 is not supported"),
        ({"scoring_func": "softmax"}, "scoring_func='softmax' is not supported"),
        ({"topk_method": "group_limited_greedy"}, "topk_method='group_limited_greedy'"),
        ({"attention_bias": True}, "attention_bias=True is not supported by the deepseek_v3 builder"),
        ({"num_experts_per_tok": 6}, r"num_experts_per_tok \(6\) must be 2 x topk_group \(2\)"),
        ({"num_key_value_heads": 2}, r"num_key_value_heads \(2\) must equal num_attention_heads \(6\)"),
        ({"qk_rope_head_dim": 5}, "an even qk_rope_head_dim"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_scaling type 'dynamic'"),
        ({"rope_scaling": {**TINY_DEEPSEEK["rope_scaling"], "attention_factor": 1.2}}, r"rope_scaling.attention_factor=1.2"),
        ({"rope_scaling": {**TINY_DEEPSEEK["rope_scaling"], "mscale": None}}, r"rope_scaling.mscale="),
        ({"rope_scaling": {**TINY_DEEPSEEK["rope_scaling"], "factor": None}}, r"rope_scaling.factor="),
    ],
)
def test_deepseek_settings_megatron_would_compute_otherwise_are_refused(change, named):
    with pytest.raises(ValueError, match=named):
        arch_of({**TINY_DEEPSEEK, **change})


def test_an_inline_latent_attention_architecture_refuses_a_head_dim():
    with pytest.raises(ValueError, match="multi-latent attention takes no .* head_dim"):
        Architecture(**{**arch_of(TINY_DEEPSEEK).model_dump(), "head_dim": 16})


def test_yarn_without_mscale_all_dim_takes_transformers_cos_sin_factor():
    """transformers scales cos/sin by yarn(factor, 1) unless both mscale and mscale_all_dim are set."""
    arch = arch_of({**TINY_DEEPSEEK, "rope_scaling": {**TINY_DEEPSEEK["rope_scaling"], "mscale_all_dim": 0}})
    assert (arch.rope_yarn.mscale, arch.rope_yarn.mscale_all_dim) == (1.0, 0.0)


def test_latent_attention_with_context_parallelism_is_refused_by_the_config_and_the_builder():
    from megatron_rl.config.layout import model_layout
    from megatron_rl.config.model import ModelConfig

    arch = arch_of(TINY_DEEPSEEK)
    errors: list[str] = []
    model_layout(ModelConfig(architecture=arch, seq_len=64, cp=2), arch, 2, "model", errors)
    assert any("model.cp: context parallelism (cp 2) with multi-latent attention" in e for e in errors), errors
    with pytest.raises(ValueError, match=r"multi-latent attention \(deepseek_v3\): the Ulysses core attention"):
        builder.layer_spec(arch, context_parallel_size=2, transformer_engine=False)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("q_lora_rank", [22, None])
def test_latent_attention_mapping_round_trips_and_interleaves_rope_rows_stored_as_halves(interleaved, q_lora_rank):
    """megatron's MLA rotates RoPE channels stored as interleaved pairs (DeepSeek's layout): such a
    checkpoint is renamed; one whose channels are halves (rope_interleave false) has each head's
    RoPE rows interleaved (q) and the shared key's (kv_a), and taken apart again on the way back."""
    arch = arch_of({**TINY_DEEPSEEK, "rope_interleave": interleaved, "q_lora_rank": q_lora_rank})
    heads, nope, rope, latent = 6, 10, 6, 18
    q_name = "q_b_proj" if q_lora_rank else "q_proj"
    q_in = q_lora_rank or arch.hidden_size
    generator = torch.Generator().manual_seed(0)
    state = {}
    from megatron_rl.conversion.hf_mapping import family_mapping

    shapes = {q_name: (heads * (nope + rope), q_in), "kv_a_proj_with_mqa": (latent + rope, arch.hidden_size)}
    for mapped in family_mapping(arch).tensors:
        for name in mapped.hf:
            module = name.split(".")[-2]
            state[name] = torch.randn(shapes.get(module, (5, 3) if name.endswith("weight") else (6,)), generator=generator)
    # DeepSeek-V3's MTP layer (num_nextn_predict_layers 1) after the decoder's 3: dropped
    mtp = {"model.layers.3.self_attn.kv_a_proj_with_mqa.weight": torch.randn(4, 4), "model.layers.3.eh_proj.weight": torch.randn(4, 4)}
    megatron = hf_to_megatron({**state, **mtp}, arch)
    attention = "decoder.layers.1.self_attention."
    q = megatron[attention + ("linear_q_up_proj.weight" if q_lora_rank else "linear_q_proj.weight")]
    hf_q = state[f"model.layers.1.self_attn.{q_name}.weight"]
    assert (attention + "linear_q_down_proj.weight" in megatron) == bool(q_lora_rank)
    kv = megatron[attention + "linear_kv_down_proj.weight"]
    hf_kv = state["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"]
    assert torch.equal(kv[:latent], hf_kv[:latent])
    head = slice(nope + rope, 2 * (nope + rope))  # the second head
    assert torch.equal(q[head][:nope], hf_q[head][:nope])
    if interleaved:
        assert torch.equal(q, hf_q) and torch.equal(kv, hf_kv)
    else:  # halves (a0 a1 a2 | b0 b1 b2) -> pairs (a0 b0 a1 b1 a2 b2)
        pairs = [0, 3, 1, 4, 2, 5]
        assert torch.equal(q[head][nope:], hf_q[head][nope:][pairs])
        assert torch.equal(kv[latent:], hf_kv[latent:][pairs])
    back = megatron_to_hf(megatron, arch)
    assert set(back) == set(state)
    for name, tensor in back.items():
        assert torch.equal(tensor, state[name]), name


def test_memory_plan_counts_deepseek_v3_and_moonlight_at_their_published_sizes_and_latent_kv():
    """The plan's parameters (multi-latent attention's projections and latent norms, shared
    experts, dense first layers) against the published sizes: DeepSeek-V3 671B total without its
    MTP layer, 37B activated; Moonlight-16B-A3B. vLLM caches MLA's kv latent and shared rotary key,
    kv_lora_rank + qk_rope_head_dim 16-bit numbers a layer and token, on every TP rank whole."""
    from megatron_rl.config.layout import ModelLayout
    from megatron_rl.config.memory_plan import kv_bytes_per_token
    from megatron_rl.config.model_memory import rank_parameters
    from megatron_rl.sim.models import active_parameters

    one_gpu = ModelLayout(world_size=1, tp=1, cp=1, pp=1, ep=1, dp=1, expert_dp=1)
    for config, total, active in ((DEEPSEEK_V3, 671e9, 37e9), (MOONLIGHT, 16e9, 3e9)):
        arch = arch_of(config)
        counted = rank_parameters(arch, one_gpu, value_model=False, freeze_attention=False, stage=0).total
        assert counted == pytest.approx(total, rel=0.003)
        embedding = arch.hidden_size * arch.vocab_size
        assert active_parameters(arch, lm_head=True) + embedding == pytest.approx(active, rel=0.03)
    deepseek = arch_of(DEEPSEEK_V3)
    assert {kv_bytes_per_token(deepseek, tp) for tp in (1, 8)} == {61 * (512 + 64) * 2}
    # 128 heads of k (192) and v (128) a token would be 71x more
    assert kv_bytes_per_token(deepseek.model_copy(update=dict(kv_lora_rank=0, q_lora_rank=None, rope_yarn=None,
                                                              rope_halves=False, head_dim=160)), 1) > 70 * 61 * 576 * 2  # fmt: skip


MLA_LINEARS = ["linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj", "linear_proj"]


def test_lora_on_latent_attention_adapts_its_linears_and_refuses_a_target_it_lacks():
    """A LoRA section that leaves target_modules unset adapts every linear of the model: with MLA its
    q down/up projections (or q_proj without q_lora_rank), kv down/up projections, linear_proj and the
    MLP's, written into the section; a named target the model does not have (linear_qkv on MLA, an
    MLA linear on standard attention, q_up without q_lora_rank) is an error naming target_modules."""
    from megatron_rl.config import LORA_TARGETS
    from megatron_rl.config.layout import lora_plan
    from megatron_rl.config.model import LoraConfig

    deepseek, errors = arch_of(TINY_DEEPSEEK), []
    section = LoraConfig(rank=4)
    plan = lora_plan(section, "value.lora", deepseek, None, errors)
    assert errors == [] and plan.target_modules == section.target_modules == [*MLA_LINEARS, "linear_fc1", "linear_fc2"]
    assert plan.adapts_experts
    q_proj = arch_of({**TINY_DEEPSEEK, "q_lora_rank": None})
    assert lora_plan(LoraConfig(rank=4), "lora", q_proj, None, errors).target_modules[:2] == ["linear_q_proj",
                                                                                               "linear_kv_down_proj"]  # fmt: skip
    assert lora_plan(LoraConfig(rank=4), "lora", arch_of(TINY_GLM), None, errors).target_modules == list(LORA_TARGETS)
    assert errors == []
    lora_plan(LoraConfig(rank=4, target_modules=["linear_qkv", "linear_proj"]), "lora", deepseek, None, errors)
    lora_plan(LoraConfig(rank=4, target_modules=["linear_q_up_proj"]), "value.lora", q_proj, None, errors)
    lora_plan(LoraConfig(rank=4, target_modules=["linear_kv_up_proj"]), "lora", arch_of(TINY_GLM), None, errors)
    assert errors == [
        "lora.target_modules: ['linear_qkv'] are not linears of this deepseek_v3 model (multi-latent attention); its "
        f"linears are {[*MLA_LINEARS, 'linear_fc1', 'linear_fc2']} (leave target_modules unset for all of them)",
        "value.lora.target_modules: ['linear_q_up_proj'] are not linears of this deepseek_v3 model (multi-latent "
        "attention, q_lora_rank null); its linears are ['linear_q_proj', 'linear_kv_down_proj', 'linear_kv_up_proj', "
        "'linear_proj', 'linear_fc1', 'linear_fc2'] (leave target_modules unset for all of them)",
        "lora.target_modules: ['linear_kv_up_proj'] are not linears of this glm4_moe model (standard attention); its "
        "linears are ['linear_qkv', 'linear_proj', 'linear_fc1', 'linear_fc2'] (leave target_modules unset for all of them)",
    ]  # fmt: skip


def test_lora_on_latent_attention_is_served_merged():
    """vLLM absorbs kv_b_proj into its MLA attention at load, so an adapter served beside the model
    would not act in decode: serve auto gives merged weights, serve adapter is refused naming it."""
    from megatron_rl.config.layout import lora_plan
    from megatron_rl.config.model import PolicyLoraConfig

    deepseek, errors = arch_of(TINY_DEEPSEEK), []
    for backend in ("vllm", "vllm-cpu"):
        plan = lora_plan(PolicyLoraConfig(rank=4), "lora", deepseek, backend, errors)
        assert plan.serve == "merged" and "kv_b_proj vLLM absorbs" in plan.serve_reason
    assert errors == []
    assert lora_plan(PolicyLoraConfig(rank=4, serve="adapter"), "lora", deepseek, "vllm", errors).serve == "merged"
    assert len(errors) == 1 and errors[0].startswith("lora.serve: adapter: deepseek_v3 has multi-latent attention")
    glm = lora_plan(PolicyLoraConfig(rank=4, serve="adapter", target_modules=["linear_qkv"]), "lora", arch_of(TINY_GLM),
                    "vllm", errors)  # fmt: skip
    assert glm.serve == "adapter" and len(errors) == 1


def test_latent_attention_at_tp_above_1_on_the_local_spec_needs_latents_that_divide():
    """On megatron's local spec (the cpu device, or transformer_engine off) MLA's down-projections are
    split over TP: their outputs must divide by tp, naming model.tp. TE's spec (cuda) runs them
    whole. (The shared RoPE key's gradient at TP > 1: the compat patch, tests/distributed/test_mla_tp.py.)"""
    from megatron_rl.config.layout import model_layout
    from megatron_rl.config.model import ModelConfig

    def problems(arch, tp, device="cpu", te="required", where="model"):
        errors: list[str] = []
        model_layout(ModelConfig(architecture=arch, seq_len=66, tp=tp, transformer_engine=te), arch, tp, where,
                     errors, device)  # fmt: skip
        return errors

    deepseek = arch_of(TINY_DEEPSEEK)  # q latent 22, kv latent 18 + RoPE key 6
    assert problems(deepseek, 1) == problems(deepseek, 2) == problems(deepseek, 2, "cuda") == []
    assert problems(deepseek, 3, "cuda") == []
    (q,) = problems(deepseek, 3)  # 22 % 3
    assert q == ("model.tp: q_lora_rank (22) must be divisible by tp (3): on megatron's local layer spec "
                 "(deployment.device cpu) multi-latent attention splits its down-projections over TP")  # fmt: skip
    odd_kv = arch_of({**TINY_DEEPSEEK, "kv_lora_rank": 17})
    (kv,) = problems(odd_kv, 2, "cuda", "off", "value.model")
    assert kv.startswith("value.model.tp: kv_lora_rank + qk_rope_head_dim (23) must be divisible by tp (2)")
    assert "(model.transformer_engine off)" in kv
    assert problems(arch_of(TINY_GLM), 2) == []


@pytest.mark.parametrize("key", ["scoring_func", "topk_method"])
def test_a_deepseek_config_must_name_the_routing_vllm_reads(key):
    """transformers' deepseek_v3 routes by sigmoid scores plus the expert bias whatever the config
    says; vLLM reads scoring_func (default softmax) and topk_method (default: no expert bias)."""
    with pytest.raises(ValueError, match=f"{key}='absent"):
        arch_of({k: v for k, v in TINY_DEEPSEEK.items() if k != key})


@pytest.mark.parametrize("interleaved, q_lora_rank", [(False, 22), (True, None)])
def test_peft_export_of_latent_attention_adapters_is_the_merged_weights_in_hf_names(interleaved, q_lora_rank):
    """Adapters on every MLA linear exported in PEFT's format (transforms/peft.py) land on HF's modules
    (q_a_proj, q_b_proj or q_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj), and the HF weight plus
    (alpha / rank) B A of each is the merged megatron weight converted to HF (B's RoPE rows reordered
    with the weight's where the checkpoint stores halves); the reverse gives the adapters back."""
    from megatron_rl.config.model_memory import _adapted_linears
    from megatron_rl.conversion.hf_mapping import family_mapping
    from megatron_rl.transforms.lora import merge_adapter_tensors
    from megatron_rl.transforms.peft import (
        PREFIX,
        hf_target_modules,
        megatron_adapters_to_peft,
        peft_to_megatron_adapters,
    )

    arch = arch_of({**TINY_DEEPSEEK, "rope_interleave": interleaved, "q_lora_rank": q_lora_rank})
    rank, alpha, generator = 4, 8.0, torch.Generator().manual_seed(1)
    shapes = {target: (fan_out, fan_in) for target, fan_in, fan_out, _ in _adapted_linears(arch)}
    mapped = {m.megatron: m for m in family_mapping(arch).tensors}
    full, adapters = {}, {}
    for target in MLA_LINEARS if q_lora_rank else ["linear_q_proj", *MLA_LINEARS[2:]]:
        layer = f"decoder.layers.1.self_attention.{target}"
        out, fan_in = shapes[target]
        full[f"{layer}.weight"] = torch.randn(out, fan_in, generator=generator)
        adapters[f"{layer}.lora_a"] = torch.randn(rank, fan_in, generator=generator)
        adapters[f"{layer}.lora_b"] = torch.randn(out, rank, generator=generator)
    merged = merge_adapter_tensors({**full, **adapters}, alpha)
    peft = megatron_adapters_to_peft(adapters, arch)
    expected = ["kv_a_proj_with_mqa", "kv_b_proj", "o_proj"] + (["q_a_proj", "q_b_proj"] if q_lora_rank else ["q_proj"])
    assert hf_target_modules(peft) == expected
    for name, weight in full.items():
        (hf_name,), split = mapped[name].hf, mapped[name].split or (lambda w, arch: (w,))
        module = PREFIX + hf_name[: -len(".weight")]
        (hf_weight,), (hf_merged,) = split(weight, arch), split(merged[name], arch)
        with_adapter = hf_weight + (alpha / rank) * peft[f"{module}.lora_B.weight"] @ peft[f"{module}.lora_A.weight"]
        torch.testing.assert_close(with_adapter, hf_merged, atol=1e-5, rtol=1e-5)
    back = peft_to_megatron_adapters(peft, arch)
    assert back.keys() == adapters.keys() and all(torch.equal(back[k], v) for k, v in adapters.items())
