"""Parameter-name helpers shared by conversion and sharding (pure)."""

from megatron_rl.models.sharding import canonical_name, local_to_global_name


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
