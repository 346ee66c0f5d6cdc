"""config/model.py and models/builder.py for the sigmoid-router MoE families (GLM-4.5's glm4_moe):
what an HF config maps to, what is refused (naming the field), and the megatron settings it
gives. Pure: the models themselves are compared with transformers in tests/distributed."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.config import Architecture
from megatron_rl.conversion.hf_mapping import ConversionError, hf_to_megatron, megatron_to_hf
from megatron_rl.models import builder

# GLM-4.5-Air's config.json (zai-org/GLM-4.5-Air), the fields we read
GLM_45_AIR = {
    "model_type": "glm4_moe", "hidden_size": 4096, "num_hidden_layers": 46, "num_attention_heads": 96,
    "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 10944, "vocab_size": 151552,
    "n_routed_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 1408, "n_shared_experts": 1,
    "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0, "first_k_dense_replace": 1,
    "norm_topk_prob": True, "use_qk_norm": False, "attention_bias": True, "partial_rotary_factor": 0.5,
    "rope_theta": 1000000, "rope_scaling": None, "rms_norm_eps": 1e-05, "max_position_embeddings": 131072,
    "num_nextn_predict_layers": 1, "hidden_act": "silu", "tie_word_embeddings": False,
}  # fmt: skip
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
