"""The sections around the models: orchestrator, inference, deployment, transport, checkpoint,
logging; and `Config`, all sections together."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, model_validator

from megatron_rl.config.algorithm import AlgorithmConfig
from megatron_rl.config.base import Strict, secret_from_env
from megatron_rl.config.model import ModelConfig, OptimizerConfig
from megatron_rl.config.value import ValueConfig

# The built-in environments and their classes, by import path (config sits below envs; a test
# checks this against envs.ENVIRONMENTS).
BUILTIN_ENVIRONMENTS = {
    "procedural": "megatron_rl.envs.procedural:ProceduralTask",
    "math": "megatron_rl.envs.math:MathEnvironment",
    "calculator": "megatron_rl.envs.calculator:CalculatorEnvironment",
}


def _environment_name(value: str) -> str:
    """A built-in environment (procedural, math, calculator) or a plug-in 'package.module:name'."""
    if ":" not in value and value not in BUILTIN_ENVIRONMENTS:
        raise ValueError(
            f"unknown environment {value!r}; choose from {list(BUILTIN_ENVIRONMENTS)} or give a plug-in "
            "as 'package.module:name' (called with dataset=, seed=, returning an Environment)"
        )
    return value


# A built-in environment's name, or a plug-in's import path (envs.make_environment).
EnvironmentName = Annotated[str, AfterValidator(_environment_name)]


class AdmissionConfig(Strict):
    """Which completed groups become training samples."""

    reject_identical_rewards: bool = Field(default=False, description="Reject a group whose rewards are all equal (GRPO: it has no signal).")
    min_completion_tokens: int = Field(default=1, ge=0, description="Drop members with fewer completion tokens than this.")
    drop_truncated: bool = Field(default=False, description="Drop members that ended without EOS (cut at max_completion_tokens).")


class DynamicSamplingConfig(Strict):
    """DAPO's dynamic sampling with a bound: the dispatcher replaces rejected groups until
    `batch_size` are admitted, consuming at most `batch_size + max_extra_groups` groups of the
    ordered stream for one step (the extra ones: rejected by an admission rule or dropped as
    stale). At the bound, `on_limit` says what happens: "train" ships the groups admitted so far
    as a smaller batch (none yet: it ships the first one admitted, never an empty step); "wait"
    keeps going until the batch is full and records that the bound was passed; "stop" raises,
    naming the rejections by rule (verl's DAPO raises past `max_num_gen_batches`)."""

    max_extra_groups: int = Field(ge=0, description="Most groups beyond batch_size one step may consume (rejected or stale).")
    on_limit: Literal["train", "wait", "stop"] = Field(default="train", description="At the bound: train ships a smaller batch, wait keeps going (and records it), stop raises.")


class OverlongConfig(Strict):
    """DAPO's overlong shaping. "penalty": the soft overlong punishment added to the reward
    before advantages, 0 up to `max_completion_tokens - buffer_tokens` completion tokens, then
    falling linearly to `-penalty_factor` at `max_completion_tokens`. "mask": overlong filtering,
    a truncated sample stays in its group (its reward counts in the group's statistics) but
    carries no loss (its loss mask is all False)."""

    buffer_tokens: int = Field(gt=0, description="The last part of the completion budget over which the penalty grows, in tokens; less than orchestrator.max_completion_tokens.")
    penalty_factor: float = Field(default=1.0, ge=0, description="The penalty (subtracted from the reward) at max_completion_tokens.")
    mode: Literal["penalty", "mask"] = Field(default="penalty", description="penalty: soft overlong punishment; mask: truncated samples stay in their group without loss.")


class EvalConfig(Strict):
    """A held-out evaluation set: run at step 0 and every `interval` steps, never trained on."""

    name: str = Field(description="The set's name, the prefix of its metrics.")
    environment: EnvironmentName = Field(default="procedural", description="A built-in environment (procedural, math, calculator) or a plug-in 'package.module:name'.")
    dataset: str | None = Field(default=None, description="procedural: the task (reverse, copy, count); math / calculator: a JSONL file of {prompt, answer}.")
    environment_args: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of the environment's constructor beyond dataset and seed (calculator: max_turns, low, high, ops, question, instruction; a plug-in: its own).")
    num_examples: int = Field(default=64, gt=0, description="Prompts in the set.")
    samples_per_example: int = Field(default=1, gt=0, description="Completions per prompt (k of pass@k).")
    temperature: float = Field(default=0.0, ge=0, description="Sampling temperature; 0: greedy.")
    max_completion_tokens: int | None = Field(default=None, gt=0, description="Completion budget, in tokens; null: orchestrator.max_completion_tokens.")
    interval: int = Field(default=10, ge=1, description="Evaluate at step 0 and every this many steps.")
    seed: int = Field(default=1_000_003, description="Rows come from this seed (procedural tasks: a seed other than orchestrator.seed is held out).")


class OrchestratorConfig(Strict):
    """Rollouts: the environment, sampling, groups and batches, admission, asynchrony, evaluation."""

    num_steps: int = Field(default=1, ge=1, description="Training steps of the run.")
    batch_size: int = Field(gt=0, description="Groups per training step.")
    group_size: int = Field(gt=0, description="Completions sampled per prompt (one group).")
    max_async_level: int = Field(default=1, ge=0, description="Lead gate: batch n is shipped (and generated) only once policy version >= n - max_async_level.")
    max_off_policy_steps: int = Field(default=1, ge=0, description="Staleness bound: a sample generated by version v is dropped at training step n if n - v > this.")
    max_empty_steps: int = Field(default=3, ge=1, description="Stop (with the reason) after this many consecutive steps that admitted no group.")
    max_prompt_tokens: int = Field(gt=0, description="Longest prompt, in tokens.")
    max_completion_tokens: int = Field(gt=0, description="Completion budget per sample, in tokens.")
    temperature: float = Field(default=1.0, gt=0, description="Sampling temperature of training rollouts.")
    top_p: float = Field(default=1.0, gt=0, le=1, description="Nucleus sampling of training rollouts; must stay 1.0 (rule training_samples_are_untruncated).")
    seed: int = Field(default=0, description="Seed of the prompts' order and sampling (the policy's seed; the critic's is seed + 1).")
    admission: AdmissionConfig = Field(default_factory=AdmissionConfig, description="Which completed groups become training samples.")
    dynamic_sampling: DynamicSamplingConfig | None = Field(default=None, description="Bound the groups one step consumes (DAPO); null: replace rejected groups without bound.")
    overlong: OverlongConfig | None = Field(default=None, description="DAPO's overlong shaping; null: no length shaping.")
    environment: EnvironmentName = Field(default="procedural", description="A built-in environment (procedural, math, calculator) or a plug-in 'package.module:name'.")
    dataset: str | None = Field(default=None, description="procedural: the task (reverse, copy, count); math / calculator: a JSONL file of {prompt, answer}.")
    environment_args: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of the environment's constructor beyond dataset and seed (calculator: max_turns, low, high, ops, question, instruction; a plug-in: its own).")
    chat_template: bool = Field(default=True, description="Apply the tokenizer's chat template to prompts (once, when the tokenizer has one).")
    train_on_observations: bool = Field(default=False, description="Ablation: observation tokens are trained on as actions (loss mask 1, the sampler's log-probabilities of them from the next turn's prompt_logprobs; a last observation with no turn after it stays masked), to measure what skip-observation GAE buys. Needs temperature 1.")
    eval: list[EvalConfig] = Field(default_factory=list, description="Held-out evaluation sets, never trained on.")

    @model_validator(mode="after")
    def _settings_fit(self) -> OrchestratorConfig:
        """overlong.buffer_tokens is less than max_completion_tokens, overlong mode mask is not
        combined with admission.drop_truncated, train_on_observations samples at temperature 1."""
        overlong = self.overlong
        if overlong is not None and overlong.buffer_tokens >= self.max_completion_tokens:
            raise ValueError(
                f"orchestrator.overlong.buffer_tokens ({overlong.buffer_tokens}) must be less than "
                f"orchestrator.max_completion_tokens ({self.max_completion_tokens}): the buffer is the last "
                "part of the completion budget"
            )
        if self.train_on_observations and self.temperature != 1.0:
            raise ValueError(
                f"orchestrator.train_on_observations takes the observations' log-probabilities from vLLM's "
                f"prompt_logprobs, which are of the model at temperature 1; orchestrator.temperature is {self.temperature}"
            )
        if overlong is not None and overlong.mode == "mask" and self.admission.drop_truncated:
            raise ValueError(
                "orchestrator.overlong.mode 'mask' keeps truncated samples in their group without loss, "
                "orchestrator.admission.drop_truncated removes them from it: choose one"
            )
        return self


class InferenceConfig(Strict):
    """The vLLM servers, the router in front of them and how new weights reach them."""

    backend: Literal["vllm", "vllm-cpu"] = Field(default="vllm", description="vLLM on GPUs, or vLLM's CPU build.")
    num_servers: int = Field(default=1, ge=1, description="vLLM servers (data-parallel replicas).")
    tp: int = Field(default=1, ge=1, description="Tensor-parallel degree of each server.")
    host: str = Field(default="127.0.0.1", description="Address the servers listen on.")
    server_hosts: list[str] | None = Field(default=None, description="One address per server when they run on several nodes (a SLURM job sets them); null: host.")
    base_port: int = Field(default=8000, gt=0, lt=65536, description="Port of server 0; server i listens on base_port + i.")
    weight_update: Literal["nccl", "safetensors"] = Field(default="nccl", description="How new weights reach the servers: broadcast from policy rank 0 (nccl, path (b)) or files in publish_dir (safetensors, path (a)).")
    weight_broadcast_port: int = Field(default=29600, gt=0, lt=65536, description="Port of the weight broadcast's process group (nccl).")
    weight_broadcast_host: str | None = Field(default=None, description="Address of policy rank 0 that inference workers connect to for path (b); null: 127.0.0.1 (a SLURM job sets policy node 0's address).")
    weight_bucket_mb: int = Field(default=256, gt=0, description="Size of one weight broadcast bucket, in MB.")
    publish_dir: str | None = Field(default=None, description="Where the policy publishes safetensors weights (path (a)); null: <checkpoint.dir>/published.")
    gpu_memory_utilization: float = Field(default=0.85, gt=0, le=1, description="vLLM's fraction of each GPU's memory.")
    extra_args: list[str] = Field(default_factory=list, description="Arguments appended to every vLLM server's command.")
    model_dir: str | None = Field(default=None, description="The HF directory (weights, config, tokenizer) the servers start from and the orchestrator takes the tokenizer from (relative to the config file); null: model.hf_config.")
    served_model_name: str = Field(default="policy", description="The model name the servers answer /v1/models with.")
    api_key_env: str | None = Field(default=None, description="The name of an environment variable holding an API key: passed to vLLM and the router as --api-key and sent by every client of ours.")

    def api_key(self) -> str | None:
        """The API key (from the variable `api_key_env` names), or None."""
        return secret_from_env(self.api_key_env, "inference.api_key_env")
    cpu_kv_cache_gib: int = Field(default=1, ge=1, description="KV cache of a vllm-cpu server, in GiB (VLLM_CPU_KVCACHE_SPACE).")
    router_port: int = Field(default=8050, gt=0, lt=65536, description="Port of the vllm-router in front of the servers (rollout traffic; admin traffic goes to each server).")
    router_policy: Literal["consistent_hash", "sticky_least_loaded"] = Field(default="consistent_hash", description="How the router assigns requests to servers.")
    router_health_failure_threshold: int = Field(default=3, ge=2, description="Failed health checks before the router takes a server out.")
    startup_timeout_s: float = Field(default=1800.0, gt=0, description="How long the servers may take to start, in seconds (first compiles on a GPU take many minutes).")
    shutdown_timeout_s: int = Field(default=1, ge=0, description="vLLM's --shutdown-timeout in seconds: on SIGTERM a server waits this long for requests in flight; 0 leaves the option out (for a vLLM from before 2026-03).")
    request_timeout_s: float = Field(default=3600.0, gt=0, description="Timeout of one rollout request, in seconds (router and client); longer than the longest rollout.")


class DeploymentConfig(Strict):
    """Where each process group runs. On CPU a 'GPU' is one process."""

    device: Literal["cuda", "cpu"] = Field(default="cuda", description="GPUs, or CPU processes (one per 'GPU').")
    nodes: int = Field(default=1, ge=1, description="Machines of the run.")
    gpus_per_node: int = Field(default=8, ge=1, description="GPUs of each machine.")
    inference_gpus: int = Field(default=1, ge=0, description="GPUs of the inference servers (num_servers x tp).")
    policy_gpus: int = Field(ge=1, description="GPUs of the policy trainer.")
    num_value_nodes: int = Field(default=0, ge=0, description="Dedicated critic nodes.")
    num_value_gpus_per_train_node: int = Field(default=0, ge=0, description="Critic GPUs on each policy node (the critic shares policy nodes).")
    stop_grace_s: float = Field(default=60.0, gt=0, description="On a failure or Ctrl-C: SIGTERM, then SIGKILL after this many seconds (a checkpoint in progress finishes).")
    collective_timeout_s: float = Field(default=1800.0, gt=0, description="A collective not finished after this many seconds fails (the gloo/NCCL process-group timeout).")
    heartbeat_timeout_s: float = Field(default=60.0, gt=0, description="A rank whose heartbeat stops this many seconds is lost: the other ranks of its group exit naming it.")
    gpu_memory_gb: float = Field(default=141.0, gt=0, description="Memory of one GPU in GB (H200: 141); check-config's memory plan must fit in it (device cuda).")


class TransportConfig(Strict):
    """The ZMQ channels that carry training batches from the orchestrator to the trainers."""

    host: str = Field(default="127.0.0.1", description="Address of the orchestrator's senders.")
    policy_port: int = Field(default=5555, gt=0, lt=65536, description="Port of the batches sent to the policy.")
    critic_port: int = Field(default=5556, gt=0, lt=65536, description="Port of the batches sent to the critic.")
    receive_timeout_s: float = Field(default=600.0, gt=0, description="How long a receiver waits for a batch (and the orchestrator for critic values and weights), in seconds.")
    handshake_timeout_s: float = Field(default=120.0, gt=0, description="How long a trainer's receiver waits for the readiness handshake with the orchestrator, in seconds.")


class CheckpointConfig(Strict):
    """Checkpoints of the policy, the critic and the orchestrator, and resuming from them."""

    dir: str = Field(default="checkpoints", description="Where checkpoints are written (relative to the working directory).")
    save_interval: int = Field(default=0, ge=0, description="Save every this many steps; 0: never.")
    keep_last: int = Field(default=2, ge=1, description="Complete checkpoints kept per role (older ones are removed).")
    resume: bool = Field(default=True, description="Resume from the newest complete checkpoint in dir when there is one.")


class WandbConfig(Strict):
    """Weights & Biases tracking, from the orchestrator process (megatron_rl/orchestrator/tracking.py);
    needs `pip install megatron_rl[tracking]`."""

    project: str = Field(description="The W&B project the run is logged to.")
    entity: str | None = Field(default=None, description="The W&B team or user (null: your default entity).")
    name: str | None = Field(default=None, description="The run's display name (null: W&B picks one).")
    tags: list[str] = Field(default_factory=list, description="Tags attached to the run.")
    mode: Literal["online", "offline", "disabled"] = Field(
        default="online",
        description="online: sync as it runs; offline: write the run under logging.dir/wandb only "
        "(no network; upload later with `wandb sync`); disabled: no W&B at all.",
    )


class LoggingConfig(Strict):
    dir: str = Field(default="runs", description="The run's directory: logs, metrics JSONL files, the resolved config (relative to the working directory).")
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(default="INFO", description="Log level of every process of the run.")
    inference_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(default="WARNING", description="Log level of vllm-router and of the inference servers' HTTP layer (uvicorn), whose INFO lines are per request: at INFO the router writes three lines per completion (about 800 bytes) and vLLM one access line. vLLM's engine logs at logging.level.")
    console: bool = Field(default=True, description="One line per step on stdout (metrics JSONL files are always written).")
    wandb: WandbConfig | None = Field(
        default=None,
        description="Log every role's metrics and the resolved config to Weights & Biases (null: off).",
    )
    tensorboard: bool = Field(
        default=False, description="Write every role's metrics as TensorBoard events under logging.dir/tensorboard."
    )


class Config(Strict):
    """A run's whole config: every section."""

    model: ModelConfig = Field(description="The policy's Megatron model.")
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig, description="The policy's optimizer.")
    value: ValueConfig | None = Field(default=None, description="The critic (algorithms whose advantage is gae need one); null: no critic.")
    algorithm: AlgorithmConfig = Field(description="The RL algorithm: preset, advantage estimator, policy loss, update options.")
    orchestrator: OrchestratorConfig = Field(description="Rollouts, batches, admission and evaluation.")
    inference: InferenceConfig = Field(default_factory=InferenceConfig, description="The vLLM servers and the router.")
    deployment: DeploymentConfig = Field(description="Where each process group runs.")
    transport: TransportConfig = Field(default_factory=TransportConfig, description="The channels carrying batches to the trainers.")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="Checkpointing and resuming.")
    logging: LoggingConfig = Field(default_factory=LoggingConfig, description="Logs, metrics and experiment tracking.")

