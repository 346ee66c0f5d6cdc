"""Rollout correction: importance weights and rejection against the train-inference mismatch, with
verl's names and meanings (`verl/trainer/ppo/rollout_corr_helper.py`, 0.9.1).

With `old_logprobs: recompute` the ratio of the loss is pi_theta / pi_old, pi_old the trainer's
own forward pass before the step's first update. The sampler (vLLM, other kernels and often
bf16) drew the tokens from pi_sampler != pi_old; with log rho_t = log pi_old(y_t) - log
pi_sampler(y_t) on every action token t:

- importance weights (`rollout_is`), detached, multiplying each token's policy loss:
    token       w_t = rho_t
    sequence    w_t = prod_{u in s} rho_u           (s the token's sequence; exp of the sum of logs)
    geometric   w_t = exp(mean_{u in s} log rho_u)  (the geometric mean; not an IS level of verl 0.9.1)
  the exponent clamped to [-20, 20], then truncated at U (TIS, `rollout_is_threshold: U`) or zeroed
  outside [L, U] (MIS / IcePop, `rollout_is_threshold: "L_U"`; the token stays in the normaliser),
  optionally divided by their batch mean (`rollout_is_batch_normalize`).
- rejection (`rollout_rs`): tokens or whole sequences whose divergence is out of bounds leave the
  loss and its normaliser. Per token, with lr_t = clamp(log rho_t, -20, 20): k1_t = -lr_t,
  k2_t = lr_t^2 / 2, k3_t = exp(lr_t) - 1 - lr_t; rules token_kN (per token), seq_sum_kN,
  seq_mean_kN (sum / mean over the sequence's action tokens), seq_max_kN (maximum); k1 rules keep
  log L <= stat <= log U (bounds on pi_sampler / pi_old, as verl reads them), the others stat <= U.
- metrics: mismatch k1 = mean(log pi_sampler - log pi_old), k3 = mean(rho - 1 - log rho),
  chi-squared per token mean(rho^2) - 1 and per sequence mean((prod rho)^2) - 1; the weights'
  mean over action tokens (as applied: truncated or zeroed), min and max; fractions of tokens and
  sequences truncated, zeroed or rejected. min and max are verl's (compute_is_metrics): of the
  applied weights for `token`, of the raw sequence ratio for `sequence` (and `geometric`, the
  same reading): exp(min log w) and exp(min(max log w, 20)) over the sequences with an action
  token, before truncation, zeroing or batch normalisation, so they show how far the ratios
  went, not only the threshold.

A packed sequence may be split over CP ranks: per-sequence sums and maxima are reduced over the
CP group by the `cp_reduce` callable the trainer passes (identity when cp is 1), so this module
stays free of torch.distributed; each sequence is counted once, on the rank owning its first token.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatron_rl.config.algorithm import RolloutCorrectionConfig

SAFETY_BOUND = 20.0  # verl's: exp(+-20) bounds every weight

# cp_reduce(tensor [K] float64, op "sum" | "max") -> the tensor reduced over the CP group.
CpReduce = Callable[[torch.Tensor, str], torch.Tensor]


@dataclass
class TokenView:
    """One micro-batch's action tokens as one CP rank holds them (the next-token aligned slice)."""

    log_ratio: torch.Tensor  # [n] float64: log pi_old - log pi_sampler (0 off the mask)
    mask: torch.Tensor  # [n] bool: action tokens
    sequence_of_token: torch.Tensor  # [n] int64, in [0, num_sequences)
    num_sequences: int  # sequences of the row (the padding tail counts as one)
    owned: torch.Tensor  # [num_sequences] bool: this CP rank holds the sequence's first token


@dataclass
class Correction:
    weights: torch.Tensor | None  # [n] float32 detached importance weights (None: no rollout_is)
    keep: torch.Tensor  # [n] bool: action tokens that stay in the loss after rejection


def _segment_sum(values: torch.Tensor, view: TokenView) -> torch.Tensor:
    out = torch.zeros(view.num_sequences, dtype=torch.float64, device=values.device)
    return out.index_add_(0, view.sequence_of_token, torch.where(view.mask, values, 0.0).to(torch.float64))


def _segment_max(values: torch.Tensor, view: TokenView) -> torch.Tensor:
    out = torch.full((view.num_sequences,), -math.inf, dtype=torch.float64, device=values.device)
    masked = torch.where(view.mask, values.to(torch.float64), -math.inf)
    return out.scatter_reduce_(0, view.sequence_of_token, masked, reduce="amax")


def _token_divergences(log_ratio: torch.Tensor) -> dict[str, torch.Tensor]:
    safe = torch.clamp(log_ratio, -SAFETY_BOUND, SAFETY_BOUND)
    return {"k1": -safe, "k2": 0.5 * safe.square(), "k3": torch.expm1(safe) - safe}


# Per-sequence statistics, reduced over CP: (name, reduction).
_SEQUENCE_STATS = (("log_ratio", "sum"), ("count", "sum"), ("k1", "sum"), ("k2", "sum"), ("k3", "sum"),
                   ("k2_max", "max"), ("k3_max", "max"))  # fmt: skip


def _reduced(views: list[TokenView], per_view: list[torch.Tensor], op: str, cp_reduce: CpReduce):
    """per_view[i] ([S_i] of view i) reduced over CP in one call, split back per view."""
    if not views:
        return []
    flat = cp_reduce(torch.cat(per_view), op)
    return list(torch.split(flat, [v.num_sequences for v in views]))


def sequence_statistics(views: list[TokenView], cp_reduce: CpReduce) -> list[dict[str, torch.Tensor]]:
    """Per view, {stat: [S] float64} over each whole sequence (every CP rank's share)."""
    divergences = [_token_divergences(v.log_ratio) for v in views]
    stats: list[dict[str, torch.Tensor]] = [{} for _ in views]
    for name, op in _SEQUENCE_STATS:
        local = []
        for view, divergence in zip(views, divergences):
            if name == "log_ratio":
                local.append(_segment_sum(view.log_ratio, view))
            elif name == "count":
                local.append(_segment_sum(torch.ones_like(view.log_ratio), view))
            elif name.endswith("_max"):
                local.append(_segment_max(divergence[name[:2]], view))
            else:
                local.append(_segment_sum(divergence[name], view))
        for i, reduced in enumerate(_reduced(views, local, op, cp_reduce)):
            stats[i][name] = reduced
    return stats


def sequence_log_weights(config: RolloutCorrectionConfig, stats: dict) -> torch.Tensor:
    """[S] float64: each sequence's raw log importance weight for a sequence-level `rollout_is`
    (the sum of its tokens' log rho for `sequence`, their mean for `geometric`), unclamped."""
    if config.rollout_is == "sequence":
        return stats["log_ratio"]
    return stats["log_ratio"] / stats["count"].clamp(min=1.0)


def _weight_extremes(config: RolloutCorrectionConfig, applied: torch.Tensor, stats: dict):
    """(max, min) float64 scalars of one view for the metrics (-inf, inf when it has none): for
    `token` of the `applied` weights (its action tokens'); for the sequence levels of the raw
    sequence ratios, exp(min(max log w, 20)) and exp(min log w) over sequences with an action
    token, as verl's compute_is_metrics."""
    if config.rollout_is == "token":
        values = applied.double()
        if not values.numel():
            return values.new_tensor(-math.inf), values.new_tensor(math.inf)
        return values.max(), values.min()
    log_w = sequence_log_weights(config, stats)[stats["count"] > 0]
    if not log_w.numel():
        return log_w.new_tensor(-math.inf), log_w.new_tensor(math.inf)
    return torch.exp(log_w.max().clamp(max=SAFETY_BOUND)), torch.exp(log_w.min())


def importance_weights(
    config: RolloutCorrectionConfig, view: TokenView, stats: dict
) -> tuple[torch.Tensor, torch.Tensor]:
    """(w [n] float64 applied weights, flagged [n] bool: truncated (TIS) or zeroed (IcePop))."""
    seq = view.sequence_of_token
    if config.rollout_is == "token":
        log_w = view.log_ratio
    else:  # sequence or geometric
        log_w = sequence_log_weights(config, stats)[seq]
    raw = torch.exp(torch.clamp(log_w, -SAFETY_BOUND, SAFETY_BOUND))
    lower, upper = config.importance_bounds()
    if lower is None:
        flagged = raw > upper
        weights = torch.clamp(raw, max=upper)
    else:
        flagged = (raw < lower) | (raw > upper)
        weights = torch.where(flagged, 0.0, raw)
    mask = view.mask
    return torch.where(mask, weights, 0.0), flagged & mask


def rejection_keep(config: RolloutCorrectionConfig, view: TokenView, stats: dict) -> torch.Tensor:
    """[n] bool: action tokens every `rollout_rs` rule keeps."""
    token = _token_divergences(view.log_ratio)
    keep = view.mask.clone()
    seq = view.sequence_of_token
    count = stats["count"].clamp(min=1.0)
    for rule, lower, upper in config.rejection_rules():
        level, divergence = rule.rsplit("_", 1)
        if level == "token":
            stat = token[divergence]
        elif level == "seq_sum":
            stat = stats[divergence][seq]
        elif level == "seq_mean":
            stat = (stats[divergence] / count)[seq]
        else:  # seq_max
            stat = stats[f"{divergence}_max"][seq]
        if divergence == "k1":
            keep &= (stat >= math.log(lower)) & (stat <= math.log(upper))
        else:
            keep &= stat <= upper
    return keep


def apply(
    config: RolloutCorrectionConfig | None, views: list[TokenView], cp_reduce: CpReduce
) -> tuple[list[Correction], dict[str, torch.Tensor]]:
    """The correction of every view (`config` None: only the mismatch metrics; every weight 1,
    nothing rejected), and this rank's summed metrics (float64 scalars: `*_sum`, `*_max`,
    `*_min`, counts), to be reduced over the role's DP x CP ranks by the trainer. Batch
    normalisation is left to the trainer (`batch_mean_terms`), which needs the global mean."""
    stats = sequence_statistics(views, cp_reduce)
    corrections, flagged_tokens = [], []
    for view, seq_stats in zip(views, stats):
        weights, flagged = (None, torch.zeros_like(view.mask))
        if config is not None and config.rollout_is is not None:
            weights, flagged = importance_weights(config, view, seq_stats)
        rejecting = config is not None and config.rollout_rs
        keep = rejection_keep(config, view, seq_stats) if rejecting else view.mask.clone()
        corrections.append(Correction(None if weights is None else weights.to(torch.float32), keep))
        flagged_tokens.append(flagged)
    # Sequences with a flagged / rejected token: counts per sequence, reduced over CP.
    flagged_per_seq = _reduced(
        views, [_segment_sum(f.double(), v) for v, f in zip(views, flagged_tokens)], "sum", cp_reduce
    )
    rejected_per_seq = _reduced(
        views,
        [_segment_sum((v.mask & ~c.keep).double(), v) for v, c in zip(views, corrections)],
        "sum",
        cp_reduce,
    )
    metrics = _zero_metrics(views)
    for i, view in enumerate(views):
        mask, lr = view.mask, view.log_ratio
        safe = torch.clamp(lr, -SAFETY_BOUND, SAFETY_BOUND)
        owned = view.owned & (stats[i]["count"] > 0)
        seq_safe = torch.clamp(stats[i]["log_ratio"], -SAFETY_BOUND, SAFETY_BOUND)
        metrics["num_tokens"] += mask.sum()
        metrics["sequences"] += owned.sum()
        metrics["mismatch_k1_sum"] += torch.where(mask, -lr, 0.0).sum()
        metrics["mismatch_k3_sum"] += torch.where(mask, torch.expm1(safe) - safe, 0.0).sum()
        metrics["mismatch_ratio_squared_sum"] += torch.where(mask, torch.exp(2.0 * safe), 0.0).sum()
        metrics["mismatch_seq_ratio_squared_sum"] += torch.where(owned, torch.exp(2.0 * seq_safe), 0.0).sum()
        if corrections[i].weights is not None:
            w = corrections[i].weights.double()
            metrics["rollout_is_weight_sum"] += torch.where(mask, w, 0.0).sum()
            largest, smallest = _weight_extremes(config, w[mask], stats[i])
            metrics["rollout_is_weight_max"] = torch.maximum(metrics["rollout_is_weight_max"], largest)
            metrics["rollout_is_weight_min"] = torch.minimum(metrics["rollout_is_weight_min"], smallest)
            metrics["rollout_is_flagged_tokens"] += flagged_tokens[i].sum()
            metrics["rollout_is_flagged_sequences"] += (owned & (flagged_per_seq[i] > 0)).sum()
        metrics["rollout_rs_rejected_tokens"] += (mask & ~corrections[i].keep).sum()
        metrics["rollout_rs_rejected_sequences"] += (owned & (rejected_per_seq[i] > 0)).sum()
    return corrections, metrics


def _zero_metrics(views: list[TokenView]) -> dict[str, torch.Tensor]:
    device = views[0].log_ratio.device if views else None
    zero = torch.zeros((), dtype=torch.float64, device=device)
    names = ("num_tokens", "sequences", "mismatch_k1_sum", "mismatch_k3_sum", "mismatch_ratio_squared_sum",
             "mismatch_seq_ratio_squared_sum", "rollout_is_weight_sum", "rollout_is_flagged_tokens",
             "rollout_is_flagged_sequences", "rollout_rs_rejected_tokens", "rollout_rs_rejected_sequences")  # fmt: skip
    metrics = {name: zero.clone() for name in names}
    metrics["rollout_is_weight_max"] = torch.full((), -math.inf, dtype=torch.float64, device=device)
    metrics["rollout_is_weight_min"] = torch.full((), math.inf, dtype=torch.float64, device=device)
    return metrics


def batch_mean_terms(
    config: RolloutCorrectionConfig, views: list[TokenView], weights: list[torch.Tensor], cp_reduce: CpReduce
) -> torch.Tensor:
    """[2] float64 (sum, count): this rank's share of the batch mean `rollout_is_batch_normalize`
    divides by: over action tokens for `token`, over sequences (one weight each, counted on the
    rank owning the sequence's first token) for `sequence` and `geometric`."""
    terms = torch.zeros(2, dtype=torch.float64, device=weights[0].device if weights else None)
    if config.rollout_is == "token":
        for view, w in zip(views, weights):
            terms += torch.stack([torch.where(view.mask, w.double(), 0.0).sum(), view.mask.sum().double()])
        return terms
    # Every action token of a sequence carries its sequence's weight; the owner may hold none of
    # them (the sequence continues on the next CP rank): take the maximum over the CP group.
    per_seq = _reduced(views, [_segment_max(w.double(), v) for v, w in zip(views, weights)], "max", cp_reduce)
    for view, seq_weights in zip(views, per_seq):
        owned = view.owned & torch.isfinite(seq_weights)
        terms += torch.stack([torch.where(owned, seq_weights, 0.0).sum(), owned.sum().double()])
    return terms


def summarise(metrics: dict[str, float]) -> dict[str, float | None]:
    """Means and fractions of globally reduced `apply` metrics, under the names the policy's
    metrics line uses."""
    tokens, sequences = max(metrics["num_tokens"], 1.0), max(metrics["sequences"], 1.0)
    out = {
        "mismatch_kl_k1": metrics["mismatch_k1_sum"] / tokens,
        "mismatch_kl": metrics["mismatch_k3_sum"] / tokens,
        "mismatch_chi2_token": metrics["mismatch_ratio_squared_sum"] / tokens - 1.0,
        "mismatch_chi2_seq": metrics["mismatch_seq_ratio_squared_sum"] / sequences - 1.0,
        "rollout_rs_masked_fraction": metrics["rollout_rs_rejected_tokens"] / tokens,
        "rollout_rs_seq_masked_fraction": metrics["rollout_rs_rejected_sequences"] / sequences,
    }
    if math.isfinite(metrics.get("rollout_is_weight_max", -math.inf)):
        out.update(
            rollout_is_mean=metrics["rollout_is_weight_sum"] / tokens,
            rollout_is_max=metrics["rollout_is_weight_max"],
            rollout_is_min=metrics["rollout_is_weight_min"],
            rollout_is_flagged_fraction=metrics["rollout_is_flagged_tokens"] / tokens,
            rollout_is_seq_flagged_fraction=metrics["rollout_is_flagged_sequences"] / sequences,
        )
    return out
