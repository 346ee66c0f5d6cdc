"""The cost of the policy update's options: one RL step (`policy_update`) with N = 1, 2, 4
mini-batches and with `old_logprobs: recompute` on and off, against the plain step (N = 1,
`sampler`), same model, same samples, same process, variants interleaved round by round.

A step's tokens are the same in every variant: N mini-batches cut them into N optimizer steps of
1/N of the tokens each (the forward and backward work is the same; each extra optimizer step,
its gradient reduction and its smaller, less efficient micro-batches cost more); `recompute`
adds one forward-only pass over the step's tokens.

    python benchmarks/minibatches.py [--samples 64] [--hidden-size 128] [--layers 4] [--rounds 5]

Writes benchmarks/results/minibatches.json (`ratio`: N = 4 with recompute / plain).
"""

from __future__ import annotations

import argparse
import statistics
import time

from _policy_step import one_rank, random_samples  # benchmarks/ is on sys.path when run as a script
from _results import write_result

VARIANTS = {  # name: (policy_minibatches, old_logprobs)
    "plain (N=1, sampler)": (1, "sampler"),
    "N=2": (2, "sampler"),
    "N=4": (4, "sampler"),
    "recompute (N=1)": (1, "recompute"),
    "N=4 + recompute": (4, "recompute"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)

    one_rank()


    from megatron_rl import parallel
    from megatron_rl.config import AlgorithmConfig, Architecture, OptimizerConfig
    from megatron_rl.data.packing import pack_minibatches
    from megatron_rl.models.builder import build_gpt_model
    from megatron_rl.policy.update import UpdateSettings, policy_update
    from megatron_rl.trainer.optimizer import build_trainable

    arch = Architecture(family="qwen3", hidden_size=args.hidden_size, num_layers=args.layers,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=args.hidden_size // 4,
                        intermediate_size=3 * args.hidden_size, vocab_size=512, qk_norm=True)  # fmt: skip
    samples = random_samples(args.samples, args.seq_len, arch.vocab_size)
    model = build_gpt_model(arch, seq_len=args.seq_len)
    trainable = build_trainable(model, OptimizerConfig(lr=1e-6), total_steps=10_000)
    grids = {
        name: pack_minibatches(samples, n, (0, 0), args.seq_len, 1)[0] for name, (n, _) in VARIANTS.items()
    }
    settings = {
        name: UpdateSettings(AlgorithmConfig(type="ppo", policy_minibatches=n, old_logprobs=old))
        for name, (n, old) in VARIANTS.items()
    }
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    splits: dict[str, dict] = {}
    for round_index in range(args.rounds + 1):  # round 0 warms up
        for name in VARIANTS:
            began = time.perf_counter()
            record = policy_update(trainable, grids[name], settings[name])
            if round_index:
                times[name].append(time.perf_counter() - began)
                splits[name] = record["time"]
    parallel.destroy()

    plain = statistics.median(times["plain (N=1, sampler)"])
    tokens = sum(s.num_action_tokens for s in samples)
    rows = []
    print(f"{'variant':<22}{'s/step (median)':>16}{'min':>8}{'max':>8}{'/ plain':>9}{'recompute s':>13}"
          f"{'correction s':>14}{'train s':>9}")  # fmt: skip
    for name, values in times.items():
        median = statistics.median(values)
        split = {key: splits[name].get(key) for key in ("recompute", "correction", "train")}
        cells = "".join(f"{(f'{split[k]:.3f}' if split[k] is not None else '-'):>{w}}"
                        for k, w in (("recompute", 13), ("correction", 14), ("train", 9)))  # fmt: skip
        print(f"{name:<22}{median:>16.3f}{min(values):>8.3f}{max(values):>8.3f}{median / plain:>9.2f}{cells}")
        rows.append({"variant": name, "median_s": median, "min_s": min(values), "max_s": max(values),
                     "ratio_to_plain": median / plain, **{f"{k}_s": v for k, v in split.items()}})  # fmt: skip
    figure = statistics.median(times["N=4 + recompute"])
    out = write_result(
        "minibatches", figure, plain, figure / plain,
        {"samples": args.samples, "action_tokens": tokens, "hidden_size": args.hidden_size,
         "layers": args.layers, "seq_len": args.seq_len, "rounds": args.rounds},
        variants=rows,
    )  # fmt: skip
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
