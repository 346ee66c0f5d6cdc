"""The `algorithm` section: GRPO, PPO or SAO and their coefficients."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from megatron_rl.config.base import Strict

# Defaults that differ by algorithm; anything the user sets wins.
ALGORITHM_DEFAULTS: dict[str, dict[str, Any]] = {
    "grpo": {"eps_low": 0.2, "eps_high": 0.2, "length_adaptive_alpha": None},
    "ppo": {"eps_low": 0.2, "eps_high": 0.2, "length_adaptive_alpha": None},
    # SAO paper (Hou et al., arXiv 2607.07508) defaults.
    "sao": {"eps_low": 0.3, "eps_high": 5.0, "length_adaptive_alpha": 1.5},
}


class AlgorithmConfig(Strict):
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

