"""YAML -> validated config objects, and the derived layout every process reads.

`load_config(path)` validates a user's YAML and returns a `ResolvedConfig`: the config plus a
`layout` (DP sizes, GPU counts, ports) computed here, once. `ResolvedConfig.to_json()` is what
the launcher writes for every process; `load_resolved(path)` reads it back without re-deriving.
This module imports nothing of ours.
"""

from __future__ import annotations

import copy
import json
import math
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class ConfigError(ValueError):
    """A config that cannot be used; `errors` holds one line per problem."""

    def __init__(self, source: str, errors: list[str]):
        self.source = source
        self.errors = errors
        super().__init__(f"{source}: invalid config\n" + "\n".join(f"  - {e}" for e in errors))


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


# ---------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------

Family = Literal["qwen3", "qwen3_moe", "llama"]

# HF `model_type` -> our family name. A family is supported when its builder mapping exists.
HF_MODEL_TYPES: dict[str, Family] = {"qwen3": "qwen3", "qwen3_moe": "qwen3_moe", "llama": "llama"}


class Architecture(_Strict):
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


class RecomputeConfig(_Strict):
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


class ModelConfig(_Strict):
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


class OptimizerConfig(_Strict):
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


class LoraConfig(_Strict):
    rank: int = Field(gt=0)
    alpha: float = Field(default=16.0, gt=0)
    target_modules: list[str] = Field(
        default_factory=lambda: ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
    )


class SnapshotConfig(_Strict):
    """Load the policy's backbone into the critic at these steps, then retune the head only.

    Before policy step s - 1 ends, the policy exports its weights as snapshot version s into
    `dir`; before training step s the critic waits for that version (up to `wait_timeout_s`),
    loads its backbone (resharded to the critic's layout) and trains only the value head for
    `head_only_retune_steps` steps. The critic's and the policy's architectures must match."""

    steps: list[int] = Field(default_factory=list)
    dir: str | None = None  # default: <checkpoint.dir>/policy_snapshots
    head_only_retune_steps: int = Field(default=0, ge=0)
    wait_timeout_s: float = Field(default=1800.0, gt=0)


class ServiceConfig(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(default=8100, gt=0, lt=65536)
    max_batch_sequences: int = Field(default=512, gt=0)
    request_timeout_s: float = Field(default=600.0, gt=0)
    # The name of an environment variable holding a shared token: requests without
    # "Authorization: Bearer <token>" get 401. Every process started with the run's environment
    # (the orchestrator) sends it.
    token_env: str | None = None

    def token(self) -> str | None:
        """The shared token (from the variable `token_env` names), or None."""
        return secret_from_env(self.token_env, "value.service.token_env")


class ValueConfig(_Strict):
    """The critic: its own model, layout, optimizer and training options."""

    model: ModelConfig
    optimizer: OptimizerConfig = Field(default_factory=lambda: OptimizerConfig(lr=1e-5))
    epochs_per_step: int = Field(default=1, ge=1)
    head_only_warmup_steps: int = Field(default=0, ge=0)
    freeze_attention: bool = False
    lora: LoraConfig | None = None
    # Value pretraining before RL: `pretrain_steps` optimizer steps on batches of
    # `pretrain_batch_size` samples from a JSONL file of {"token_ids", "loss_mask", "reward"}
    # (Monte Carlo returns with algorithm.gamma) or {"token_ids", "loss_mask", "returns"}.
    pretrain_jsonl: str | None = None
    pretrain_steps: int = Field(default=0, ge=0)
    pretrain_batch_size: int = Field(default=32, gt=0)
    snapshot: SnapshotConfig | None = None
    head_init_std: float = Field(default=0.0, ge=0)
    service: ServiceConfig = Field(default_factory=ServiceConfig)


# ---------------------------------------------------------------------------------------------
# Algorithm
# ---------------------------------------------------------------------------------------------

# Defaults that differ by algorithm; anything the user sets wins.
ALGORITHM_DEFAULTS: dict[str, dict[str, Any]] = {
    "grpo": {"eps_low": 0.2, "eps_high": 0.2, "length_adaptive_alpha": None},
    "ppo": {"eps_low": 0.2, "eps_high": 0.2, "length_adaptive_alpha": None},
    # SAO paper (Hou et al., arXiv 2607.07508) defaults.
    "sao": {"eps_low": 0.3, "eps_high": 5.0, "length_adaptive_alpha": 1.5},
}


class AlgorithmConfig(_Strict):
    type: Literal["grpo", "ppo", "sao"]
    gamma: float = Field(default=1.0, ge=0, le=1)
    policy_lambda: float = Field(default=0.95, ge=0, le=1)
    value_lambda: float = Field(default=1.0, ge=0, le=1)
    length_adaptive_alpha: float | None = Field(default=None, gt=0)
    eps_low: float = Field(default=0.2, ge=0, lt=1)
    eps_high: float = Field(default=0.2, ge=0)
    dual_clip: float | None = Field(default=None, gt=1)
    value_clip: float | None = Field(default=None, gt=0)
    kl_coef: float = Field(default=0.0, ge=0)
    normalize_advantage_std: bool = True  # GRPO: divide by the group's std

    @model_validator(mode="before")
    @classmethod
    def _type_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("type") in ALGORITHM_DEFAULTS:
            return {**ALGORITHM_DEFAULTS[data["type"]], **data}
        return data


# ---------------------------------------------------------------------------------------------
# Orchestrator, inference, deployment, transport, checkpoint, logging
# ---------------------------------------------------------------------------------------------


class AdmissionConfig(_Strict):
    """Which completed groups become training samples."""

    reject_identical_rewards: bool = False  # GRPO: a group whose rewards are all equal has no signal
    min_completion_tokens: int = Field(default=1, ge=0)
    drop_truncated: bool = False


class EvalConfig(_Strict):
    """A held-out evaluation set: run at step 0 and every `interval` steps, never trained on."""

    name: str
    environment: Literal["procedural", "math", "calculator"] = "procedural"
    dataset: str | None = None
    num_examples: int = Field(default=64, gt=0)
    samples_per_example: int = Field(default=1, gt=0)  # k of pass@k
    temperature: float = Field(default=0.0, ge=0)  # 0: greedy
    max_completion_tokens: int | None = Field(default=None, gt=0)
    interval: int = Field(default=10, ge=1)
    # Rows come from this seed (procedural tasks: a seed other than orchestrator.seed is held out).
    seed: int = 1_000_003


class OrchestratorConfig(_Strict):
    num_steps: int = Field(default=1, ge=1)
    batch_size: int = Field(gt=0, description="groups per training step")
    group_size: int = Field(gt=0)
    # Lead gate: batch n is shipped (and generated) only once policy version >= n - max_async_level.
    max_async_level: int = Field(default=1, ge=0)
    # Staleness bound: a sample generated by version v is dropped at training step n if n - v > this.
    max_off_policy_steps: int = Field(default=1, ge=0)
    # Stop (with the reason) after this many consecutive steps that admitted no group.
    max_empty_steps: int = Field(default=3, ge=1)
    max_prompt_tokens: int = Field(gt=0)
    max_completion_tokens: int = Field(gt=0)
    temperature: float = Field(default=1.0, gt=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    seed: int = 0
    admission: AdmissionConfig = Field(default_factory=AdmissionConfig)
    environment: Literal["procedural", "math", "calculator"] = "procedural"
    # procedural: the task (reverse, copy, count); math / calculator: a JSONL file of {prompt, answer}
    dataset: str | None = None
    # Apply the tokenizer's chat template to prompts (once, when the tokenizer has one).
    chat_template: bool = True
    eval: list[EvalConfig] = Field(default_factory=list)


class InferenceConfig(_Strict):
    backend: Literal["vllm", "vllm-cpu"] = "vllm"
    num_servers: int = Field(default=1, ge=1)
    tp: int = Field(default=1, ge=1)
    host: str = "127.0.0.1"
    # One address per server when they run on several nodes (a SLURM job sets them); default: host.
    server_hosts: list[str] | None = None
    base_port: int = Field(default=8000, gt=0, lt=65536)
    weight_update: Literal["nccl", "safetensors"] = "nccl"
    weight_broadcast_port: int = Field(default=29600, gt=0, lt=65536)
    # Address of policy rank 0 that inference workers connect to for path (b); default: the
    # policy group's MASTER_ADDR.
    weight_broadcast_host: str | None = None
    weight_bucket_mb: int = Field(default=256, gt=0)
    publish_dir: str | None = None
    gpu_memory_utilization: float = Field(default=0.85, gt=0, le=1)
    extra_args: list[str] = Field(default_factory=list)  # appended to every vLLM server's command
    # The HF directory (weights, config, tokenizer) the servers start from and the orchestrator
    # takes the tokenizer from; default model.hf_config.
    model_dir: str | None = None
    served_model_name: str = "policy"  # the model name the servers answer /v1/models with
    # The name of an environment variable holding an API key: passed to vLLM and the router as
    # --api-key and sent by every client of ours (rollouts, weight control, readiness checks).
    api_key_env: str | None = None

    def api_key(self) -> str | None:
        """The API key (from the variable `api_key_env` names), or None."""
        return secret_from_env(self.api_key_env, "inference.api_key_env")
    cpu_kv_cache_gib: int = Field(default=1, ge=1)  # VLLM_CPU_KVCACHE_SPACE for vllm-cpu
    # vllm-router in front of the servers (rollout traffic; admin traffic goes to each server).
    router_port: int = Field(default=8050, gt=0, lt=65536)
    router_policy: Literal["consistent_hash", "sticky_least_loaded"] = "consistent_hash"
    router_health_failure_threshold: int = Field(default=3, ge=2)
    # First compiles on a GPU take many minutes: generous by default.
    startup_timeout_s: float = Field(default=1800.0, gt=0)
    # Longer than the longest rollout (router request and queue timeouts, the rollout client's).
    request_timeout_s: float = Field(default=3600.0, gt=0)


class DeploymentConfig(_Strict):
    """Where each process group runs. On CPU a 'GPU' is one process."""

    device: Literal["cuda", "cpu"] = "cuda"
    nodes: int = Field(default=1, ge=1)
    gpus_per_node: int = Field(default=8, ge=1)
    inference_gpus: int = Field(default=1, ge=0)
    policy_gpus: int = Field(ge=1)
    num_value_nodes: int = Field(default=0, ge=0)  # dedicated critic nodes
    num_value_gpus_per_train_node: int = Field(default=0, ge=0)  # critic shares policy nodes
    # On a failure or Ctrl-C: SIGTERM, then SIGKILL after this long (a checkpoint in progress finishes).
    stop_grace_s: float = Field(default=60.0, gt=0)
    # A collective not finished after this long fails (the gloo/NCCL process-group timeout).
    collective_timeout_s: float = Field(default=1800.0, gt=0)
    # A rank whose heartbeat stops this long is lost: the other ranks of its group exit naming it.
    heartbeat_timeout_s: float = Field(default=60.0, gt=0)
    # Memory of one GPU (H200: 141 GB); check-config's memory plan must fit in it (device cuda).
    gpu_memory_gb: float = Field(default=141.0, gt=0)


class TransportConfig(_Strict):
    host: str = "127.0.0.1"
    policy_port: int = Field(default=5555, gt=0, lt=65536)
    critic_port: int = Field(default=5556, gt=0, lt=65536)
    receive_timeout_s: float = Field(default=600.0, gt=0)
    handshake_timeout_s: float = Field(default=120.0, gt=0)


class CheckpointConfig(_Strict):
    dir: str = "checkpoints"
    save_interval: int = Field(default=0, ge=0)  # 0: never
    keep_last: int = Field(default=2, ge=1)
    resume: bool = True


class LoggingConfig(_Strict):
    dir: str = "runs"
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    console: bool = True
    jsonl: bool = True


class Config(_Strict):
    model: ModelConfig
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)  # the policy's
    value: ValueConfig | None = None
    algorithm: AlgorithmConfig
    orchestrator: OrchestratorConfig
    inference: InferenceConfig = Field(default_factory=InferenceConfig)
    deployment: DeploymentConfig
    transport: TransportConfig = Field(default_factory=TransportConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)


# ---------------------------------------------------------------------------------------------
# Derived layout
# ---------------------------------------------------------------------------------------------


class ModelLayout(_Strict):
    """One process group's parallel layout. world = tp * cp * pp * dp."""

    world_size: int
    tp: int
    cp: int
    pp: int
    ep: int
    dp: int
    expert_dp: int  # data-parallel size of expert weights: world / (tp * ep * pp)


class Layout(_Strict):
    policy: ModelLayout
    critic: ModelLayout | None
    value_gpus: int
    deployment_style: Literal["shared", "dedicated", "none"]
    inference_ports: list[int]
    inference_urls: list[str]  # http://HOST:PORT of each inference server
    ports: dict[str, int]  # every fixed port by the config key that sets it
    policy_architecture: Architecture
    critic_architecture: Architecture | None


class ResolvedConfig(Config):
    layout: Layout

    def to_json(self) -> str:
        return self.model_dump_json(indent=2)


def _read_architecture(
    model: ModelConfig, where: str, base_dir: Path, errors: list[str]
) -> Architecture | None:
    if model.architecture is not None:
        return model.architecture
    directory = Path(model.hf_config)
    if not directory.is_absolute():
        directory = base_dir / directory
    path = directory / "config.json"
    if not path.is_file():
        errors.append(f"{where}.hf_config: no config.json in {directory}")
        return None
    try:
        return Architecture.from_hf_config(json.loads(path.read_text()), str(path))
    except (ValueError, KeyError) as exc:
        errors.append(f"{where}.hf_config: {path}: {exc}")
        return None


def _model_layout(
    model: ModelConfig, arch: Architecture | None, gpus: int, where: str, errors: list[str]
) -> ModelLayout | None:
    """DP from the model's own GPU count and degrees, plus divisibility checks."""
    model_parallel = model.tp * model.cp * model.pp
    if gpus % model_parallel:
        errors.append(
            f"{where}: {gpus} GPUs are not divisible by tp*cp*pp = {model.tp}*{model.cp}*{model.pp} = {model_parallel}"
        )
        return None
    dp = gpus // model_parallel
    if arch is not None:
        if arch.num_attention_heads % (model.tp * model.cp):
            errors.append(
                f"{where}: num_attention_heads ({arch.num_attention_heads}) must be divisible by "
                f"tp*cp ({model.tp}*{model.cp}) for tensor parallel with Ulysses context parallel"
            )
        if arch.num_key_value_heads % model.tp:
            errors.append(
                f"{where}: num_key_value_heads ({arch.num_key_value_heads}) must be divisible by tp ({model.tp})"
            )
        if arch.num_layers % model.pp:
            errors.append(f"{where}: num_layers ({arch.num_layers}) must be divisible by pp ({model.pp})")
        if model.ep > 1 and not arch.num_experts:
            errors.append(f"{where}.ep: ep = {model.ep} but the model has no experts")
        if arch.num_experts and arch.num_experts % model.ep:
            errors.append(
                f"{where}.ep: num_experts ({arch.num_experts}) must be divisible by ep ({model.ep})"
            )
    # Every packed row is split over CP ranks, and over TP ranks too under sequence parallel
    # (the builder turns it on for MoE models at tp > 1): seq_len must divide evenly.
    sequence_parallel = model.tp if model.tp > 1 and arch is not None and arch.num_experts else 1
    if model.seq_len % (model.cp * sequence_parallel):
        errors.append(
            f"{where}.seq_len ({model.seq_len}) must be a multiple of cp ({model.cp})"
            + (f" x tp ({model.tp}, sequence parallel for MoE)" if sequence_parallel > 1 else "")
        )
    # Experts are sharded over the data-parallel ranks (times CP): ep must divide dp*cp.
    if (dp * model.cp) % model.ep:
        errors.append(f"{where}.ep: ep ({model.ep}) must divide dp*cp ({dp}*{model.cp})")
        return None
    return ModelLayout(
        world_size=gpus,
        tp=model.tp,
        cp=model.cp,
        pp=model.pp,
        ep=model.ep,
        dp=dp,
        expert_dp=gpus // (model.tp * model.ep * model.pp),
    )


def _check_scale_options(config: Config, policy_arch, critic_arch, errors: list[str]) -> None:
    """Optimizer offload and recomputation settings, for the policy and the critic."""
    roles = [("", config.model, config.optimizer, policy_arch)]
    if config.value is not None:
        roles.append(("value.", config.value.model, config.value.optimizer, critic_arch))
    for prefix, model, optimizer, arch in roles:
        if optimizer.cpu_offload and config.deployment.device == "cpu":
            errors.append(
                f"{prefix}optimizer.cpu_offload: needs CUDA (megatron's hybrid device optimizer); with "
                "deployment.device 'cpu' the optimizer state already lives in host memory"
            )
        if optimizer.cpu_offload and not optimizer.distributed_optimizer:
            errors.append(f"{prefix}optimizer.cpu_offload: needs {prefix}optimizer.distributed_optimizer: true")
        recompute = model.recompute
        if arch is not None and recompute.num_layers is not None:
            per_stage = arch.num_layers // model.pp
            if recompute.num_layers > per_stage:
                errors.append(
                    f"{prefix}model.recompute.num_layers ({recompute.num_layers}) exceeds the "
                    f"{per_stage} layers of a pipeline stage"
                )
            elif recompute.method == "uniform" and per_stage % recompute.num_layers:
                errors.append(
                    f"{prefix}model.recompute.num_layers ({recompute.num_layers}) must divide the {per_stage} "
                    "layers of a pipeline stage for method 'uniform'"
                )


def _check_value_options(
    config: Config, policy_arch: Architecture | None, critic_arch: Architecture | None, errors: list[str]
) -> None:
    value = config.value
    if bool(value.pretrain_jsonl) != bool(value.pretrain_steps):
        errors.append(
            "value.pretrain_jsonl / value.pretrain_steps: value pretraining needs both a JSONL file and a "
            f"step count > 0 (got pretrain_jsonl={value.pretrain_jsonl!r}, pretrain_steps={value.pretrain_steps})"
        )
    snapshot = value.snapshot
    if snapshot is None or not snapshot.steps:
        return
    num_steps = config.orchestrator.num_steps
    bad = [s for s in snapshot.steps if not 1 <= s < num_steps]
    if bad:
        errors.append(
            f"value.snapshot.steps: {bad} outside 1..{num_steps - 1} (step s loads the policy after its step s - 1; "
            "at step 0 use value.model.checkpoint instead)"
        )
    if len(set(snapshot.steps)) != len(snapshot.steps):
        errors.append(f"value.snapshot.steps: {snapshot.steps} has repeated steps")
    if value.lora is not None:
        errors.append("value.snapshot: a snapshot replaces the backbone that LoRA adapts; use one of them")
    if policy_arch and critic_arch:
        fields = (
            "family",
            "hidden_size",
            "num_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "intermediate_size",
            "vocab_size",
            "num_experts",
            "moe_intermediate_size",
            "qk_norm",
        )
        differ = [f for f in fields if getattr(policy_arch, f) != getattr(critic_arch, f)]
        if differ:
            errors.append(
                f"value.snapshot: the critic's architecture differs from the policy's in {differ}; a policy "
                "snapshot can only load into a critic of the same architecture"
            )


def _value_gpus(config: Config, errors: list[str]) -> tuple[int, str]:
    deployment = config.deployment
    dedicated, shared = deployment.num_value_nodes, deployment.num_value_gpus_per_train_node
    if config.value is None:
        if dedicated or shared:
            errors.append(
                "deployment: num_value_nodes / num_value_gpus_per_train_node are set but there is no value section"
            )
        return 0, "none"
    if dedicated and shared:
        errors.append(
            "deployment: set num_value_nodes (dedicated) or num_value_gpus_per_train_node (shared), not both"
        )
        return 0, "none"
    if dedicated:
        return dedicated * deployment.gpus_per_node, "dedicated"
    if not shared:
        errors.append(
            "deployment: the value section needs critic GPUs: set num_value_nodes or num_value_gpus_per_train_node"
        )
        return 0, "none"
    if shared >= deployment.gpus_per_node:
        errors.append(
            f"deployment.num_value_gpus_per_train_node ({shared}) must be less than gpus_per_node ({deployment.gpus_per_node})"
        )
        return 0, "none"
    train_nodes = math.ceil(deployment.policy_gpus / (deployment.gpus_per_node - shared))
    return train_nodes * shared, "shared"


def _inference_urls(config: Config, ports: list[int], errors: list[str]) -> list[str]:
    hosts = config.inference.server_hosts or [config.inference.host] * len(ports)
    if len(hosts) != len(ports):
        errors.append(
            f"inference.server_hosts has {len(hosts)} addresses for inference.num_servers = {len(ports)} servers"
        )
        return []
    return [f"http://{host}:{port}" for host, port in zip(hosts, ports, strict=True)]


def _ports(config: Config, errors: list[str]) -> tuple[dict[str, int], list[int]]:
    inference_ports = [config.inference.base_port + i for i in range(config.inference.num_servers)]
    ports = {
        "transport.policy_port": config.transport.policy_port,
        "transport.critic_port": config.transport.critic_port,
        "inference.weight_broadcast_port": config.inference.weight_broadcast_port,
        "inference.router_port": config.inference.router_port,
    }
    if config.value is None:
        del ports["transport.critic_port"]
    else:
        ports["value.service.port"] = config.value.service.port
    for i, port in enumerate(inference_ports):
        ports[f"inference.base_port+{i}"] = port
    seen: dict[int, str] = {}
    for key, port in ports.items():
        if port in seen:
            errors.append(
                f"{key}: port {port} is already used by {seen[port]}; all configured ports must be distinct"
            )
        else:
            seen[port] = key
    return ports, inference_ports


def resolve(config: Config, base_dir: Path = Path("."), source: str = "<config>") -> ResolvedConfig:
    """Checks the cross-field rules and computes the layout; raises ConfigError listing every problem."""
    errors: list[str] = []
    algorithm = config.algorithm.type
    if algorithm in ("ppo", "sao") and config.value is None:
        errors.append(
            f"value: algorithm.type '{algorithm}' needs a value section (the critic); none is given"
        )
    if algorithm == "grpo" and config.value is not None:
        errors.append("value: algorithm.type 'grpo' takes no value section (GRPO has no critic); remove it")
    if algorithm == "grpo" and config.orchestrator.group_size < 2:
        errors.append(
            f"orchestrator.group_size: GRPO normalises rewards within a group and needs at least 2, got {config.orchestrator.group_size}"
        )

    policy_arch = _read_architecture(config.model, "model", base_dir, errors)
    critic_arch = (
        _read_architecture(config.value.model, "value.model", base_dir, errors) if config.value else None
    )

    longest = config.orchestrator.max_prompt_tokens + config.orchestrator.max_completion_tokens
    models = [("model", config.model)] + ([("value.model", config.value.model)] if config.value else [])
    for where, model in models:
        if model.seq_len < longest:
            errors.append(
                f"{where}.seq_len ({model.seq_len}) is shorter than the longest possible sample "
                f"(orchestrator.max_prompt_tokens + max_completion_tokens = {longest} tokens)"
            )
    if policy_arch and critic_arch and policy_arch.vocab_size != critic_arch.vocab_size:
        errors.append(
            f"value.model: vocab_size ({critic_arch.vocab_size}) differs from the policy's ({policy_arch.vocab_size}); "
            "the critic scores the policy's token ids"
        )

    if config.value is not None:
        _check_value_options(config, policy_arch, critic_arch, errors)
    _check_scale_options(config, policy_arch, critic_arch, errors)

    value_gpus, style = _value_gpus(config, errors)
    deployment = config.deployment
    capacity = deployment.nodes * deployment.gpus_per_node
    needed = deployment.inference_gpus + deployment.policy_gpus + value_gpus
    if needed > capacity:
        errors.append(
            f"deployment: inference_gpus + policy_gpus + critic GPUs = {deployment.inference_gpus} + "
            f"{deployment.policy_gpus} + {value_gpus} = {needed} exceeds nodes*gpus_per_node = {capacity}"
        )
    if deployment.inference_gpus % config.inference.tp:
        errors.append(
            f"deployment.inference_gpus ({deployment.inference_gpus}) must be divisible by inference.tp ({config.inference.tp})"
        )
    elif (
        deployment.inference_gpus
        and config.inference.num_servers * config.inference.tp != deployment.inference_gpus
    ):
        errors.append(
            f"inference.num_servers * inference.tp ({config.inference.num_servers}*{config.inference.tp}) must equal "
            f"deployment.inference_gpus ({deployment.inference_gpus})"
        )

    policy_layout = _model_layout(config.model, policy_arch, deployment.policy_gpus, "model", errors)
    critic_layout = None
    if config.value is not None and value_gpus:
        critic_layout = _model_layout(config.value.model, critic_arch, value_gpus, "value.model", errors)
    ports, inference_ports = _ports(config, errors)

    if errors:
        raise ConfigError(source, errors)
    layout = Layout(
        policy=policy_layout,
        critic=critic_layout,
        value_gpus=value_gpus,
        deployment_style=style,
        inference_ports=inference_ports,
        inference_urls=_inference_urls(config, inference_ports, errors),
        ports=ports,
        policy_architecture=policy_arch,
        critic_architecture=critic_arch,
    )
    data = config.model_dump()
    if data["inference"]["weight_update"] == "safetensors" and not data["inference"]["publish_dir"]:
        # Path (a) needs a directory: without one the policy would publish nothing.
        data["inference"]["publish_dir"] = str(Path(data["checkpoint"]["dir"]) / "published")
    # Every process reads the resolved file from its own working directory: make paths absolute.
    for section in (data["model"], data["value"]["model"] if data["value"] else None):
        if section and section["hf_config"] and not Path(section["hf_config"]).is_absolute():
            section["hf_config"] = str((base_dir / section["hf_config"]).resolve())
    resolved = ResolvedConfig(**data, layout=layout)
    from megatron_rl.memory_plan import check_fits, memory_plan

    errors = check_fits(resolved, memory_plan(resolved))
    if errors:
        raise ConfigError(source, errors)
    return resolved


def _format_validation_error(exc: ValidationError) -> list[str]:
    lines = []
    for err in exc.errors():
        path = ".".join(str(p) for p in err["loc"]) or "<top>"
        message = err["msg"]
        if err["type"] == "extra_forbidden":
            message = "unknown key"
        elif err["type"] == "missing":
            message = "required key is missing"
        lines.append(f"{path}: {message}")
    return lines


def parse_config(data: Any, source: str = "<config>", base_dir: Path = Path(".")) -> ResolvedConfig:
    """Validates a dict (already loaded from YAML) and resolves it."""
    if not isinstance(data, dict):
        raise ConfigError(source, [f"<top>: expected a mapping of sections, got {type(data).__name__}"])
    try:
        config = Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(source, _format_validation_error(exc)) from None
    return resolve(config, base_dir=base_dir, source=source)


def apply_overrides(data: dict, assignments: list[str]) -> dict:
    """`a.b.c=VALUE` (VALUE read as YAML: numbers, lists, strings) into a copy of `data`."""
    data = copy.deepcopy(data)
    for assignment in assignments:
        key, sep, raw = assignment.partition("=")
        if not sep or not key:
            raise ConfigError("--set", [f"{assignment!r}: expected KEY=VALUE (e.g. transport.host=10.0.0.5)"])
        node = data
        *parents, last = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError("--set", [f"{key}: {part} is not a section"])
        try:
            node[last] = yaml.safe_load(raw)
        except yaml.YAMLError as exc:
            raise ConfigError("--set", [f"{key}: value {raw!r} is not valid YAML ({exc})"]) from None
    return data


def load_config(path: str | Path, overrides: list[str] = ()) -> ResolvedConfig:
    """Reads a user's YAML config, with `KEY=VALUE` overrides; relative paths in it are
    relative to the file's directory."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(str(path), ["file not found"])
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(str(path), [f"not valid YAML: {exc}"]) from None
    if overrides:
        data = apply_overrides(data if isinstance(data, dict) else {}, list(overrides))
    return parse_config(data, source=str(path), base_dir=path.parent)


def secret_from_env(env_name: str | None, key: str) -> str | None:
    """The value of the environment variable a config key (`key`) names; None when the key is
    unset; an error naming both when the variable is missing or empty."""
    if not env_name:
        return None
    value = os.environ.get(env_name, "")
    if not value:
        raise ConfigError(key, [f"{key} names the environment variable {env_name}, which is not set (or empty)"])
    return value


def load_resolved(path: str | Path) -> ResolvedConfig:
    """Reads the resolved JSON written by the launcher (no re-derivation)."""
    path = Path(path)
    try:
        return ResolvedConfig.model_validate_json(path.read_text())
    except (OSError, ValidationError) as exc:
        raise ConfigError(str(path), [f"not a resolved config: {exc}"]) from None
