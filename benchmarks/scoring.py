"""Critic scoring throughput: one request per group of 8 sequences (docs/concepts/data-flow.md:
the orchestrator sends one request per group) against one request per sequence, same live critic,
same samples.

Starts `megatron-rl critic` on local gloo ranks with a small random qwen3 model built locally
(by default the size the tests and the CPU demo use), warms it up, then scores every sample both
ways, one request in flight at a time, and reports tokens/s for two workloads: short rollouts
(16..128 tokens) and long ones (64..512 tokens), both under a critic seq_len of 512. Writes
benchmarks/results/scoring.json (`ratio`: the short workload; every workload under
`workloads`); the goal is a ratio >= 3.

    python benchmarks/scoring.py [--groups 16] [--group-size 8] [--world 1] [--hidden-size 64 --layers 2]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from pathlib import Path

import _checkout  # noqa: F401  (tests/support importable)
from _results import write_result  # benchmarks/ is on sys.path when run as a script

ROOT = Path(__file__).resolve().parents[1]


async def timed(scorer, requests) -> float:
    began = time.perf_counter()
    for request in requests:
        await scorer.score(request)
    return time.perf_counter() - began


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--world", type=int, default=1, help="critic ranks (DP)")
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)

    from megatron_rl.critic.client import HttpValueScorer
    from megatron_rl.models.tiny import make_tiny_model
    from megatron_rl.parallel import free_port
    from tests.support.critic import critic_config, critic_url, start_critic

    rng = random.Random(0)
    vocab = 512
    workloads = {
        "short": (16, min(128, args.seq_len)),
        "long": (args.seq_len // 8, args.seq_len),
    }
    data = {
        name: [
            [[rng.randrange(vocab) for _ in range(rng.randint(low, high))] for _ in range(args.group_size)]
            for _ in range(args.groups)
        ]
        for name, (low, high) in workloads.items()
    }
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        hf_dir = make_tiny_model(
            "qwen3", tmp / "model", seed=0, hidden_size=args.hidden_size, layers=args.layers
        )
        resolved, path = critic_config(
            tmp,
            hf_dir,
            world=args.world,
            seq_len=args.seq_len,
            service={"port": free_port(), "max_batch_sequences": 256},
        )
        with start_critic(resolved, path, tmp / "ranks") as ranks:

            async def run(groups):
                scorer = HttpValueScorer(critic_url(resolved))
                try:
                    await timed(scorer, groups[:2])  # warm-up
                    per_group, per_sample = [], []
                    for _ in range(args.repeats):
                        per_group.append(await timed(scorer, groups))
                        per_sample.append(await timed(scorer, [[ids] for group in groups for ids in group]))
                    return min(per_group), min(per_sample)
                finally:
                    await scorer.close()

            times = {name: asyncio.run(run(groups)) for name, groups in data.items()}
            ranks.stop()
    print(
        f"critic scoring: {args.groups} groups x {args.group_size} sequences per workload, seq_len {args.seq_len}, "
        f"{args.world} rank(s), qwen3 {args.layers} layers x {args.hidden_size}, one request in flight"
    )
    print(f"{'workload':<10}{'tokens':>8}{'per group tok/s':>17}{'per sequence tok/s':>20}{'ratio':>8}")
    results = {}
    for name, (group_s, sample_s) in times.items():
        tokens = sum(len(ids) for group in data[name] for ids in group)
        batched, single = tokens / group_s, tokens / sample_s
        results[name] = {
            "lengths": workloads[name],
            "tokens": tokens,
            "per_group_tokens_per_s": batched,
            "per_sequence_tokens_per_s": single,
            "ratio": batched / single,
        }
        print(f"{name:<10}{tokens:>8}{batched:>17.0f}{single:>20.0f}{batched / single:>7.2f}x")
    print("goal: ratio >= 3")
    short = results["short"]
    out = write_result(
        "scoring",
        figure={"tokens_per_s": short["per_group_tokens_per_s"]},
        reference={"tokens_per_s": short["per_sequence_tokens_per_s"]},
        ratio=short["ratio"],
        params=vars(args),
        workloads=results,
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
