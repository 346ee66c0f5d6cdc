"""`Config`, a run's whole config: the models' sections (model.py, value.py), the algorithm
(algorithm.py) and the sections around them, one module per reader (orchestrator.py,
distillation.py, inference.py, deployment.py, transport.py, checkpoint.py, logging.py)."""

from __future__ import annotations

from pydantic import Field

from megatron_rl.config.algorithm import AlgorithmConfig
from megatron_rl.config.base import Strict
from megatron_rl.config.checkpoint import CheckpointConfig
from megatron_rl.config.deployment import DeploymentConfig
from megatron_rl.config.distillation import DistillationConfig
from megatron_rl.config.inference import InferenceConfig
from megatron_rl.config.logging import LoggingConfig
from megatron_rl.config.model import ModelConfig, OptimizerConfig, PolicyLoraConfig
from megatron_rl.config.orchestrator import OrchestratorConfig
from megatron_rl.config.transport import TransportConfig
from megatron_rl.config.value import ValueConfig


class Config(Strict):
    """A run's whole config: every section."""

    model: ModelConfig = Field(description="The policy's Megatron model.")
    lora: PolicyLoraConfig | None = Field(default=None, description="Train LoRA adapters on the policy instead of all its weights (the KL reference is then the model with its adapters off; each version reaches inference as set by lora.serve: the adapters alone, or merged weights); null: full fine-tuning.")
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig, description="The policy's optimizer.")
    value: ValueConfig | None = Field(default=None, description="The critic (algorithms whose advantage is gae need one); null: no critic.")
    algorithm: AlgorithmConfig = Field(description="The RL algorithm: preset, advantage estimator, policy loss, update options.")
    orchestrator: OrchestratorConfig = Field(description="Rollouts, batches, admission and evaluation.")
    distillation: DistillationConfig | None = Field(default=None, description="On-policy distillation: a teacher served by vLLM scores every sampled token, and the reverse-KL estimate is a dense reward beside the task reward; null: none.")
    inference: InferenceConfig = Field(default_factory=InferenceConfig, description="The vLLM servers and the router.")
    deployment: DeploymentConfig = Field(description="Where each process group runs.")
    transport: TransportConfig = Field(default_factory=TransportConfig, description="The channels carrying batches to the trainers.")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="Checkpointing and resuming.")
    logging: LoggingConfig = Field(default_factory=LoggingConfig, description="Logs, metrics and experiment tracking.")
