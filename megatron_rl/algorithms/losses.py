"""The losses: policy losses (PPO clip, SAO's direct double-sided importance sampling (DIS), GSPO's
sequence-level ratio, CISPO's clipped IS weight), value, KL to a reference policy (k1 / k2 / k3),
entropy. `algorithms.registry.policy_loss` picks the policy loss a config trains with.

Every loss is a sum over masked tokens, not a mean: the trainer's models set megatron's
`calculate_per_token_loss`, so megatron divides the gradients by the global normaliser (the
action-token count over all DP and CP ranks for `token-mean`; see algorithms/aggregation.py for
the others) and the result does not depend on how tokens were packed or sharded. The policy
losses take optional per-token `weights` (detached): the loss aggregation's per-token factor
times the rollout-correction weight (algorithms/rollout_correction.py); None means 1.
Each returns (loss sum, metrics); metrics are summed statistics of this call (`*_sum` and
`num_tokens`) so the trainer can reduce them globally, plus min/max where useful. Policy losses
also take `sequences` (a `Sequences`: the packed row's sequence boundaries, with sums over a
whole sequence even when context parallelism split it across ranks); token-level losses ignore it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from megatron_rl.algorithms.parts import register_policy_loss

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


def _no_reduce(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


@dataclass
class Sequences:
    """The sequences of one packed row, as a loss on one rank sees them.

    `cu_seqlens` [S + 1]: the boundaries in the full row (a padding tail is the last segment);
    `of_token` [n]: the sequence each of this rank's tokens belongs to; `count`: S. `reduce` sums a
    tensor of per-sequence sums ([S] or [k, S]) over the context-parallel ranks that share the row (identity without CP), so
    `sum` and `mean` are over whole sequences however they were split. Both are detached: use them
    for weights and ratios (as GSPO's sg[s_i]), and let gradients flow through per-token terms."""

    cu_seqlens: torch.Tensor
    of_token: torch.Tensor
    count: int
    reduce: Callable[[torch.Tensor], torch.Tensor] = field(default=_no_reduce)

    @classmethod
    def single(cls, lengths: list[int], device=None) -> Sequences:
        """Back-to-back sequences of these lengths on one rank (tests, single-process tools)."""
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int64, device=device)
        cu[1:] = torch.cumsum(torch.as_tensor(lengths, dtype=torch.int64, device=device), 0)
        of_token = torch.repeat_interleave(torch.arange(len(lengths), device=device), torch.as_tensor(lengths))
        return cls(cu, of_token, len(lengths))

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """[S] float64: each whole sequence's sum of `values` [n] (detached)."""
        local = torch.zeros(self.count, dtype=torch.float64, device=values.device)
        local.index_add_(0, self.of_token, values.detach().to(torch.float64))
        return self.reduce(local)

    def mean(self, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """[S] float64: each whole sequence's mean of `values` over its `mask`ed tokens (0 when none)."""
        mask = mask.bool()
        local = torch.zeros(2, self.count, dtype=torch.float64, device=values.device)  # one reduction
        local[0].index_add_(0, self.of_token, torch.where(mask, values.detach().to(torch.float64), 0.0))
        local[1].index_add_(0, self.of_token, mask.to(torch.float64))
        sums, counts = self.reduce(local)
        return sums / counts.clamp(min=1.0)


def _clipped_objective(
    ratio: torch.Tensor, advantages: torch.Tensor, eps_low: float, eps_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's per-token -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A) and where the clipped
    term is the larger loss."""
    unclipped = -ratio * advantages
    clipped = -torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * advantages
    return torch.maximum(unclipped, clipped), clipped > unclipped


def _weighted_sum(per_token: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    if weights is not None:
        per_token = per_token * weights
    return torch.where(mask, per_token, 0.0).sum()


@register_policy_loss("ppo_clip", reads=("eps_low", "eps_high", "dual_clip"))
def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip: float | None = None,
    weights: torch.Tensor | None = None,
    sequences: Sequences | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """sum_t mask_t * w_t * -min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t).

    With `dual_clip` c > 1, tokens with A_t < 0 are further bounded: loss_t = min(loss_t, -c A_t)
    (verl's `clip_ratio_c`; `algorithm.dual_clip` defaults to verl's 3.0, None here is the plain
    clip). `eps_high` > `eps_low` is DAPO's clip-higher. w_t: `weights`.
    """
    mask = mask.bool()
    log_ratio, ratio = _log_ratio(logprobs, old_logprobs)
    per_token, clip_active = _clipped_objective(ratio, advantages, eps_low, eps_high)
    if dual_clip is not None:
        bound = -dual_clip * advantages
        dual_active = (advantages < 0) & (per_token > bound)
        per_token = torch.where(dual_active, bound, per_token)
        clip_active = clip_active | dual_active
    loss = _weighted_sum(per_token, mask, weights)
    metrics = _ratio_metrics(ratio, log_ratio, mask)
    metrics["clipped_sum"] = (clip_active & mask).sum().to(torch.float64)
    return loss, metrics


@register_policy_loss("dis", reads=("eps_low", "eps_high"))
def sao_dis_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float = 0.3,
    eps_high: float = 5.0,
    weights: torch.Tensor | None = None,
    sequences: Sequences | None = None,
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


# verl clamps GSPO's log sequence ratio at 10 from above (compute_policy_loss_gspo).
GSPO_LOG_RATIO_MAX = 10.0


@register_policy_loss("gspo", reads=("eps_low", "eps_high"))
def gspo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
    weights: torch.Tensor | None = None,
    sequences: Sequences | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (Zheng et al., 2025), in verl's token form (GSPO-token): with the sequence ratio
    s_i = exp(mean over i's action tokens of log r_t) and, per token,
    s_it = sg[s_i] * pi(y_t) / sg[pi(y_t)] (its value is s_i, its gradient s_i * grad log pi(y_t)):
        sum_t mask_t * w_t * -min(s_it A_t, clip(s_it, 1 - eps_low, 1 + eps_high) A_t).
    The mean runs over each whole sequence (`sequences`, across CP ranks), so packing and CP
    give the loss of the unpacked sequence. log s_it is clamped at 10 from above, as verl does.
    With one advantage per sequence (outcome estimators) this is the paper's sequence objective;
    the paper aggregates per sequence (`loss_aggregation: seq-mean-token-mean`, the default when
    `policy_loss: gspo`). `clipped_sum` counts tokens whose clipped term is the larger loss."""
    if sequences is None:
        raise ValueError("gspo_loss: needs `sequences` (the packed row's sequence boundaries)")
    mask = mask.bool()
    log_ratio, ratio = _log_ratio(logprobs, old_logprobs)
    sequence_log_ratio = sequences.mean(log_ratio, mask)[sequences.of_token].to(logprobs.dtype)
    log_s = torch.clamp(logprobs - logprobs.detach() + sequence_log_ratio, max=GSPO_LOG_RATIO_MAX)
    s = torch.exp(log_s)
    per_token, clip_active = _clipped_objective(s, advantages, eps_low, eps_high)
    loss = _weighted_sum(per_token, mask, weights)
    metrics = _ratio_metrics(ratio, log_ratio, mask)
    metrics["clipped_sum"] = (clip_active & mask).sum().to(torch.float64)
    metrics["sequence_ratio_sum"] = torch.where(mask, s.detach(), 0.0).sum().to(torch.float64)
    return loss, metrics


@register_policy_loss("cispo", reads=("eps_low", "eps_high"))
def cispo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    weights: torch.Tensor | None = None,
    sequences: Sequences | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO (MiniMax-M1, 2025), verl's form: sum_t mask_t * w_t * -sg[clip(r_t, 1 - eps_low,
    1 + eps_high)] * A_t * log pi(y_t). The clipped ratio is a detached weight, so every token
    keeps a gradient (PPO's clip zeroes it); `eps_low` 1 leaves the weight unbounded below, as the
    paper does. The loss value carries log pi (its gradient is what matters); `clipped_sum`
    counts tokens whose weight was clipped."""
    mask = mask.bool()
    log_ratio, ratio = _log_ratio(logprobs, old_logprobs)
    weight = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high).detach()
    per_token = -weight * advantages * logprobs
    loss = _weighted_sum(per_token, mask, weights)
    metrics = _ratio_metrics(ratio, log_ratio, mask)
    metrics["clipped_sum"] = ((ratio.detach() != weight) & mask).sum().to(torch.float64)
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


def top_k_distillation_loss(
    kl: torch.Tensor, mass: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor | None = None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """sum_t mask_t * w_t * KL_t, KL_t = sum_j p_T(j) (log p_T(j) - log pi_theta(j)) over the
    teacher's top k at t (models/logprobs.py `vocab_parallel_top_k_kl`, or with the log-probs and
    entropy from one kernel `vocab_parallel_logprobs_and_top_k_kl`; distillation.mode `top_k_kl`). Metrics, unweighted sums over masked tokens: `teacher_top_k_kl_sum` (KL_t) and
    `teacher_top_k_mass_sum` (m_t = sum_j p_T(j), the teacher's probability the top k holds)."""
    mask = mask.bool()
    loss = _weighted_sum(kl, mask, weights)
    return loss, {
        "teacher_top_k_kl_sum": torch.where(mask, kl.detach(), 0.0).sum().to(torch.float64),
        "teacher_top_k_mass_sum": torch.where(mask, mass.detach(), 0.0).sum().to(torch.float64),
    }


def entropy_bonus(
    entropy: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """sum_t mask_t * w_t * H_t: what `entropy_coef` times is subtracted from the policy loss."""
    return _weighted_sum(entropy, mask.bool(), weights)


# A bound policy loss: f(logprobs, old_logprobs, advantages, mask, *, sequences, weights)
# -> (loss sum, metric sums); algorithms/registry.py documents the protocol.
PolicyObjective = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
