"""`orchestrator.environment` as an environment written for a hub (envs/hubs/): a block with
`hub: verifiers` or `hub: openenv` instead of a built-in's name or a plug-in's import path.
`orchestrator.environment_args` are then the environment's own arguments (verifiers: its
environment config's fields; OpenEnv: the adapter's mapping of text to actions and observations
to text, and the keyword arguments of each episode's reset)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from megatron_rl.config.base import Strict


class HubEnvironment(Strict):
    """An environment written for verifiers 0.4 (`import verifiers.v1 as vf`, loaded as
    `vf.load_environment` loads it) or for OpenEnv (openenv-core 0.3, a server reached over its
    /ws session)."""

    hub: Literal["verifiers", "openenv"] = Field(description="Which hub's library the environment is written with.")
    id: str | None = Field(default=None, min_length=1, description="verifiers (required): the environment's id as vf.load_environment takes it (an installed module or package; 'owner/name@version' names the module 'name'). openenv: a name for logs and metrics (default: the URL).")
    url: str | None = Field(default=None, min_length=1, description="openenv (required): the environment server's base URL (http://host:port).")
    max_concurrent: int | None = Field(default=None, ge=1, description="Rollouts of this environment running at once; null: verifiers no bound beyond the orchestrator's own, openenv 1 (the server's max_concurrent_envs default).")
    timeout_s: float = Field(default=120.0, gt=0, description="verifiers: one rollout's time limit (its turns and scoring); openenv: one reset or step reply's. Past it the rollout fails, counted.")
    retries: int = Field(default=2, ge=0, description="openenv: retries of a session's connection before the rollout fails, counted.")
    tool_parser: str = Field(default="hermes", min_length=1, description="verifiers: how tool calls are read from the policy's completions for the environment's harness (a parser of envs/tool_parsers.py: hermes, qwen3_coder, or a plug-in 'package.module:name').")
    pass_signal: str | None = Field(default=None, min_length=1, description="verifiers: the reward or metric (by name) whose value decides `passed` (orchestrator.eval pass@k / mean@k, the pass rate); null: the total weighted reward.")
    pass_threshold: float = Field(default=1.0, description="What passes (orchestrator.eval pass@k / mean@k, the pass rate): verifiers: a rollout whose pass_signal (or total weighted reward) is at least this; openenv: a finished episode whose reward is at least this.")

    @model_validator(mode="after")
    def _hub_needs(self) -> HubEnvironment:
        """verifiers needs `id` (and takes no `url`); openenv needs `url` and takes none of the
        verifiers adapter's settings (tool_parser, pass_signal) away from their defaults."""
        if self.hub == "verifiers" and (self.id is None or self.url is not None):
            raise ValueError("hub verifiers: give `id` (the environment's id), not `url`")
        if self.hub == "openenv" and self.url is None:
            raise ValueError("hub openenv: give `url` (the environment server's base URL)")
        # by value, not model_fields_set: a resolved config is validated again from its dump
        verifiers_only = [name for name in ("pass_signal", "tool_parser")
                          if getattr(self, name) != type(self).model_fields[name].default]  # fmt: skip
        if self.hub == "openenv" and verifiers_only:
            raise ValueError(f"hub openenv: {', '.join(verifiers_only)} belong to hub verifiers")
        return self
