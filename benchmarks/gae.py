"""Skip-observation GAE: our vectorised scan vs the per-token loop RL frameworks use.

The reference is the loop of verl / NeMo-RL / OpenRLHF (`for t in reversed(range(T))`,
vectorised over the batch), extended to skip observation tokens. Both run in this process on the
same inputs; they must agree to 1e-9. Writes benchmarks/results/gae.json.

    python benchmarks/gae.py [--samples 64] [--tokens 16384] [--repeats 5]
"""

from __future__ import annotations

import argparse
import time

import torch
from _results import write_result  # benchmarks/ is on sys.path when run as a script

from megatron_rl.algorithms.advantages import skip_observation_gae


def make_inputs(samples: int, tokens: int, seed: int = 0) -> dict:
    """~30% observation tokens in several spans after a prompt; half the samples truncated."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(samples, tokens, dtype=torch.bool)
    for b in range(samples):
        prompt = int(torch.randint(100, 600, (1,), generator=g))
        mask[b, prompt:] = True
        spans = int(torch.randint(3, 12, (1,), generator=g))
        budget = int(0.3 * tokens) - prompt
        for _ in range(spans):
            length = max(1, budget // spans)
            start = int(torch.randint(prompt, tokens - length, (1,), generator=g))
            mask[b, start : start + length] = False
    return dict(
        rewards=torch.randn(samples, generator=g, dtype=torch.float64),
        values=torch.randn(samples, tokens, generator=g, dtype=torch.float64),
        loss_mask=mask,
        bootstrap_values=torch.randn(samples, generator=g, dtype=torch.float64),
        truncated=torch.rand(samples, generator=g) < 0.5,
    )


def reference_loop_gae(rewards, values, loss_mask, bootstrap_values, truncated, gamma, lam):
    """Per-token loop, vectorised over the batch, carrying state across observation tokens."""
    batch, tokens = values.shape
    counts = loss_mask.sum(1)
    last_action = torch.where(counts > 0, tokens - 1 - loss_mask.flip(1).to(torch.int8).argmax(1), -1)
    advantages = torch.zeros_like(values)
    returns = torch.zeros_like(values)
    next_value = torch.where(truncated, bootstrap_values, 0.0)
    running = torch.zeros(batch, dtype=torch.float64)
    for t in reversed(range(tokens)):
        is_action = loss_mask[:, t]
        reward = torch.where(last_action == t, rewards, 0.0)
        delta = reward + gamma * next_value - values[:, t]
        gae = delta + gamma * lam * running
        running = torch.where(is_action, gae, running)
        next_value = torch.where(is_action, values[:, t], next_value)
        advantages[:, t] = torch.where(is_action, gae, 0.0)
        returns[:, t] = torch.where(is_action, gae + values[:, t], 0.0)
    return advantages, returns


def best_time(fn, repeats: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--gamma", type=float, default=1.0)
    parser.add_argument("--lam", type=float, default=0.95)
    args = parser.parse_args()
    torch.set_num_threads(1)

    inputs = make_inputs(args.samples, args.tokens)
    skip_observation_gae(**inputs, gamma=args.gamma, lam=args.lam)  # compile the scan once, untimed
    ours_s, (ours_a, ours_r) = best_time(
        lambda: skip_observation_gae(**inputs, gamma=args.gamma, lam=args.lam), args.repeats
    )
    block_s, (block_a, _) = best_time(
        lambda: skip_observation_gae(**inputs, gamma=args.gamma, lam=args.lam, method="blockwise"),
        args.repeats,
    )
    ref_s, (ref_a, ref_r) = best_time(
        lambda: reference_loop_gae(**inputs, gamma=args.gamma, lam=args.lam), max(1, args.repeats // 2)
    )
    max_diff = max(
        float((ours_a - ref_a).abs().max()),
        float((ours_r - ref_r).abs().max()),
        float((block_a - ref_a).abs().max()),
    )
    if max_diff > 1e-9:
        raise SystemExit(f"GAE disagrees with the per-token loop: max abs diff {max_diff:.3e} > 1e-9")

    ratio = ref_s / ours_s
    observation_fraction = 1 - float(inputs["loss_mask"].float().mean())
    print(
        f"skip-observation GAE, {args.samples} samples x {args.tokens} tokens, "
        f"{observation_fraction:.0%} non-action tokens, gamma {args.gamma}, lambda {args.lam}, 1 thread"
    )
    print(f"{'implementation':<34}{'best of runs (ms)':>20}")
    print(f"{'per-token loop (verl-style)':<34}{ref_s * 1e3:>20.1f}")
    print(f"{'ours, blockwise torch (any device)':<34}{block_s * 1e3:>20.1f}   {ref_s / block_s:.1f}x")
    print(f"{'ours, compiled scan (CPU, default)':<34}{ours_s * 1e3:>20.1f}   {ratio:.1f}x")
    print(f"speed-up of the default path: {ratio:.1f}x   max |diff| vs the loop {max_diff:.2e}")

    write_result(
        "gae",
        figure={"name": "skip_observation_gae seconds", "value": ours_s},
        reference={"name": "per-token loop seconds", "value": ref_s},
        ratio=ratio,
        params=vars(args) | {"threads": 1, "observation_fraction": observation_fraction},
        max_abs_diff=max_diff,
        blockwise_seconds=block_s,
        blockwise_ratio=ref_s / block_s,
    )


if __name__ == "__main__":
    main()
