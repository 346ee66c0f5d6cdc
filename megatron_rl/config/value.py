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

    steps: list[int] = Field(default_factory=list, description="The training steps before which the critic loads the policy's backbone (each in 1 .. orchestrator.num_steps - 1).")
    dir: str | None = Field(default=None, description="Where the policy exports its snapshots; null: <checkpoint.dir>/policy_snapshots.")
    head_only_retune_steps: int = Field(default=0, ge=0, description="Steps after each snapshot that train only the value head.")
    wait_timeout_s: float = Field(default=1800.0, gt=0, description="How long the critic waits for a snapshot version, in seconds.")


class ServiceConfig(Strict):
    """The critic's scoring service (HTTP, on the critic's rank 0) the orchestrator asks for values."""

    host: str = Field(default="127.0.0.1", description="Address the scoring service listens on.")
    port: int = Field(default=8100, gt=0, lt=65536, description="TCP port of the scoring service.")
    max_batch_sequences: int = Field(default=512, gt=0, description="Most sequences the service scores in one collective pass (the requests waiting together are merged up to this).")
    isolate_requests: bool = Field(default=True, description="Pack each merged request's sequences into bins of their own, so that a sequence's values are bit for bit those of its request scored alone, whatever arrived with it (runs repeat exactly); false packs merged requests together (fewer forward passes when requests are short, values that differ in the last digits with the merge).")
    request_timeout_s: float = Field(default=600.0, gt=0, description="Timeout of one scoring request, in seconds.")
    token_env: str | None = Field(default=None, description='The name of an environment variable holding a shared token: requests without "Authorization: Bearer <token>" get 401; the orchestrator (started with the run\'s environment) sends it.')

    def token(self) -> str | None:
        """The shared token (from the variable `token_env` names), or None."""
        return secret_from_env(self.token_env, "value.service.token_env")


class ValueConfig(Strict):
    """The critic: its own model, layout, optimizer and training options."""

    model: ModelConfig = Field(description="The critic's Megatron model (its backbone; a scalar value head is added).")
    optimizer: OptimizerConfig = Field(default_factory=lambda: OptimizerConfig(lr=1e-5), description="The critic's optimizer.")
    epochs_per_step: int = Field(default=1, ge=1, description="Value optimizer steps (epochs over the step's samples) per training step.")
    head_only_warmup_steps: int = Field(default=0, ge=0, description="First training steps that update only the value head.")
    freeze_attention: bool = Field(default=False, description="Keep the attention weights of the backbone frozen (the projections and q/k norms; the layer's input norm trains, under either layer spec).")
    lora: LoraConfig | None = Field(default=None, description="Train LoRA adapters (and the head) instead of the whole backbone; null: full fine-tuning.")
    pretrain_jsonl: str | None = Field(default=None, description='Value pretraining before RL: a JSONL file of {"token_ids", "loss_mask", "reward"} (Monte Carlo returns with algorithm.gamma) or {"token_ids", "loss_mask", "returns"}.')
    pretrain_steps: int = Field(default=0, ge=0, description="Optimizer steps of value pretraining on pretrain_jsonl.")
    pretrain_batch_size: int = Field(default=32, gt=0, description="Samples per value pretraining batch.")
    snapshot: SnapshotConfig | None = Field(default=None, description="Load the policy's backbone into the critic at chosen steps; null: never.")
    head_init_std: float = Field(default=0.0, ge=0, description="Standard deviation of the value head's initial weights; 0: zeros.")
    service: ServiceConfig = Field(default_factory=ServiceConfig, description="The critic's scoring service.")

