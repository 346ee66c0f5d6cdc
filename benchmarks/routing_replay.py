"""The step-time cost of routing replay: one RL step (`policy_update`, `old_logprobs: recompute`,
so the pi_old pass replays too) of a small MoE policy with `algorithm.routing_replay` off,
`measure` and `replay`, and off / replay with full activation recomputation (the backward then
recomputes every layer, replaying the queued routes), same weights, same samples, same process,
variants interleaved round by round (each round starting with the next variant).

What replay adds per MoE layer and micro-batch: the routes' int64 copy of that layer, a gather of
the router's scores at the replayed experts instead of a top-k, and (measure and replay) the
router's own top-k and the agreement count; per step, the routes' share of the grid on the wire
and in memory (benchmarks/scale.py section 3, the memory plan).

    python benchmarks/routing_replay.py [--samples 64] [--hidden-size 128] [--layers 4] [--experts 8] [--rounds 5]

Writes benchmarks/results/routing_replay.json (`ratio`: replay / off).
"""

from __future__ import annotations

import argparse
import statistics
import time

from _policy_step import one_rank, random_samples  # benchmarks/ is on sys.path when run as a script
from _results import write_result

VARIANTS = {  # name: (routing_replay, activation recomputation)
    "off": ("off", False),
    "measure": ("measure", False),
    "replay": ("replay", False),
    "off, recompute": ("off", True),
    "replay, recompute": ("replay", True),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)

    one_rank()

    import torch

    from megatron_rl import parallel
    from megatron_rl.config import AlgorithmConfig, Architecture, OptimizerConfig
    from megatron_rl.data.packing import pack_into_grid
    from megatron_rl.models.builder import build_gpt_model
    from megatron_rl.policy.update import UpdateSettings, policy_update
    from megatron_rl.trainer.optimizer import build_trainable
    from megatron_rl.transforms.routing import attach_routing

    arch = Architecture(family="qwen3_moe", hidden_size=args.hidden_size, num_layers=args.layers,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=args.hidden_size // 4,
                        intermediate_size=3 * args.hidden_size, vocab_size=512, qk_norm=True,
                        num_experts=args.experts, num_experts_per_tok=args.topk,
                        moe_intermediate_size=args.hidden_size // 2)  # fmt: skip
    samples = random_samples(args.samples, args.seq_len, arch.vocab_size, (args.layers, args.experts, args.topk))
    torch.manual_seed(0)
    initial = build_gpt_model(arch, seq_len=args.seq_len).state_dict()
    trainables, grids, settings = {}, {}, {}
    for name, (mode, recompute) in VARIANTS.items():
        fields = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) if recompute else {}
        model = build_gpt_model(arch, seq_len=args.seq_len, **fields)
        model.load_state_dict(initial)
        routing = attach_routing(model, mode, arch.num_layers, arch.num_experts_per_tok)
        hooks = (routing,) if routing is not None else ()
        trainables[name] = build_trainable(model, OptimizerConfig(lr=1e-6), total_steps=10_000, hooks=hooks)
        grids[name] = pack_into_grid(samples, args.seq_len, 1, routes=mode != "off")[0]
        settings[name] = UpdateSettings(AlgorithmConfig(type="ppo", old_logprobs="recompute", routing_replay=mode))
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    agreement = {}
    names = list(VARIANTS)
    for round_index in range(args.rounds + 1):  # round 0 warms up; each round starts one variant later
        for name in names[round_index % len(names) :] + names[: round_index % len(names)]:
            began = time.perf_counter()
            record = policy_update(trainables[name], grids[name], settings[name])
            if round_index:
                times[name].append(time.perf_counter() - began)
                agreement[name] = record.get("router_agreement")
    parallel.destroy()

    off = statistics.median(times["off"])
    tokens = sum(len(s) for s in samples)
    rows = []
    print(f"{'variant':<20}{'s/step (median)':>16}{'min':>8}{'max':>8}{'/ off':>8}{'router agreement':>18}")
    for name, values in times.items():
        median = statistics.median(values)
        base = statistics.median(times["off, recompute"]) if "recompute" in name else off
        shown = "-" if agreement[name] is None else f"{agreement[name]:.3f}"
        print(f"{name:<20}{median:>16.3f}{min(values):>8.3f}{max(values):>8.3f}{median / base:>8.3f}{shown:>18}")
        rows.append({"variant": name, "median_s": median, "min_s": min(values), "max_s": max(values),
                     "ratio": median / base, "router_agreement": agreement[name]})  # fmt: skip
    figure = statistics.median(times["replay"])
    print("(ratios: against off, the recompute variants against off with recomputation; the routes are random, "
          "so the agreement is chance's: k / experts)")
    out = write_result(
        "routing_replay", figure, off, figure / off,
        {"samples": args.samples, "tokens": tokens, "hidden_size": args.hidden_size, "layers": args.layers,
         "experts": args.experts, "topk": args.topk, "seq_len": args.seq_len, "rounds": args.rounds},
        variants=rows,
    )  # fmt: skip
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
