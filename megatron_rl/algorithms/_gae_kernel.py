"""The compiled GAE scan for CPU tensors (numba): one reverse pass per sample, float64.

It is the recursion itself (A_k = delta_k + c * A_{k+1}, multiply-adds with c <= 1), so it
cannot overflow or underflow; `advantages.skip_observation_gae` uses it for CPU tensors and its
vectorised blockwise solve elsewhere. Both are tested against a plain per-token loop. An optional
per-token `continues` mask (`advantages.version_bootstrap_returns`) cuts the recursion after an
action token where it is False: A_k = delta_k there.
"""

from __future__ import annotations

import numpy as np

try:
    import numba
except ImportError:  # the vectorised torch path serves when numba is absent
    numba = None


def _scan(
    rewards,
    values,
    mask,
    bootstrap,
    truncated,
    gamma,
    lam,
    kl,
    has_kl,
    continues,
    has_continues,
    advantages,
    returns,
):
    batch, tokens = values.shape
    for b in range(batch):
        next_value = bootstrap[b] if truncated[b] else 0.0
        running = 0.0
        reward_pending = True  # the terminal reward sits on the last action token
        discount = gamma * lam[b]
        for t in range(tokens - 1, -1, -1):
            if mask[b, t]:
                r = 0.0
                if reward_pending:
                    r = rewards[b]
                    reward_pending = False
                if has_kl:
                    r += kl[b, t]
                if has_continues and not continues[b, t]:
                    running = 0.0
                running = r + gamma * next_value - values[b, t] + discount * running
                advantages[b, t] = running
                returns[b, t] = running + values[b, t]
                next_value = values[b, t]


_compiled = numba.njit(cache=True, nogil=True)(_scan) if numba is not None else None


def available() -> bool:
    return _compiled is not None


def scan_gae(rewards, values, mask, bootstrap, truncated, gamma, lam, kl=None, continues=None):
    """numpy in, (advantages, returns) float64 [B, T] out; inputs as in skip_observation_gae, and
    `continues` [B, T] bool (None: never cut)."""
    advantages = np.zeros(values.shape, dtype=np.float64)
    returns = np.zeros(values.shape, dtype=np.float64)
    has_kl = kl is not None
    kl = np.ascontiguousarray(kl, dtype=np.float64) if has_kl else np.zeros((1, 1), dtype=np.float64)
    has_continues = continues is not None
    continues = (
        np.ascontiguousarray(continues, dtype=np.bool_) if has_continues else np.ones((1, 1), dtype=np.bool_)
    )
    _compiled(
        np.ascontiguousarray(rewards, dtype=np.float64),
        np.ascontiguousarray(values, dtype=np.float64),
        np.ascontiguousarray(mask, dtype=np.bool_),
        np.ascontiguousarray(bootstrap, dtype=np.float64),
        np.ascontiguousarray(truncated, dtype=np.bool_),
        float(gamma),
        np.ascontiguousarray(lam, dtype=np.float64),
        kl,
        has_kl,
        continues,
        has_continues,
        advantages,
        returns,
    )
    return advantages, returns
