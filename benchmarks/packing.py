"""Packing quality on 16k-context math-RL lengths: our packer vs two baselines, side by side.

256 samples: prompts 100-600 tokens, completions log-normal (median 3,000) capped at 15,000;
seq_len 16,384; DP 2 and 4. Baselines: one sample per micro-batch, and first-fit in arrival
order without balancing (bins dealt round-robin to ranks). Writes benchmarks/results/packing.json.

    python benchmarks/packing.py [--samples 256] [--seq-len 16384] [--seed 0]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from _results import write_result  # benchmarks/ is on sys.path when run as a script

from megatron_rl.data.packing import _micro_batch, dummy_micro_batch, pack_into_grid, packing_stats
from megatron_rl.data.types import TrainingSample


def math_rl_samples(count: int, seed: int) -> list[TrainingSample]:
    rng = np.random.default_rng(seed)
    prompts = rng.integers(100, 601, count)
    completions = np.minimum(rng.lognormal(np.log(3000), 0.9, count).astype(int) + 1, 15_000)
    samples = []
    for p, c in zip(prompts, completions):
        n = int(p + c)
        mask = np.zeros(n, dtype=bool)
        mask[p:] = True
        samples.append(
            TrainingSample(
                token_ids=np.zeros(n, np.int64),
                loss_mask=mask,
                inference_logprobs=np.zeros(n, np.float32),
                reward=0.0,
            )
        )
    return samples


def deal_round_robin(samples, bins: list[list[int]], dp: int):
    rows = [[] for _ in range(dp)]
    for k, items in enumerate(bins):
        rows[k % dp].append(_micro_batch(samples, items, 1))
    steps = max(len(r) for r in rows)
    return [r + [dummy_micro_batch() for _ in range(steps - len(r))] for r in rows]


def one_per_micro_batch(samples, seq_len, dp):
    return deal_round_robin(samples, [[i] for i in range(len(samples))], dp)


def first_fit_unbalanced(samples, seq_len, dp):
    bins: list[list[int]] = []
    used: list[int] = []
    for i, s in enumerate(samples):
        for k in range(len(bins)):
            if used[k] + len(s) <= seq_len:
                bins[k].append(i)
                used[k] += len(s)
                break
        else:
            bins.append([i])
            used.append(len(s))
    return deal_round_robin(samples, bins, dp)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=16_384)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    samples = math_rl_samples(args.samples, args.seed)

    packers = {
        "megatron_rl pack_into_grid": lambda dp: pack_into_grid(samples, args.seq_len, dp),
        "one sample per micro-batch": lambda dp: one_per_micro_batch(samples, args.seq_len, dp),
        "first-fit, no balancing": lambda dp: first_fit_unbalanced(samples, args.seq_len, dp),
    }
    results = {}
    print(f"{args.samples} samples, seq_len {args.seq_len}, total {sum(len(s) for s in samples):,} tokens")
    print(
        f"{'DP':>3} {'packer':<30}{'bins':>6}{'lower bd':>9}{'bins/lb':>9}{'fill':>7}{'DP imbal':>10}{'steps':>7}{'ms':>8}"
    )
    for dp in (2, 4):
        for name, pack in packers.items():
            start = time.perf_counter()
            grid = pack(dp)
            elapsed = time.perf_counter() - start
            stats = packing_stats(grid, args.seq_len)
            stats["bins_over_lower_bound"] = stats["num_bins"] / stats["lower_bound_bins"]
            stats["seconds"] = elapsed
            results[f"dp{dp}/{name}"] = stats
            print(
                f"{dp:>3} {name:<30}{stats['num_bins']:>6}{stats['lower_bound_bins']:>9}"
                f"{stats['bins_over_lower_bound']:>9.3f}{stats['fill_ratio']:>7.3f}{stats['dp_imbalance']:>10.4f}"
                f"{stats['micro_steps']:>7}{elapsed * 1e3:>8.1f}"
            )

    ours = [results[f"dp{dp}/megatron_rl pack_into_grid"] for dp in (2, 4)]
    reference = [results[f"dp{dp}/first-fit, no balancing"] for dp in (2, 4)]
    figure = {
        "max_bins_over_lower_bound": max(s["bins_over_lower_bound"] for s in ours),
        "max_dp_imbalance": max(s["dp_imbalance"] for s in ours),
    }
    ref = {
        "max_bins_over_lower_bound": max(s["bins_over_lower_bound"] for s in reference),
        "max_dp_imbalance": max(s["dp_imbalance"] for s in reference),
    }
    ratio = ref["max_dp_imbalance"] / figure["max_dp_imbalance"]
    print(
        f"goal: bins <= 1.03 x lower bound (ours {figure['max_bins_over_lower_bound']:.3f}), "
        f"DP imbalance <= 1.05 (ours {figure['max_dp_imbalance']:.4f}, first-fit {ref['max_dp_imbalance']:.4f})"
    )
    write_result("packing", figure=figure, reference=ref, ratio=ratio, params=vars(args), runs=results)


if __name__ == "__main__":
    main()
