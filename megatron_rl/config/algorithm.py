"""The `algorithm` section: a preset (GRPO, PPO or SAO) and the parts it fills (the advantage
estimator, the policy loss), their coefficients, and how a step's update is made (mini-batch
epochs, the ratio's denominator, rollout correction, loss aggregation, entropy and KL)."""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from megatron_rl.config.base import Strict

# The parts each preset (`algorithm.type`) chooses: (advantage, policy_loss). `algorithm.advantage`
# and `algorithm.policy_loss` win over it. Part names are plain strings here: each built-in is
# declared on its function (algorithms/parts.py), and resolving a config checks the names against
# that registry (config/parts.py); a test checks that every name written here is registered.
PRESET_PARTS: dict[str, tuple[str, str]] = {
    "grpo": ("grpo", "ppo_clip"),
    "ppo": ("gae", "ppo_clip"),
    "sao": ("gae", "dis"),
}

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

    rollout_is: Literal["token", "sequence", "geometric"] | None = Field(default=None, description="The importance weight's level: per token, the product over the sequence, or its geometric mean; null: no weights.")
    rollout_is_threshold: float | str = Field(default=2.0, description='A number U truncates the weights at U (TIS); "L_U" zeroes weights outside [L, U] (MIS / IcePop).')
    rollout_is_batch_normalize: bool = Field(default=False, description="Divide the weights by their mean over the batch (verl's rollout_is_batch_normalize).")
    rollout_rs: str | None = Field(default=None, description="Comma-separated rejection rules (verl's, e.g. token_k1, seq_mean_k3) that drop tokens or sequences from the loss; null: none.")
    rollout_rs_threshold: float | str | None = Field(default=None, description='The rejection rules\' thresholds: one for all or one per rule, comma-separated; *_k1 rules take "L_U" ratio bounds, the others one upper bound.')

    @field_validator("rollout_is_threshold")
    @classmethod
    def _is_bounds(cls, value):
        """rollout_is_threshold is a positive number or "lower_upper" with lower <= upper."""
        parse_bounds(value, "rollout_is_threshold")
        return value

    @model_validator(mode="after")
    def _rejection_rules(self) -> RolloutCorrectionConfig:
        """Each rollout_rs rule is known and has a valid threshold (one for all or one per rule);
        rollout_rs_threshold needs rollout_rs; at least one of rollout_is and rollout_rs is set."""
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
    """The RL algorithm: a preset (`type`) fills the advantage estimator and the policy loss and
    their defaults; any key set here wins over the preset's (and the policy loss's) defaults."""

    type: Literal["grpo", "ppo", "sao"] = Field(description="The preset: grpo (group baseline, PPO clip), ppo (GAE with a critic, PPO clip) or sao (GAE, SAO's DIS loss).")
    advantage: str | None = Field(default=None, json_schema_extra={"part": "advantage"}, description="The advantage estimator: a built-in name (the registry's, listed in the range) or a plug-in 'package.module:name'; null: the preset's.")
    advantage_args: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments for a plug-in advantage estimator.")
    policy_loss: str | None = Field(default=None, json_schema_extra={"part": "policy_loss"}, description="The policy loss: a built-in name (the registry's, listed in the range) or a plug-in 'package.module:name'; null: the preset's.")
    policy_loss_args: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments for a plug-in policy loss.")
    whiten_advantages: bool = Field(default=False, description="gae: whiten the step's advantages over all its action tokens (verl's masked_whiten).")
    gamma: float = Field(default=1.0, ge=0, le=1, description="Discount factor per token (GAE, Monte Carlo returns).")
    policy_lambda: float = Field(default=0.95, ge=0, le=1, description="GAE's lambda for the policy's advantages.")
    value_lambda: float = Field(default=1.0, ge=0, le=1, description="GAE's lambda for the critic's return targets.")
    value_targets: Literal["gae", "version_bootstrap"] = Field(default="gae", description="The critic's return targets: 'gae' (the lambda-return through the whole sample, value_lambda) or 'version_bootstrap' (cut at each policy-version boundary inside a sample, a partial rollout's, and after tokens older than value_targets_max_lag, bootstrapped on the critic's value there: the critic learns the value of the policy it is trained for, not of a mixture; docs/concepts/gae.md). The policy's advantages are GAE's either way.")
    value_targets_max_lag: int | None = Field(default=None, ge=0, description="version_bootstrap: tokens sampled more than this many versions before the step get one-step targets (lambda 0); null: no bound beyond orchestrator.max_off_policy_steps.")
    length_adaptive_alpha: float | None = Field(default=None, gt=0, description="Length-adaptive GAE lambda for the policy (VAPO): lambda = 1 - 1 / (alpha * action tokens of the sample); null: policy_lambda.")
    eps_low: float = Field(default=0.2, ge=0, le=1, description="Lower clip range of the ratio: the ratio is clipped at 1 - eps_low.")
    eps_high: float = Field(default=0.2, ge=0, description="Upper clip range of the ratio: the ratio is clipped at 1 + eps_high.")
    dual_clip: float | None = Field(default=3.0, gt=1, description="Dual-clip PPO (ppo_clip): a token with a negative advantage A has its loss bounded by -dual_clip * A, on by default at 3.0 as verl's clip_ratio_c (it acts only where the ratio exceeds dual_clip); null: no dual clip.")
    value_clip: float | None = Field(default=None, gt=0, description="Clip the critic's new values to within this of the old ones (PPO value clipping); null: no clipping.")
    kl_coef: float = Field(default=0.0, ge=0, description="Coefficient of the KL penalty to the reference policy in the loss; 0: none.")
    kl_estimator: Literal["k1", "k2", "k3", "low_var_kl"] = Field(default="k3", description="The reference-KL estimator (verl's names): k1 = log pi - log pi_ref; k2 = (k1)^2 / 2; k3 = low_var_kl = exp(-k1) + k1 - 1 (clamped like verl's).")
    entropy_coef: float = Field(default=0.0, ge=0, description="Coefficient of an entropy bonus on action tokens; 0: none.")
    normalize_advantage_std: bool = Field(default=True, description="The grpo preset without an explicit advantage: false means dr_grpo (no division by the group's std).")
    policy_minibatches: int = Field(default=1, ge=1, description="Mini-batches each step's samples are split into (seeded, whole samples); the policy makes policy_minibatches x policy_epochs optimizer steps before publishing.")
    policy_epochs: int = Field(default=1, ge=1, description="Passes over each step's mini-batches.")
    old_logprobs: Literal["sampler", "recompute"] = Field(default="sampler", description="The ratio's denominator: the sampler's log-probs (SAO's definition), or the trainer's own forward pass before the step's first update.")
    rollout_correction: RolloutCorrectionConfig | None = Field(default=None, description="Importance weights / rejection against the train-inference mismatch; null: none.")
    loss_aggregation: LossAggregation = Field(default="token-mean", description="How token losses become the step's loss (verl's loss_agg_mode). The seq-mean modes divide by the sequences that keep an action token after rollout rejection, as token-mean divides by the kept tokens (verl's trainer divides them by the whole mini-batch, rejected sequences included).")
    loss_scale_factor: int | None = Field(default=None, gt=0, description="seq-mean-token-sum-norm's constant divisor (Dr. GRPO), in tokens; null: orchestrator.max_completion_tokens.")
    routing_replay: Literal["off", "measure", "replay"] = Field(default="off", description="A mixture-of-experts policy: 'measure' has vLLM return the experts it routed every token to and reports how often the trainer's own router agrees (router_agreement, router_token_mismatch per step); 'replay' also makes every trainer forward that gives log-probs of sampled tokens route each token to vLLM's experts (R3); the critic never replays. 'off': neither.")

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

    @model_validator(mode="after")
    def _std_agrees(self) -> AlgorithmConfig:
        """normalize_advantage_std false contradicts advantage grpo (use dr_grpo);
        value_targets_max_lag belongs to version_bootstrap."""
        if self.value_targets_max_lag is not None and self.value_targets != "version_bootstrap":
            raise ValueError(
                f"algorithm.value_targets_max_lag ({self.value_targets_max_lag}) bounds algorithm.value_targets "
                f"'version_bootstrap'; value_targets is {self.value_targets!r}"
            )
        if self.advantage == "grpo" and not self.normalize_advantage_std:
            raise ValueError(
                "algorithm.normalize_advantage_std: false contradicts algorithm.advantage 'grpo' (which divides "
                "by the group's std); use advantage 'dr_grpo' for the group mean alone"
            )
        return self

    @property
    def optimizer_steps_per_step(self) -> int:
        return self.policy_minibatches * self.policy_epochs
