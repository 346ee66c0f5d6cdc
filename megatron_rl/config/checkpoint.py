"""The checkpoint section: checkpoints of every role and resuming from them."""

from __future__ import annotations

from pydantic import Field

from megatron_rl.config.base import Strict


class CheckpointConfig(Strict):
    """Checkpoints of the policy, the critic and the orchestrator, and resuming from them."""

    dir: str = Field(default="checkpoints", description="Where checkpoints are written (relative to the working directory).")
    save_interval: int = Field(default=0, ge=0, description="Save every this many steps; 0: never.")
    keep_last: int = Field(default=2, ge=1, description="Complete checkpoints kept per role (older ones are removed).")
    resume: bool = Field(default=True, description="Resume from the newest complete checkpoint in dir when there is one.")
