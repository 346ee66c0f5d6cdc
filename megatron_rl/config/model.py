"""A Megatron model's config: its architecture (from an HF config.json or inline), parallel
degrees, dtype, recomputation; the optimizer; LoRA."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from megatron_rl.config.base import Strict

Family = Literal["qwen3", "qwen3_moe", "llama"]

# HF `model_type` -> our family name. A family is supported when its builder mapping exists.
HF_MODEL_TYPES: dict[str, Family] = {"qwen3": "qwen3", "qwen3_moe": "qwen3_moe", "llama": "llama"}


class Architecture(Strict):
    """The backbone's shape, in Hugging Face terms (read from config.json or written inline)."""

    family: Family
    hidden_size: int = Field(gt=0)
    num_layers: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_key_value_heads: int = Field(gt=0)
    head_dim: int | None = Field(default=None, gt=0)
    intermediate_size: int = Field(gt=0)
    vocab_size: int = Field(gt=0)
    num_experts: int = Field(default=0, ge=0)
    num_experts_per_tok: int = Field(default=0, ge=0)
    moe_intermediate_size: int = Field(default=0, ge=0)
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = Field(default=4096, gt=0)
    tie_word_embeddings: bool = False
    qk_norm: bool = False
    moe_norm_topk_prob: bool = True  # renormalise the top-k router probabilities (Qwen3-MoE)

    @model_validator(mode="after")
    def _check(self) -> Architecture:
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
        return self

    @property
    def kv_channels(self) -> int:
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
        unsupported = {
            "rope_scaling": config.get("rope_scaling"),
            "rope_parameters.rope_type": None if rope_type == "default" else rope_type,
            "attention_bias": config.get("attention_bias"),
            "mlp_bias": config.get("mlp_bias"),
            "mlp_only_layers": config.get("mlp_only_layers") or None,
            "decoder_sparse_step": None
            if config.get("decoder_sparse_step", 1) == 1
            else config["decoder_sparse_step"],
        }
        for key, value in unsupported.items():
            if value:
                raise ValueError(f"{source}: {key}={value!r} is not supported by the {family} builder yet")
        return cls(
            family=family,
            hidden_size=config["hidden_size"],
            num_layers=config["num_hidden_layers"],
            num_attention_heads=config["num_attention_heads"],
            num_key_value_heads=config.get("num_key_value_heads", config["num_attention_heads"]),
            head_dim=config.get("head_dim"),
            intermediate_size=config["intermediate_size"],
            vocab_size=config["vocab_size"],
            num_experts=config.get("num_experts") or config.get("num_local_experts") or 0,
            num_experts_per_tok=config.get("num_experts_per_tok", 0) or 0,
            moe_intermediate_size=config.get("moe_intermediate_size", 0) or 0,
            rope_theta=config.get("rope_theta") or rope.get("rope_theta") or 10000.0,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            max_position_embeddings=config.get("max_position_embeddings", 4096),
            tie_word_embeddings=config.get("tie_word_embeddings", False),
            qk_norm=family in ("qwen3", "qwen3_moe"),
            moe_norm_topk_prob=config.get("norm_topk_prob", True),
        )


class RecomputeConfig(Strict):
    """Activation recomputation (megatron's recompute_granularity / _method / _num_layers):
    `selective` recomputes the core attention; `full` recomputes whole layers, `method` uniform
    (every `num_layers` layers form one checkpointed unit) or block (the first `num_layers`
    layers of each pipeline stage are checkpointed)."""

    granularity: Literal["none", "selective", "full"] = "none"
    method: Literal["uniform", "block"] | None = None
    num_layers: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _full_needs_method(self) -> RecomputeConfig:
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

    hf_config: str | None = None  # a directory holding config.json
    architecture: Architecture | None = None  # inline alternative to hf_config
    checkpoint: str | None = None  # weights: an HF directory or a converted Megatron checkpoint
    seq_len: int = Field(gt=0)
    tp: int = Field(default=1, ge=1)
    cp: int = Field(default=1, ge=1)
    pp: int = Field(default=1, ge=1)
    ep: int = Field(default=1, ge=1)
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    recompute: RecomputeConfig = Field(default_factory=RecomputeConfig)

    @model_validator(mode="after")
    def _one_source(self) -> ModelConfig:
        if (self.hf_config is None) == (self.architecture is None):
            raise ValueError("give exactly one of hf_config (a directory with config.json) or architecture")
        return self


class OptimizerConfig(Strict):
    lr: float = Field(default=1e-6, gt=0)
    min_lr: float = Field(default=0.0, ge=0)
    weight_decay: float = Field(default=0.0, ge=0)
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    grad_clip: float = Field(default=1.0, ge=0)
    warmup_steps: int = Field(default=0, ge=0)
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    distributed_optimizer: bool = True
    # Megatron's hybrid device optimizer: this fraction of the (DP-sharded) optimizer state and
    # its update live on the host (CUDA only; needs the distributed optimizer).
    cpu_offload: bool = False
    offload_fraction: float = Field(default=1.0, ge=0, le=1)
    # Overlap the DP gradient reduce-scatter with the backward pass (megatron DDP buckets).
    overlap_grad_reduce: bool = False


class LoraConfig(Strict):
    rank: int = Field(gt=0)
    alpha: float = Field(default=16.0, gt=0)
    target_modules: list[str] = Field(
        default_factory=lambda: ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
    )

