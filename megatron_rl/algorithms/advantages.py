"""Advantages: skip-observation GAE (PPO, SAO; needs the critic's values), the critic's
version-aware value targets (`version_bootstrap_returns`), and the outcome estimators (GRPO,
Dr. GRPO, RLOO, REINFORCE++, REINFORCE++ with a group baseline), which see only each member's
scalar reward.

Outcome estimators take the step's groups as a list of 1-D float64 tensors of member rewards and
return each member's advantage in the same shape (`algorithms.registry` documents the protocol).
Group-relative ones use the member's own group; the REINFORCE++ ones whiten over every action
token of the step, so they also take each member's action-token count. Definitions follow verl 0.9.1 (`verl.trainer.ppo.core_algos`); where they differ it
is said at the function.

All GAE arithmetic is float64. CPU tensors go through a compiled single-pass scan
(`_gae_kernel`, numba); other devices (or a machine without numba) through the vectorised
blockwise solve below, which works on any device. In the blockwise solve, the recursion
A_k = delta_k + c * A_{k+1} (c = gamma * lambda) is solved as A = M @ delta with the upper
triangular Toeplitz matrix M[k, j] = c^(j - k), computed blockwise: within blocks of L tokens,
then once more over the blocks' first entries with c^L. Powers are taken directly (never
c^-k * c^j), so nothing overflows; entries that underflow to 0 are below float64 resolution.
Memory is O(B * T * L) with L ~ sqrt(T). A recursion cut after some tokens (the version-aware
targets) is the uncut solve minus, at each token, the discounted uncut solve from the token after
its cut on (`_cut_suffix_sum`); the scan simply drops A_{k+1} there.
"""

from __future__ import annotations

import math

import torch

from megatron_rl.algorithms import _gae_kernel
from megatron_rl.algorithms.parts import register_advantage


def length_adaptive_lambda(num_action_tokens: torch.Tensor, alpha: float) -> torch.Tensor:
    """VAPO's lambda = 1 - 1 / (alpha * l), clamped to [0, 1]; `l` per sample, returns [B] float64."""
    length = torch.as_tensor(num_action_tokens, dtype=torch.float64)
    lam = 1.0 - 1.0 / (alpha * length)
    return torch.nan_to_num(lam, neginf=0.0).clamp(0.0, 1.0)


def _discounted_suffix_sum(delta: torch.Tensor, discount: torch.Tensor) -> torch.Tensor:
    """out[b, k] = sum_{j >= k} discount[b]^(j - k) * delta[b, j]; delta [B, K] float64, discount [B]."""
    batch, length = delta.shape
    if length == 0:
        return delta.clone()
    block = max(1, math.isqrt(length - 1) + 1)
    num_blocks = -(-length // block)
    padded = delta.new_zeros(batch, num_blocks * block)
    padded[:, :length] = delta
    blocks = padded.view(batch, num_blocks, block)

    steps = torch.arange(block, dtype=torch.float64, device=delta.device)
    offsets = steps[None, :] - steps[:, None]  # [L, L]: j - k
    upper = offsets >= 0
    within = torch.where(upper, torch.pow(discount[:, None, None], offsets.clamp(min=0)), 0.0)  # [B, L, L]
    local = torch.einsum("bkj,bnj->bnk", within, blocks)  # suffix sums inside each block

    # S_n = local[n, 0] + c^L * S_{n+1}: the same Toeplitz solve over the blocks, ratio c^L.
    block_steps = torch.arange(num_blocks, dtype=torch.float64, device=delta.device)
    block_offsets = block_steps[None, :] - block_steps[:, None]
    across = torch.where(
        block_offsets >= 0, torch.pow(discount[:, None, None] ** block, block_offsets.clamp(min=0)), 0.0
    )
    block_heads = torch.einsum(
        "bnm,bm->bn", across, local[:, :, 0]
    )  # [B, num_blocks]: full A at block starts
    # A at (n, k) = local[n, k] + c^(L - k) * S_{n+1}
    next_heads = torch.cat([block_heads[:, 1:], block_heads.new_zeros(batch, 1)], dim=1)
    carry = torch.pow(discount[:, None], (block - steps)[None, :])  # [B, L]
    full = local + carry[:, None, :] * next_heads[:, :, None]
    return full.reshape(batch, -1)[:, :length]


def _compact_action_tokens(loss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Positions of action tokens moved to the front of each row, in order.

    Returns (order [B, T] int64, valid [B, K] bool, counts [B]) where K = max action count.
    """
    counts = loss_mask.sum(dim=1)
    order = torch.sort((~loss_mask).to(torch.int8), dim=1, stable=True).indices
    longest = int(counts.max()) if counts.numel() else 0
    valid = torch.arange(longest, device=loss_mask.device)[None, :] < counts[:, None]
    return order, valid, counts


def skip_observation_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    loss_mask: torch.Tensor,
    bootstrap_values: torch.Tensor,
    truncated: torch.Tensor,
    gamma: float,
    lam: float | torch.Tensor,
    kl_rewards: torch.Tensor | None = None,
    method: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over action tokens only; observation and prompt tokens are skipped.

    For action tokens t_1 < ... < t_K of a sample (loss_mask True), with reward R on t_K plus
    optional per-token `kl_rewards`:
        delta_k = r_k + gamma * V(t_{k+1}) - V(t_k),  V(t_{K+1}) = bootstrap if truncated else 0
        A_k     = delta_k + gamma * lambda * A_{k+1}
        returns_k = A_k + V(t_k)
    This equals ordinary GAE on the sequence with the non-action tokens deleted.

    Args: rewards [B]; values, loss_mask, kl_rewards [B, T] (right-padded); bootstrap_values,
    truncated [B]; lam a float or [B]. Returns (advantages, returns), [B, T] float64, 0 off the
    action tokens. `method`: "auto" (compiled scan for CPU tensors when available), "scan" or
    "blockwise".
    """
    mask = loss_mask.bool()
    return _gae(rewards, values, mask, bootstrap_values, truncated, gamma, lam, kl_rewards, method)


def _gae(rewards, values, mask, bootstrap_values, truncated, gamma, lam, kl_rewards, method, continues=None):
    """The GAE recursion by the chosen method; `continues` [B, T] bool (None: never cut) cuts it
    after each action token where it is False."""
    batch = mask.shape[0]
    lam = torch.as_tensor(lam, dtype=torch.float64, device=mask.device).expand(batch)
    if method == "auto":
        method = "scan" if mask.device.type == "cpu" and _gae_kernel.available() else "blockwise"
    if method == "scan":
        as_numpy = lambda x: torch.as_tensor(x).detach().cpu().numpy()  # noqa: E731
        advantages, returns = _gae_kernel.scan_gae(
            as_numpy(rewards),
            as_numpy(values.to(torch.float64)),
            as_numpy(mask),
            as_numpy(bootstrap_values),
            as_numpy(truncated),
            gamma,
            as_numpy(lam),
            None if kl_rewards is None else as_numpy(kl_rewards),
            None if continues is None else as_numpy(continues),
        )
        return torch.from_numpy(advantages), torch.from_numpy(returns)
    return _blockwise_gae(
        rewards, values, mask, bootstrap_values, truncated, gamma, lam, kl_rewards, continues
    )


def _cut_suffix_sum(
    suffix_sums: torch.Tensor, discount: torch.Tensor, continues: torch.Tensor
) -> torch.Tensor:
    """The suffix sums cut after every k where `continues` is False: with e the first such index at
    or after k, A_k = F_k - discount^(e + 1 - k) * F_{e + 1} (F_K = 0), since F_k is A_k plus the
    discounted F from e + 1 on. suffix_sums (F) [B, K] float64, discount [B], continues [B, K] bool
    (False at the last entry of each row). Powers are taken directly, as in _discounted_suffix_sum."""
    batch, length = suffix_sums.shape
    steps = torch.arange(length, device=suffix_sums.device).expand(batch, length)
    cut_at = torch.where(continues, length - 1, steps)
    ends = torch.flip(torch.cummin(torch.flip(cut_at, [1]), dim=1).values, [1])  # e
    after = ends + 1
    padded = torch.cat([suffix_sums, suffix_sums.new_zeros(batch, 1)], dim=1)
    beyond = torch.gather(padded, 1, after)  # F_{e + 1}
    return suffix_sums - torch.pow(discount[:, None], (after - steps).to(torch.float64)) * beyond


def _blockwise_gae(
    rewards, values, mask, bootstrap_values, truncated, gamma, lam, kl_rewards, continues=None
):
    """skip_observation_gae by compaction of action tokens and a blockwise Toeplitz solve; with
    `continues`, cut by _cut_suffix_sum."""
    batch = mask.shape[0]
    values = values.to(torch.float64)
    order, valid, counts = _compact_action_tokens(mask)
    longest = valid.shape[1]
    gather = order[:, :longest]

    step_values = torch.where(valid, torch.gather(values, 1, gather), 0.0)  # V(t_k)
    last = (counts - 1).clamp(min=0)
    tail = torch.where(
        torch.as_tensor(truncated, dtype=torch.bool, device=mask.device),
        torch.as_tensor(bootstrap_values, dtype=torch.float64, device=mask.device),
        0.0,
    )
    next_values = torch.cat([step_values[:, 1:], step_values.new_zeros(batch, 1)], dim=1)
    is_last = torch.arange(longest, device=mask.device)[None, :] == last[:, None]
    next_values = torch.where(is_last, tail[:, None], next_values)  # V(t_{k+1}), bootstrap at the end

    step_rewards = torch.where(is_last, torch.as_tensor(rewards, dtype=torch.float64)[:, None], 0.0)
    if kl_rewards is not None:
        step_rewards = step_rewards + torch.gather(kl_rewards.to(torch.float64), 1, gather)
    delta = torch.where(valid, step_rewards + gamma * next_values - step_values, 0.0)

    compact_advantages = _discounted_suffix_sum(delta, gamma * lam)
    if continues is not None:
        compact_continues = valid & torch.gather(continues, 1, gather)
        compact_advantages = _cut_suffix_sum(compact_advantages, gamma * lam, compact_continues)
    compact_returns = compact_advantages + step_values

    advantages = torch.zeros_like(values)
    returns = torch.zeros_like(values)
    advantages.scatter_(1, gather, torch.where(valid, compact_advantages, 0.0))
    returns.scatter_(1, gather, torch.where(valid, compact_returns, 0.0))
    # Rows with fewer actions than `longest` scattered their zero padding onto non-action
    # positions; re-mask so those stay exactly 0.
    return advantages * mask, returns * mask


@register_advantage("gae", needs_critic=True)
def decoupled_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    loss_mask: torch.Tensor,
    bootstrap_values: torch.Tensor,
    truncated: torch.Tensor,
    gamma: float,
    policy_lambda: float,
    value_lambda: float = 1.0,
    length_adaptive_alpha: float | None = None,
    kl_rewards: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Policy advantages with `policy_lambda` (or VAPO's length-adaptive lambda when
    `length_adaptive_alpha` is set) and value targets with `value_lambda`.

    Returns (advantages, returns), both [B, T] float64.
    """
    if length_adaptive_alpha is not None:
        policy_lambda = length_adaptive_lambda(loss_mask.sum(dim=1), length_adaptive_alpha)
    args = (rewards, values, loss_mask, bootstrap_values, truncated, gamma)
    advantages, _ = skip_observation_gae(*args, policy_lambda, kl_rewards=kl_rewards)
    _, returns = skip_observation_gae(*args, value_lambda, kl_rewards=kl_rewards)
    return advantages, returns


def _version_cuts(
    mask: torch.Tensor, versions: torch.Tensor, current_version: int, max_lag: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(continues, cuts), [B, T] bool: for each action token t_k with a next action token t_{k+1},
    whether the lambda-return continues into it (same version, lag within max_lag) or is cut.
    Both are False off the action tokens and at each sample's last action token."""
    batch, length = mask.shape
    positions = torch.arange(length, device=mask.device).expand(batch, length)
    action_positions = torch.where(mask, positions, length)
    first_action_from = torch.flip(torch.cummin(torch.flip(action_positions, [1]), dim=1).values, [1])
    no_action = first_action_from.new_full((batch, 1), length)
    next_action = torch.cat([first_action_from[:, 1:], no_action], dim=1)[:, :length]  # t_{k+1} for t_k
    has_next = mask & (next_action < length)
    next_versions = torch.gather(versions, 1, next_action.clamp(max=max(length - 1, 0)))
    continues = has_next & (next_versions == versions)
    if max_lag is not None:
        continues &= current_version - versions <= max_lag
    return continues, has_next & ~continues


def version_bootstrap_returns(
    rewards: torch.Tensor,
    values: torch.Tensor,
    loss_mask: torch.Tensor,
    bootstrap_values: torch.Tensor,
    truncated: torch.Tensor,
    gamma: float,
    lam: float | torch.Tensor,
    token_versions: torch.Tensor,
    current_version: int,
    max_lag: int | None = None,
    kl_rewards: torch.Tensor | None = None,
    method: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The critic's value targets with the lambda-return cut at every policy-version boundary and
    at stale tokens, bootstrapped on the critic's own value there.

    Over the action tokens t_1 < ... < t_K of a sample, as in skip_observation_gae (reward R on
    t_K plus optional `kl_rewards`, V(t_{K+1}) = bootstrap if truncated else 0), with
    v_k = token_versions[t_k] and lag_k = current_version - v_k:
        c_k = 1 if k < K and v_{k+1} == v_k and (max_lag is None or lag_k <= max_lag), else 0
        delta_k = r_k + gamma * V(t_{k+1}) - V(t_k)
        A_k = delta_k + gamma * lambda * c_k * A_{k+1}
        returns_k = A_k + V(t_k)
    i.e. G_k = r_k + gamma * V(t_{k+1}) + gamma * lambda * c_k * (G_{k+1} - V(t_{k+1})): a cut
    return is the one-step target r_k + gamma * V(t_{k+1}). A token with lag > max_lag is cut
    after itself, so it gets the one-step target (lambda = 0). Versions of prompt and observation
    tokens are not read. With one version per sample and no max_lag this is skip_observation_gae's
    returns, bit for bit.

    Args as in skip_observation_gae, plus token_versions [B, T] (integer, the policy version that
    sampled each token), current_version (the policy version the targets are for; lag 0 is
    on-policy) and max_lag (>= 0, or None: no staleness bound). Returns (returns, cuts): returns
    [B, T] float64, 0 off the action tokens; cuts [B, T] bool, True on each action token k < K
    whose return is cut after it (a version boundary or a stale token). Raises ValueError for
    token_versions of another shape or a float dtype, a version on an action token newer than
    current_version, or a negative max_lag.
    """
    mask = loss_mask.bool()
    versions = torch.as_tensor(token_versions)
    if versions.shape != mask.shape:
        raise ValueError(
            f"token_versions: shape {tuple(versions.shape)}, expected loss_mask's {tuple(mask.shape)}"
        )
    if versions.is_floating_point() or versions.is_complex() or versions.dtype == torch.bool:
        raise ValueError(f"token_versions: dtype {versions.dtype}, expected an integer dtype")
    if max_lag is not None and max_lag < 0:
        raise ValueError(f"max_lag: {max_lag}, expected >= 0 or None")
    versions = versions.to(device=mask.device, dtype=torch.int64)
    newer = mask & (versions > current_version)
    if newer.any():
        sample = int(newer.any(dim=1).nonzero()[0])
        raise ValueError(
            f"token_versions: sample {sample} has action tokens of version "
            f"{int(versions[sample][newer[sample]].max())}, newer than current_version {current_version}"
        )
    continues, cuts = _version_cuts(mask, versions, current_version, max_lag)
    args = (rewards, values, mask, bootstrap_values, truncated, gamma, lam, kl_rewards, method)
    _, returns = _gae(*args, continues)
    return returns, cuts


def grpo_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, normalize_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """A_i = (R_i - mean_g(R)) / (std_g(R) + eps) within each group g (std unbiased; a group of
    one or with equal rewards gets advantage 0). Returns [N] float64."""
    rewards = torch.as_tensor(rewards, dtype=torch.float64)
    _, group = torch.unique(torch.as_tensor(group_ids), return_inverse=True)
    num_groups = int(group.max()) + 1 if group.numel() else 0
    counts = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group, torch.ones_like(rewards))
    means = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group, rewards) / counts
    centered = rewards - means[group]
    if not normalize_std:
        return centered
    squares = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group, centered**2)
    std = torch.sqrt(squares / (counts - 1).clamp(min=1))
    return centered / (std[group] + eps)


# -- outcome estimators over a step's groups ------------------------------------------------------

WHITEN_EPS = 1e-8  # verl_F.masked_whiten: (x - mean) * rsqrt(var + 1e-8)


def _by_group(groups: list[torch.Tensor], normalize_std: bool, eps: float = 1e-6) -> list[torch.Tensor]:
    """`grpo_advantages` over the step's groups, split back per group."""
    if not groups:
        return []
    sizes = [g.numel() for g in groups]
    group_ids = torch.repeat_interleave(torch.arange(len(groups)), torch.tensor(sizes))
    return list(torch.split(grpo_advantages(torch.cat(groups), group_ids, normalize_std, eps), sizes))


def _centered(groups: list[torch.Tensor]) -> list[torch.Tensor]:
    """R_i - mean of the member's group (a group of one: 0, it has no baseline)."""
    return _by_group(groups, normalize_std=False)


@register_advantage("grpo", group_baseline=True)
def group_normalised(groups: list[torch.Tensor], eps: float = 1e-6) -> list[torch.Tensor]:
    """GRPO: (R_i - mean_g) / (std_g + eps), std unbiased (`grpo_advantages`).
    verl gives a group of one its raw reward (mean 0, std 1); here it gets 0, like a group of
    equal rewards: one sample has no baseline to be better or worse than."""
    return _by_group(groups, normalize_std=True, eps=eps)


@register_advantage("dr_grpo", group_baseline=True)
def group_mean_centered(groups: list[torch.Tensor]) -> list[torch.Tensor]:
    """Dr. GRPO (Liu et al., 2025): R_i - mean_g, no division by the std (verl: grpo with
    norm_adv_by_std_in_grpo=False). A group of one gets 0."""
    return _centered(groups)


@register_advantage("rloo", group_baseline=True)
def leave_one_out(groups: list[torch.Tensor]) -> list[torch.Tensor]:
    """RLOO (Ahmadian et al., 2024): R_i - mean of the other members = n / (n - 1) * (R_i - mean_g),
    verl's formula. verl leaves a group of one its raw reward; here it gets 0."""
    return [c * (g.numel() / (g.numel() - 1)) if g.numel() > 1 else c for g, c in zip(groups, _centered(groups))]


def token_whitened(values: list[torch.Tensor], action_tokens: list[torch.Tensor]) -> list[torch.Tensor]:
    """verl's masked_whiten of one scalar per member laid on each of its K_i action tokens: the
    mean and unbiased variance run over every action token of the step, so a member weighs K_i
    times (n = sum_i K_i):
        mean = sum_i K_i x_i / n,  var = sum_i K_i (x_i - mean)^2 / (n - 1),
        A_i = (x_i - mean) / sqrt(var + 1e-8).
    `values` (float64) and `action_tokens` (K_i, integers) per group, in the same shapes; returns
    A_i in those shapes. Fewer than two action tokens in the step: 0 (verl raises). Whitening over
    members instead (one count each) would differ by sqrt(K (N - 1) / (N K - 1)) even with every
    K_i = K, and more when lengths differ."""
    if len(values) != len(action_tokens):
        raise ValueError(f"action_tokens: {len(action_tokens)} groups for {len(values)} groups of values")
    for i, (v, k) in enumerate(zip(values, action_tokens)):
        if tuple(torch.as_tensor(k).shape) != tuple(v.shape):
            raise ValueError(f"action_tokens of group {i}: shape {tuple(torch.as_tensor(k).shape)}, values {tuple(v.shape)}")
    if not values:
        return []
    flat = torch.cat(values).to(torch.float64)
    counts = torch.cat([torch.as_tensor(k) for k in action_tokens]).to(torch.float64)
    if (counts < 0).any():
        raise ValueError(f"action_tokens: negative counts {counts[counts < 0].tolist()}")
    tokens = counts.sum()
    if tokens < 2:
        return [torch.zeros_like(v) for v in values]
    mean = (counts * flat).sum() / tokens
    var = (counts * (flat - mean) ** 2).sum() / (tokens - 1)
    scale = torch.rsqrt(var + WHITEN_EPS)
    return [(v - mean) * scale for v in values]


@register_advantage("reinforce_pp")
def reinforce_plus_plus(groups: list[torch.Tensor], *, action_tokens: list[torch.Tensor]) -> list[torch.Tensor]:
    """REINFORCE++ (Hu, 2025), verl's: the return whitened over every action token of the step
    (`token_whitened`; `action_tokens` holds each member's count). With one outcome reward at the
    last token the return is R at every action token for gamma 1; verl's per-token discount
    (gamma < 1) is not applied: `algorithm.gamma` is GAE's."""
    return token_whitened(groups, action_tokens)


@register_advantage("reinforce_pp_baseline", group_baseline=True)
def reinforce_plus_plus_baseline(
    groups: list[torch.Tensor], *, action_tokens: list[torch.Tensor]
) -> list[torch.Tensor]:
    """REINFORCE++ with a group baseline, verl's reinforce_plus_plus_baseline: R_i - mean_g (the
    members' mean), then whitened over every action token of the step (`token_whitened`). A group
    of one is centred to 0 here; verl keeps its R."""
    return token_whitened(_centered(groups), action_tokens)


def masked_whiten(rows: list[torch.Tensor], masks: list[torch.Tensor]) -> list[torch.Tensor]:
    """verl's masked_whiten over all rows together: (x - mean) * rsqrt(var + 1e-8) with mean and
    unbiased var over the masked entries of every row; 0 off the mask. Fewer than two masked
    entries: the rows unchanged (verl raises)."""
    flat = torch.cat([r[m] for r, m in zip(rows, masks)]) if rows else torch.zeros(0, dtype=torch.float64)
    if flat.numel() < 2:
        return rows
    mean, var = flat.mean(), flat.var(unbiased=True)
    scale = torch.rsqrt(var + WHITEN_EPS)
    return [torch.where(m, (r - mean) * scale, 0.0) for r, m in zip(rows, masks)]
