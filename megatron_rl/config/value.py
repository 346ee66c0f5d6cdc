"""The critic's section (`value`): its model, optimizer, training options, snapshots, service."""

from __future__ import annotations

from pydantic import Field

from megatron_rl.config.base import Strict, secret_from_env
from megatron_rl.config.model import LoraConfig, ModelConfig, OptimizerConfig


class SnapshotConfig(Strict):
    """Load the policy's backbone into the critic at these steps, then retune the head only.

    Before policy step s - 1 ends, the policy exports its weights as snapshot version s into
    `dir`; before training step s the critic waits for that version (up to `wait_timeout_s`),
    loads its backbone (resharded to the critic's layout) and trains only the value head for
    `head_only_retune_steps` steps. The critic's and the policy's architectures must match."""

    steps: list[int] = Field(default_factory=list)
    dir: str | None = None  # default: <checkpoint.dir>/policy_snapshots
    head_only_retune_steps: int = Field(default=0, ge=0)
    wait_timeout_s: float = Field(default=1800.0, gt=0)


class ServiceConfig(Strict):
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


class ValueConfig(Strict):
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

