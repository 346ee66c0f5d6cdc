"""spec_keys.plan_load on synthetic sharded state dicts with the keys each layer spec writes
(the same mapping on real models of both specs: tests/distributed/test_te_layouts.py)."""

from __future__ import annotations

import megatron_rl.compat  # noqa: F401  (megatron-core on CPU needs its patches first)

import torch
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

from megatron_rl.conversion.spec_keys import plan_load

LAYERS = 3


def tensor(key: str, layer: int = 0) -> ShardedTensor:
    data = torch.randn(8, generator=torch.Generator().manual_seed(layer))
    return ShardedTensor.from_rank_offsets(key, data, (0, layer, LAYERS), replica_id=0, prepend_axis_num=1)


def extra_state(key: str, layer: int = 0) -> ShardedObject:
    return ShardedObject(key, None, (LAYERS,), (layer,), replica_id=0)


# The checkpoint keys of one MoE layer under each spec (norms and attention; experts alike).
LOCAL_MOE_KEYS = {
    "decoder.layers.self_attention.linear_qkv.layer_norm_weight",
    "decoder.layers.self_attention.linear_qkv.weight",
    "decoder.layers.self_attention.linear_qkv._extra_state",
    "decoder.layers.self_attention.q_layernorm.weight",
    "decoder.layers.mlp.linear_fc1.layer_norm_weight",
}
TE_MOE_KEYS = {
    "decoder.layers.self_attention.linear_qkv.layer_norm_weight",
    "decoder.layers.self_attention.linear_qkv.weight",
    "decoder.layers.self_attention.linear_qkv._extra_state",
    "decoder.layers.self_attention.q_layernorm.weight",
    "decoder.layers.self_attention.q_layernorm._extra_state",
    "decoder.layers.pre_mlp_layernorm.weight",
    "decoder.layers.pre_mlp_layernorm._extra_state",
}


def te_moe_layer(layer: int) -> dict:
    prefix = f"decoder.layers.{layer}."
    return {
        prefix + "self_attention.linear_qkv.layer_norm_weight": tensor(
            "decoder.layers.self_attention.linear_qkv.layer_norm_weight", layer
        ),
        prefix + "self_attention.linear_qkv.weight": tensor(
            "decoder.layers.self_attention.linear_qkv.weight", layer
        ),
        prefix + "self_attention.linear_qkv._extra_state": extra_state(
            "decoder.layers.self_attention.linear_qkv._extra_state", layer
        ),
        prefix + "self_attention.q_layernorm.weight": tensor(
            "decoder.layers.self_attention.q_layernorm.weight", layer
        ),
        prefix + "self_attention.q_layernorm._extra_state": extra_state(
            "decoder.layers.self_attention.q_layernorm._extra_state", layer
        ),
        prefix + "pre_mlp_layernorm.weight": tensor("decoder.layers.pre_mlp_layernorm.weight", layer),
        prefix + "pre_mlp_layernorm._extra_state": extra_state(
            "decoder.layers.pre_mlp_layernorm._extra_state", layer
        ),
    }


def local_moe_layer(layer: int) -> dict:
    prefix = f"decoder.layers.{layer}."
    return {
        prefix + "input_layernorm.weight": tensor(
            "decoder.layers.self_attention.linear_qkv.layer_norm_weight", layer
        ),
        prefix + "self_attention.linear_qkv.weight": tensor(
            "decoder.layers.self_attention.linear_qkv.weight", layer
        ),
        prefix + "self_attention.linear_qkv._extra_state": extra_state(
            "decoder.layers.self_attention.linear_qkv._extra_state", layer
        ),
        prefix + "self_attention.q_layernorm.weight": tensor(
            "decoder.layers.self_attention.q_layernorm.weight", layer
        ),
        prefix + "pre_mlp_layernorm.weight": tensor("decoder.layers.mlp.linear_fc1.layer_norm_weight", layer),
    }


def test_a_te_moe_model_loads_a_local_checkpoint():
    template = {k: v for layer in range(LAYERS) for k, v in te_moe_layer(layer).items()}
    plan = plan_load(template, LOCAL_MOE_KEYS)
    assert {plan.state_dict[k].key for k in plan.state_dict} <= LOCAL_MOE_KEYS
    assert plan.renamed == {
        f"decoder.layers.{layer}.pre_mlp_layernorm.weight": "decoder.layers.mlp.linear_fc1.layer_norm_weight"
        for layer in range(LAYERS)
    }
    assert sorted(plan.left_out) == sorted(
        f"decoder.layers.{layer}.{module}._extra_state"
        for layer in range(LAYERS)
        for module in ("self_attention.q_layernorm", "pre_mlp_layernorm")
    )
    for name, entry in plan.state_dict.items():
        # Renamed entries are copies with the same data and layer offset; the model's are untouched.
        assert entry.global_offset == template[name].global_offset
        if name in plan.renamed:
            assert entry is not template[name] and entry.data is template[name].data
            assert template[name].key == "decoder.layers.pre_mlp_layernorm.weight"


def test_a_local_moe_model_loads_a_te_checkpoint():
    template = {k: v for layer in range(LAYERS) for k, v in local_moe_layer(layer).items()}
    plan = plan_load(template, TE_MOE_KEYS)
    assert {entry.key for entry in plan.state_dict.values()} <= TE_MOE_KEYS
    assert set(plan.renamed.values()) == {"decoder.layers.pre_mlp_layernorm.weight"}
    assert plan.left_out == []  # TE's extra state in the checkpoint is simply not asked for


def test_keys_both_have_and_keys_neither_renames_stay():
    template = {k: v for k, v in local_moe_layer(0).items()}
    plan = plan_load(template, LOCAL_MOE_KEYS)
    assert plan.renamed == {} and plan.left_out == [] and plan.state_dict == template
    # A key with no counterpart in the checkpoint stays, so the load names it as missing.
    stray = {"decoder.layers.0.mlp.router.weight": tensor("decoder.layers.mlp.router.weight")}
    plan = plan_load(stray, TE_MOE_KEYS)
    assert plan.state_dict == stray and plan.renamed == {} and plan.left_out == []
