"""The logging section: the run's directory, log levels, console lines and experiment tracking
(Weights & Biases, TensorBoard)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from megatron_rl.config.base import Strict


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
