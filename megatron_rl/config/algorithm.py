"""The `algorithm` section: a preset (GRPO, PPO or SAO) and the parts it fills (the advantage
estimator, the policy loss), their coefficients, and how a step's update is made (mini-batch
epochs, the ratio's denominator, rollout correction, loss aggregation, entropy and KL)."""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from megatron_rl.config.base import Strict

# The parts each preset (`algorithm.type`) chooses: (advantage, policy_loss). `algorithm.advantage`
# and `algorithm.policy_loss` win over it.
PRESET_PARTS: dict[str, tuple[str, str]] = {
    "grpo": ("grpo", "ppo_clip"),
    "ppo": ("gae", "ppo_clip"),
    "sao": ("gae", "dis"),
}
ADVANTAGES = ("gae", "grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")
# Estimators whose baseline is the member's group: a group needs two members or more.
GROUP_ADVANTAGES = ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline")
POLICY_LOSSES = ("ppo_clip", "dis", "gspo", "cispo")

# Defaults that differ by preset or by policy loss; anything the user sets wins (the loss's
# defaults over the preset's).
ALGORITHM_DEFAULTS: dict[str, dict[str, Any]] = {
    "grpo": {"eps_low": 0.2, "eps_high": 0.2, "length_adaptive_alpha": None},
    "ppo": {"eps_low": 0.2, "eps_high": 0.2, "length_adaptive_alpha": None},
    # SAO paper (Hou et al., arXiv 2607.07508) defaults.
    "sao": {"eps_low": 0.3, "eps_high": 5.0, "length_adaptive_alpha": 1.5},
}
# GSPO paper (Zheng et al., arXiv 2507.18071): a sequence-level ratio needs a narrow band, and
# its loss is a mean per sequence (verl recommends seq-mean-token-mean with it too).
POLICY_LOSS_DEFAULTS: dict[str, dict[str, Any]] = {
    "gspo": {"eps_low": 3e-4, "eps_high": 4e-4, "loss_aggregation": "seq-mean-token-mean"},
}

LossAggregation = Literal[
    "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
]

# verl's rejection-sampling options (verl/trainer/ppo/rollout_corr_helper.py, 0.9.1).
ROLLOUT_RS_OPTIONS = (
    "token_k1", "token_k2", "token_k3",
    "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
    "seq_mean_k1", "seq_mean_k2", "seq_mean_k3",
    "seq_max_k2", "seq_max_k3",
)  # fmt: skip


def parse_bounds(spec: float | str, key: str) -> tuple[float | None, float]:
    """verl's threshold spelling: a number is an upper bound (lower None), "lower_upper" a pair.
    Raises ValueError naming `key` for anything else."""
    if isinstance(spec, bool):
        raise ValueError(f"{key}: a number or 'lower_upper', not a boolean")
    if isinstance(spec, int | float):
        lower, upper = None, float(spec)
    else:
        parts = spec.strip().split("_")
        try:
            values = [float(p) for p in parts]
        except ValueError:
            raise ValueError(
                f"{key}: {spec!r} is neither a number nor 'lower_upper' (e.g. '0.5_2.0')"
            ) from None
        if len(values) == 1:
            lower, upper = None, values[0]
        elif len(values) == 2:
            lower, upper = values
        else:
            raise ValueError(f"{key}: {spec!r} has more than two bounds")
    if not (math.isfinite(upper) and upper > 0) or (
        lower is not None and not (math.isfinite(lower) and lower > 0)
    ):
        raise ValueError(f"{key}: bounds must be finite and positive, got {spec!r}")
    if lower is not None and lower > upper:
        raise ValueError(f"{key}: lower bound {lower} is above the upper bound {upper}")
    return lower, upper


class RolloutCorrectionConfig(Strict):
    """Importance weights w = pi_old / pi_sampler against the train-inference mismatch (needs
    `old_logprobs: recompute`), with verl's names so settings carry over.

    `rollout_is`: the weight's level: `token` (w_t per token), `sequence` (the product over the
    sequence's action tokens), `geometric` (its geometric mean, exp(mean log w_t); verl 0.9.1 has
    no weight of this level, its rejection rule `seq_mean_k1` bounds the same quantity).
    `rollout_is_threshold`: a number U
    truncates the weights at U (TIS); "L_U" zeroes weights outside [L, U] (MIS / IcePop), the
    token staying in the normaliser. `rollout_rs`: comma-separated rejection rules that drop
    tokens or whole sequences from the loss and its normaliser, each with its threshold in
    `rollout_rs_threshold` (one for all, or one per rule; `*_k1` rules take "L_U" ratio bounds, the
    others one upper bound)."""

    rollout_is: Literal["token", "sequence", "geometric"] | None = None
    rollout_is_threshold: float | str = 2.0
    rollout_is_batch_normalize: bool = False
    rollout_rs: str | None = None
    rollout_rs_threshold: float | str | None = None

    @field_validator("rollout_is_threshold")
    @classmethod
    def _is_bounds(cls, value):
        parse_bounds(value, "rollout_is_threshold")
        return value

    @model_validator(mode="after")
    def _rejection_rules(self) -> RolloutCorrectionConfig:
        self.rejection_rules()  # raises on bad rules or thresholds
        if self.rollout_is is None and self.rollout_rs is None:
            raise ValueError("set rollout_is, rollout_rs or both (or leave rollout_correction out)")
        return self

    def importance_bounds(self) -> tuple[float | None, float]:
        """(lower or None, upper) of `rollout_is_threshold`."""
        return parse_bounds(self.rollout_is_threshold, "rollout_is_threshold")

    def rejection_rules(self) -> list[tuple[str, float | None, float]]:
        """[(rule, lower or None, upper)] of `rollout_rs`; k1 rules get lower = 1 / upper when
        only an upper ratio bound is given (verl's reading)."""
        if self.rollout_rs is None:
            if self.rollout_rs_threshold is not None:
                raise ValueError("rollout_rs_threshold is set but rollout_rs is not")
            return []
        rules = list(dict.fromkeys(r.strip() for r in self.rollout_rs.split(",") if r.strip()))
        unknown = [r for r in rules if r not in ROLLOUT_RS_OPTIONS]
        if not rules or unknown:
            raise ValueError(
                f"rollout_rs: unknown rule(s) {unknown or [self.rollout_rs]}; choose from {list(ROLLOUT_RS_OPTIONS)}"
            )
        if self.rollout_rs_threshold is None:
            raise ValueError(f"rollout_rs ({self.rollout_rs}) needs rollout_rs_threshold")
        specs = self.rollout_rs_threshold
        specs = [specs] if not isinstance(specs, str) else [s.strip() for s in specs.split(",") if s.strip()]
        if len(specs) not in (1, len(rules)):
            raise ValueError(
                f"rollout_rs_threshold: {len(specs)} thresholds for {len(rules)} rules (give 1 or {len(rules)})"
            )
        specs = specs * len(rules) if len(specs) == 1 else specs
        parsed = []
        for rule, spec in zip(rules, specs):
            lower, upper = parse_bounds(spec, f"rollout_rs_threshold for {rule}")
            if rule.endswith("k1"):
                lower = 1.0 / upper if lower is None else lower
            elif lower is not None:
                raise ValueError(
                    f"rollout_rs_threshold for {rule}: one upper bound, not {spec!r} (only *_k1 rules take 'lower_upper')"
                )
            parsed.append((rule, lower, upper))
        return parsed


class AlgorithmConfig(Strict):
    type: Literal["grpo", "ppo", "sao"]
    # The parts (default: the preset's, PRESET_PARTS): a built-in name or "package.module:name"
    # (algorithms/registry.py has the protocols), with keyword arguments for a plug-in.
    advantage: str | None = None
    advantage_args: dict[str, Any] = Field(default_factory=dict)
    policy_loss: str | None = None
    policy_loss_args: dict[str, Any] = Field(default_factory=dict)
    # gae: whiten the step's advantages over all its action tokens (verl's masked_whiten).
    whiten_advantages: bool = False
    gamma: float = Field(default=1.0, ge=0, le=1)
    policy_lambda: float = Field(default=0.95, ge=0, le=1)
    value_lambda: float = Field(default=1.0, ge=0, le=1)
    length_adaptive_alpha: float | None = Field(default=None, gt=0)
    eps_low: float = Field(default=0.2, ge=0, le=1)
    eps_high: float = Field(default=0.2, ge=0)
    dual_clip: float | None = Field(default=None, gt=1)
    value_clip: float | None = Field(default=None, gt=0)
    kl_coef: float = Field(default=0.0, ge=0)
    # The reference-KL estimator (verl's names): k1 = log pi - log pi_ref; k2 = (k1)^2 / 2;
    # k3 = low_var_kl = exp(-k1) + k1 - 1 (clamped like verl's).
    kl_estimator: Literal["k1", "k2", "k3", "low_var_kl"] = "k3"
    entropy_coef: float = Field(default=0.0, ge=0)  # an entropy bonus on action tokens
    # The grpo preset without an explicit `advantage`: False means dr_grpo (no division by the std).
    normalize_advantage_std: bool = True
    # Each step's samples are split (seeded, whole samples) into this many mini-batches; the
    # policy makes policy_minibatches x policy_epochs optimizer steps before publishing.
    policy_minibatches: int = Field(default=1, ge=1)
    policy_epochs: int = Field(default=1, ge=1)
    # The ratio's denominator: the sampler's log-probs (SAO's definition), or the trainer's own
    # forward pass before the step's first update.
    old_logprobs: Literal["sampler", "recompute"] = "sampler"
    rollout_correction: RolloutCorrectionConfig | None = None
    loss_aggregation: LossAggregation = "token-mean"
    # seq-mean-token-sum-norm's constant divisor (Dr. GRPO); default orchestrator.max_completion_tokens.
    loss_scale_factor: int | None = Field(default=None, gt=0)

    @model_validator(mode="before")
    @classmethod
    def _preset_defaults(cls, data: Any) -> Any:
        """The preset's parts and defaults, then the policy loss's, then what the user set."""
        if not isinstance(data, dict) or data.get("type") not in PRESET_PARTS:
            return data
        advantage, policy_loss = PRESET_PARTS[data["type"]]
        if advantage == "grpo" and data.get("normalize_advantage_std") is False:
            advantage = "dr_grpo"
        advantage = data.get("advantage") or advantage
        policy_loss = data.get("policy_loss") or policy_loss
        defaults = {**ALGORITHM_DEFAULTS[data["type"]], **POLICY_LOSS_DEFAULTS.get(policy_loss, {})}
        return {**defaults, **data, "advantage": advantage, "policy_loss": policy_loss}

    @field_validator("advantage", "policy_loss")
    @classmethod
    def _known_part(cls, value: str | None, info) -> str | None:
        known = ADVANTAGES if info.field_name == "advantage" else POLICY_LOSSES
        if value is not None and ":" not in value and value not in known:
            raise ValueError(
                f"algorithm.{info.field_name}: unknown {value!r}; choose from {list(known)} "
                "or give a plug-in as 'package.module:name'"
            )
        return value

    @model_validator(mode="after")
    def _std_agrees(self) -> AlgorithmConfig:
        if self.advantage == "grpo" and not self.normalize_advantage_std:
            raise ValueError(
                "algorithm.normalize_advantage_std: false contradicts algorithm.advantage 'grpo' (which divides "
                "by the group's std); use advantage 'dr_grpo' for the group mean alone"
            )
        return self

    @property
    def needs_critic(self) -> bool:
        """The advantage estimator reads the critic's values (gae)."""
        return self.advantage == "gae"

    @property
    def optimizer_steps_per_step(self) -> int:
        return self.policy_minibatches * self.policy_epochs
