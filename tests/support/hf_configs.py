"""Published Hugging Face config.json files, the fields the builder reads: what the family tests
map and the real-scale examples (examples/configs/) are checked against. Written out, not
downloaded (no test fetches anything)."""

from __future__ import annotations

# DeepSeek-V3's config.json (deepseek-ai/DeepSeek-V3), the fields we read
DEEPSEEK_V3 = {
    "model_type": "deepseek_v3", "hidden_size": 7168, "num_hidden_layers": 61, "num_attention_heads": 128,
    "num_key_value_heads": 128, "intermediate_size": 18432, "vocab_size": 129280, "n_routed_experts": 256,
    "num_experts_per_tok": 8, "moe_intermediate_size": 2048, "n_shared_experts": 1, "n_group": 8, "topk_group": 4,
    "routed_scaling_factor": 2.5, "first_k_dense_replace": 3, "moe_layer_freq": 1, "norm_topk_prob": True,
    "scoring_func": "sigmoid", "topk_method": "noaux_tc", "kv_lora_rank": 512, "q_lora_rank": 1536,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "attention_bias": False,
    "rope_theta": 10000, "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
    "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}, "rms_norm_eps": 1e-06,
    "max_position_embeddings": 163840, "num_nextn_predict_layers": 1, "hidden_act": "silu",
    "tie_word_embeddings": False,
}  # fmt: skip
# Moonlight-16B-A3B's (moonshotai/Moonlight-16B-A3B): a full query projection, one expert group, no YaRN
MOONLIGHT = {
    **DEEPSEEK_V3, "hidden_size": 2048, "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16,
    "intermediate_size": 11264, "vocab_size": 163840, "n_routed_experts": 64, "num_experts_per_tok": 6,
    "moe_intermediate_size": 1408, "n_shared_experts": 2, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.446,
    "first_k_dense_replace": 1, "q_lora_rank": None, "rope_theta": 50000.0, "rope_scaling": None,
    "max_position_embeddings": 8192, "num_nextn_predict_layers": 0, "rms_norm_eps": 1e-05,
}  # fmt: skip
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
