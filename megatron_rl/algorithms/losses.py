"""Token-level losses: PPO clip, SAO's direct double-sided importance sampling (DIS), value,
KL to a reference policy (k1 / k2 / k3), entropy; and `policy_objective(config)`, the policy loss
an algorithm trains with.

Every loss is a sum over masked tokens, not a mean: the trainer's models set megatron's
`calculate_per_token_loss`, so megatron divides the gradients by the global normaliser (the
action-token count over all DP and CP ranks for `token-mean`; see algorithms/aggregation.py for
the others) and the result does not depend on how tokens were packed or sharded. The policy
losses take optional per-token `weights` (detached): the loss aggregation's per-token factor
times the rollout-correction weight (algorithms/rollout_correction.py); None means 1.
Each returns (loss sum, metrics); metrics are summed statistics of this call (`*_sum` and
`num_tokens`) so the trainer can reduce them globally, plus min/max where useful.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from megatron_rl.config import AlgorithmConfig

# |log pi - log pi_old| above this is clamped before exp (SAO's reference clamps at 20): in float32
# exp overflows at 88.7, and a masked inf ratio still sends 0 * inf = NaN back through torch.where.
# Beyond the clamp the token's gradient is 0; its ratio metrics see e^20.
LOG_RATIO_CLAMP = 20.0


def _log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(raw log-ratio, ratio = exp(log-ratio clamped to +-LOG_RATIO_CLAMP))."""
    log_ratio = logprobs - old_logprobs
    return log_ratio, torch.exp(torch.clamp(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def _ratio_metrics(
    ratio: torch.Tensor, log_ratio: torch.Tensor, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    ratio = ratio.detach()
    masked = ratio[mask]
    # k3 estimator of KL(old || new): E[(r - 1) - log r], non-negative per token; in float64 with
    # expm1, so a train-inference mismatch of 1e-7 per token is not rounded to 0.
    log_ratio64 = torch.clamp(log_ratio.detach().double(), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    approx_kl = torch.expm1(log_ratio64) - log_ratio64
    return {
        "num_tokens": mask.sum().to(torch.float64),
        "ratio_sum": masked.sum().to(torch.float64),
        "ratio_min": masked.min() if masked.numel() else ratio.new_tensor(float("inf")),
        "ratio_max": masked.max() if masked.numel() else ratio.new_tensor(float("-inf")),
        "approx_kl_sum": approx_kl[mask].sum(),
        # k1 of KL(old || new) is E[log old - log new]; chi-squared E[r^2] - 1 (both float64).
        "log_ratio_sum": log_ratio64[mask].sum(),
        "ratio_squared_sum": torch.exp(2.0 * log_ratio64[mask]).sum(),
    }


def _weighted_sum(per_token: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    if weights is not None:
        per_token = per_token * weights
    return torch.where(mask, per_token, 0.0).sum()


def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip: float | None = None,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """sum_t mask_t * w_t * -min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t).

    With `dual_clip` c > 1, tokens with A_t < 0 are further bounded: loss_t = min(loss_t, -c A_t)
    (verl's `clip_ratio_c`). `eps_high` > `eps_low` is DAPO's clip-higher. w_t: `weights`.
    """
    mask = mask.bool()
    log_ratio, ratio = _log_ratio(logprobs, old_logprobs)
    unclipped = -ratio * advantages
    clipped = -torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * advantages
    per_token = torch.maximum(unclipped, clipped)
    clip_active = clipped > unclipped
    if dual_clip is not None:
        bound = -dual_clip * advantages
        dual_active = (advantages < 0) & (per_token > bound)
        per_token = torch.where(dual_active, bound, per_token)
        clip_active = clip_active | dual_active
    loss = _weighted_sum(per_token, mask, weights)
    metrics = _ratio_metrics(ratio, log_ratio, mask)
    metrics["clipped_sum"] = (clip_active & mask).sum().to(torch.float64)
    return loss, metrics


def sao_dis_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float = 0.3,
    eps_high: float = 5.0,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SAO's DIS: sum_t mask_t * w_t * -1[1 - eps_low < r_t < 1 + eps_high] * r_t * A_t.

    The indicator is not differentiated; both tails are masked whatever the sign of A_t, and
    masked-out tokens still count in the global token count that megatron divides by.
    """
    mask = mask.bool()
    log_ratio, ratio = _log_ratio(logprobs, old_logprobs)
    with torch.no_grad():
        inside = (ratio > 1.0 - eps_low) & (ratio < 1.0 + eps_high)
    per_token = -ratio * advantages
    loss = _weighted_sum(per_token, mask & inside, weights)
    metrics = _ratio_metrics(ratio, log_ratio, mask)
    metrics["clipped_sum"] = (mask & ~inside).sum().to(torch.float64)  # tokens the band masked out
    return loss, metrics


def value_loss(
    values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    old_values: torch.Tensor | None = None,
    clip: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """sum_t mask_t * 0.5 * (V_t - R_t)^2.

    With `clip` and `old_values`: 0.5 * max((V - R)^2, (V_clip - R)^2) where
    V_clip = old + clamp(V - old, -clip, clip).
    """
    mask = mask.bool()
    values = values.to(torch.promote_types(values.dtype, torch.float32))  # bf16 heads -> fp32 loss
    returns = returns.to(values.dtype)
    squared = (values - returns) ** 2
    clipped_frac = values.new_zeros(())
    if clip is not None:
        if old_values is None:
            raise ValueError("value_loss: clip is set but old_values is None")
        old_values = old_values.to(values.dtype)
        clipped_values = old_values + torch.clamp(values - old_values, -clip, clip)
        clipped_squared = (clipped_values - returns) ** 2
        clipped_frac = ((clipped_squared > squared) & mask).sum().to(torch.float64)
        squared = torch.maximum(squared, clipped_squared)
    loss = 0.5 * torch.where(mask, squared, 0.0).sum()
    metrics = {
        "num_tokens": mask.sum().to(torch.float64),
        "squared_error_sum": torch.where(mask, (values - returns) ** 2, 0.0).sum().detach().to(torch.float64),
        "value_sum": torch.where(mask, values, 0.0).sum().detach().to(torch.float64),
        "clipped_sum": clipped_frac,
    }
    return loss, metrics


KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl")


def reference_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref) from the sampled token's log-probs (verl's
    `kl_penalty`): with k = log pi_theta - log pi_ref,
      k1: k (unbiased, can be negative);  k2: k^2 / 2;
      k3 = low_var_kl: exp(-k) + k - 1 (non-negative, zero and flat where the policies agree), with
      -k clamped to [-20, 20] and the result to at most 10, as verl does."""
    k = logprobs - ref_logprobs.to(logprobs.dtype)
    if estimator == "k1":
        return k
    if estimator == "k2":
        return 0.5 * k.square()
    if estimator in ("k3", "low_var_kl"):
        delta = torch.clamp(-k, -20.0, 20.0)
        return torch.clamp(torch.exp(delta) - delta - 1.0, max=10.0)
    raise ValueError(f"algorithm.kl_estimator: unknown {estimator!r}; choose from {list(KL_ESTIMATORS)}")


def reference_kl_loss(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    estimator: str = "k3",
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """sum_t mask_t * w_t * KL_t(pi_theta || pi_ref), KL_t from `reference_kl(estimator)` (the GRPO
    paper's form is k3). Metrics: the unweighted sum over masked tokens."""
    mask = mask.bool()
    kl = reference_kl(logprobs, ref_logprobs, estimator)
    loss = _weighted_sum(kl, mask, weights)
    return loss, {"kl_ref_sum": torch.where(mask, kl.detach(), 0.0).sum().to(torch.float64)}


def entropy_bonus(
    entropy: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """sum_t mask_t * w_t * H_t: what `entropy_coef` times is subtracted from the policy loss."""
    return _weighted_sum(entropy, mask.bool(), weights)


PolicyObjective = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]


def policy_objective(config: AlgorithmConfig) -> PolicyObjective:
    """The policy loss `algorithm.type` trains with, as `f(logprobs, old_logprobs, advantages,
    mask, weights=None)`: SAO's DIS band, or the clipped PPO objective (GRPO and PPO)."""
    if config.type == "sao":
        return partial(sao_dis_loss, eps_low=config.eps_low, eps_high=config.eps_high)
    return partial(ppo_clip_loss, eps_low=config.eps_low, eps_high=config.eps_high, dual_clip=config.dual_clip)
