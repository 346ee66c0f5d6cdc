"""Parameter-name helpers shared by conversion and sharding (pure)."""

import pytest

from megatron_rl.models.sharding import canonical_name, local_to_global_name, partition_axis


def test_te_fused_norm_names_map_to_local_names():
    assert canonical_name("decoder.layers.3.self_attention.linear_qkv.layer_norm_weight") == (
        "decoder.layers.3.input_layernorm.weight"
    )
    assert (
        canonical_name("decoder.layers.0.mlp.linear_fc1.layer_norm_weight")
        == "decoder.layers.0.pre_mlp_layernorm.weight"
    )
    assert (
        canonical_name("decoder.layers.0.mlp.linear_fc1.weight") == "decoder.layers.0.mlp.linear_fc1.weight"
    )


def test_local_to_global_name_offsets_layers_and_experts():
    name = "decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight"
    assert (
        local_to_global_name(name, 4, 8) == "decoder.layers.5.mlp.experts.local_experts.10.linear_fc1.weight"
    )
    assert local_to_global_name("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight", 2, 0) == (
        "decoder.layers.2.input_layernorm.weight"
    )
    assert (
        local_to_global_name("embedding.word_embeddings.weight", 4, 8) == "embedding.word_embeddings.weight"
    )


def test_te_grouped_expert_names_map_to_per_expert_names():
    assert canonical_name("decoder.layers.2.mlp.experts.linear_fc1.weight7") == (
        "decoder.layers.2.mlp.experts.local_experts.7.linear_fc1.weight"
    )
    assert local_to_global_name("decoder.layers.1.mlp.experts.linear_fc2.weight3", 4, 8) == (
        "decoder.layers.5.mlp.experts.local_experts.11.linear_fc2.weight"
    )


def test_partition_axis_comes_from_the_module_kind():
    column = [
        "embedding.word_embeddings.weight",
        "output_layer.weight",
        "decoder.layers.0.self_attention.linear_qkv.weight",
        "decoder.layers.0.mlp.linear_fc1.weight",
        "decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight",
        "decoder.layers.0.mlp.experts.linear_fc1.weight3",  # TE grouped GEMM
        "decoder.layers.0.self_attention.linear_qkv.lora_b",  # a column layer's B
        "decoder.layers.0.self_attention.linear_qkv.base.weight",  # wrapped by LoRA
    ]
    row = [
        "decoder.layers.0.self_attention.linear_proj.weight",
        "decoder.layers.0.mlp.linear_fc2.weight",
        "decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.weight",  # TE says partition_dim 0
        "decoder.layers.0.mlp.experts.linear_fc2.weight3",
        "decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.lora_a",  # a row layer's A
    ]
    assert [partition_axis(n) for n in column] == [0] * len(column)
    assert [partition_axis(n) for n in row] == [1] * len(row)
    with pytest.raises(ValueError, match="decoder.layers.0.mlp.router.weight: a tensor-parallel parameter"):
        partition_axis("decoder.layers.0.mlp.router.weight")
