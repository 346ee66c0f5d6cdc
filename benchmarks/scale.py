"""Scale by simulation: the real orchestrator against a simulated 30B cluster
(megatron_rl/sim/cluster.py: inference servers, critic and policy that spend simulated time from
a token-rate and a FLOPs model, real ZMQ grids and real /score encoding on a virtual clock).

1. Scale: SAO (examples/configs/qwen3_30b_a3b_sao.yaml, group size 1, max_async_level 1) at
   `--sizes` rollouts a step: the orchestrator's own CPU seconds per step (process CPU minus the
   stand-ins') against the simulated step, the fitted exponent of CPU vs rollouts (goal <= 1.1)
   and the share at the largest size (goal < 1%); bytes on the wire per step (score requests and
   replies, both grids) and the grids' transport time at the throughput measured in the run.
2. Asynchrony: 64 rollouts a step, max_async_level 0, 1 and 2, with generation as long as the
   rest of a synchronous step (--balance, the default: each algorithm's inference rates are
   scaled so, measured on a level-0 run at the given rates; GRPO has no critic to train, so its
   servers get faster): the median step time, async / sync (goal <= 0.6), and the
   inference servers' busy fraction with the long completion tail; for group size 1 (SAO) and
   8 (GRPO, examples/configs/qwen3_30b_a3b_grpo.yaml: no critic).
3. Routing replay: the policy grid at the smallest size with `algorithm.routing_replay: replay`
   (the samples carry vLLM's routes) against the same run without: bytes a token more, beside
   what they should be (layers x top-k uint8 experts and one `routed` byte).

Every parameter of the cluster model is a flag (below; defaults: the 30B configs and the seed's
figures, 227-773 s critic steps at 64 x 31K tokens on 4 GPUs and a 48.7 s NCCL broadcast).
Writes benchmarks/results/scale.json (or --out).

    python benchmarks/scale.py [--sizes 64,256,1024,4096] [--steps 3] [--async-steps 8] [--FLAG VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
from _results import write_result  # benchmarks/ is on sys.path when run as a script

from megatron_rl.sim.cluster import SimCluster, cluster_config, steady_step_s
from megatron_rl.sim.models import ClusterModel

ROOT = Path(__file__).resolve().parents[1]
SAO = ROOT / "examples/configs/qwen3_30b_a3b_sao.yaml"
GRPO = ROOT / "examples/configs/qwen3_30b_a3b_grpo.yaml"


def simulate(example, model, seed, algorithm=None, **orchestrator):
    run_dir = tempfile.mkdtemp(prefix="bench_scale_")
    resolved = cluster_config(example, run_dir, algorithm, **orchestrator)
    return SimCluster(resolved, model, seed=seed, run_dir=run_dir).run()


def fitted_exponent(sizes, values) -> float:
    """Slope of log(values) against log(sizes), least squares."""
    return float(np.polyfit(np.log(sizes), np.log(values), 1)[0])


def scale_row(size: int, steps: int, model: ClusterModel, seed: int, routing_replay: str = "off") -> dict:
    result = simulate(SAO, model, seed, {"routing_replay": routing_replay}, batch_size=size, group_size=1,
                      num_steps=steps, max_async_level=1)  # fmt: skip
    cpu_per_step = result.orchestrator_cpu_s / result.steps
    step_s = result.step_end_s[-1] / result.steps  # simulated seconds per step, warm-up included
    grid_bytes = sum(result.grid_bytes.values())
    throughput = grid_bytes / sum(result.grid_wall_s.values())
    tokens = sum(s for r in result.records for s in [r["sequence_tokens_mean"] * r["samples"]]) / result.steps
    return {
        "rollouts": size, "tokens_per_step": tokens, "orchestrator_cpu_s_per_step": cpu_per_step,
        "standin_cpu_s_per_step": result.standin_cpu_s / result.steps, "step_s": step_s,
        "share": cpu_per_step / step_s, "score_calls_per_step": len(result.score_calls) / result.steps,
        "score_request_bytes_per_step": result.score_request_bytes / result.steps,
        "score_reply_bytes_per_step": result.score_reply_bytes / result.steps,
        "critic_grid_bytes_per_step": result.grid_bytes["critic"] / result.steps,
        "policy_grid_bytes_per_step": result.grid_bytes["policy"] / result.steps,
        "grid_throughput_bytes_per_s": throughput,
        "grid_transport_s_per_step": grid_bytes / result.steps / throughput, "wall_s": result.wall_s,
        "policy_grid_tokens_per_step": result.grid_tokens["policy"] / result.steps, "routing_replay": routing_replay,
    }  # fmt: skip


def balanced(example, group_size: int, steps: int, model: ClusterModel, seed: int) -> tuple[ClusterModel, dict]:
    """The cluster model with the inference rates (decode and prefill) scaled so that one batch's
    generation takes as long as the rest of a synchronous step (scoring, training, the
    broadcast): the regime where asynchrony can at best halve the step. Measured on a
    `max_async_level` 0 run at `model`'s rates (medians after the first step); returns the
    scaled model and what the calibration measured."""
    result = simulate(example, model, seed, batch_size=64 // group_size, group_size=group_size, num_steps=steps,
                      max_async_level=0, max_off_policy_steps=1)  # fmt: skip
    generate = float(np.median([r["time"]["generate"] for r in result.records[1:]]))
    rest = steady_step_s(result) - generate
    factor = generate / rest
    scaled = replace(model, decode_tokens_per_s=model.decode_tokens_per_s * factor,
                     prefill_tokens_per_s=model.prefill_tokens_per_s * factor)  # fmt: skip
    return scaled, {"generate_s": generate, "rest_s": rest, "rate_factor": factor,
                    "decode_tokens_per_s": scaled.decode_tokens_per_s}  # fmt: skip


def async_row(example, group_size: int, level: int, steps: int, model: ClusterModel, seed: int) -> dict:
    result = simulate(example, model, seed, batch_size=64 // group_size, group_size=group_size, num_steps=steps,
                      max_async_level=level, max_off_policy_steps=max(1, level))  # fmt: skip
    train = [r["time"].get("critic_train", 0.0) for r in result.records]
    generate = [r["time"]["generate"] for r in result.records]
    steady_generate = float(np.median(generate[1:]))
    tokens = np.asarray(result.completion_tokens)
    return {
        "group_size": group_size, "max_async_level": level, "step_s": steady_step_s(result),
        "server_busy": result.server_busy, "server_slots": result.server_slots,
        "first_step_generate_s": generate[0], "first_step_critic_train_s": train[0],
        "generate_wait_s": steady_generate, "decode_tokens_per_s": model.decode_tokens_per_s,
        "completion_p50": float(np.percentile(tokens, 50)), "completion_p99": float(np.percentile(tokens, 99)),
        "truncated": float(np.mean([r["truncation_rate"] for r in result.records])),
        "stale_dropped": sum(r["stale_dropped"] for r in result.records), "wall_s": result.wall_s,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="64,256,1024,4096", help="rollouts a step of the scale table")
    parser.add_argument("--steps", type=int, default=3, help="steps of each scale run")
    parser.add_argument("--async-steps", type=int, default=8, help="steps of each asynchrony run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out", default=None, help="write the JSON here instead of benchmarks/results/scale.json"
    )
    for name, kind, default, text in ClusterModel.flags():
        parser.add_argument(f"--{name.replace('_', '-')}", dest=name, type=kind, default=default,
                            help=f"{text} (default {default})")  # fmt: skip
    parser.add_argument(
        "--balance", action=argparse.BooleanOptionalAction, default=True,
        help="scale each asynchrony run's inference rates so that generation takes as long as the rest "
        "of a sync step (measured on a max_async_level 0 run at the given rates)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    model = ClusterModel(**{name: getattr(args, name) for name, *_ in ClusterModel.flags()})
    try:
        model.check()
        sizes = [int(s) for s in args.sizes.split(",")]
    except ValueError as exc:
        parser.error(f"{exc} (--sizes {args.sizes!r})" if "invalid literal" in str(exc) else str(exc))
    if len(sizes) < 2 or min(sizes) < 1 or args.steps < 1 or args.async_steps < 3:
        parser.error("--sizes needs two or more sizes >= 1, --steps >= 1, --async-steps >= 3")

    rows = [scale_row(size, args.steps, model, args.seed) for size in sizes]
    print(f"1. SAO, group size 1, max_async_level 1, {args.steps} steps each (CPU: the orchestrator's own)")
    print(f"{'rollouts':>9}{'tokens':>12}{'CPU s/step':>12}{'step s':>10}{'share':>9}{'score MB':>10}"
          f"{'critic grid MB':>15}{'policy grid MB':>15}{'wire s':>8}")  # fmt: skip
    for r in rows:
        score = (r["score_request_bytes_per_step"] + r["score_reply_bytes_per_step"]) / 1e6
        print(f"{r['rollouts']:>9,}{r['tokens_per_step']:>12,.0f}{r['orchestrator_cpu_s_per_step']:>12.2f}"
              f"{r['step_s']:>10.0f}{100 * r['share']:>8.3f}%{score:>10.1f}{r['critic_grid_bytes_per_step'] / 1e6:>15.1f}"
              f"{r['policy_grid_bytes_per_step'] / 1e6:>15.1f}{r['grid_transport_s_per_step']:>8.2f}")  # fmt: skip
    exponent = fitted_exponent(sizes, [r["orchestrator_cpu_s_per_step"] for r in rows])
    largest = rows[-1]
    throughput = np.mean([r["grid_throughput_bytes_per_s"] for r in rows]) / 1e6
    print(f"fitted exponent of CPU vs rollouts: {exponent:.3f} (goal <= 1.1); share at {largest['rollouts']:,}: "
          f"{100 * largest['share']:.3f}% (goal < 1%); grids at the measured {throughput:.0f} MB/s")  # fmt: skip

    replayed = scale_row(sizes[0], args.steps, model, args.seed, routing_replay="replay")
    plain = rows[0]
    added = replayed["policy_grid_bytes_per_step"] - plain["policy_grid_bytes_per_step"]
    per_token = added / replayed["policy_grid_tokens_per_step"]
    arch = cluster_config(SAO, tempfile.mkdtemp(prefix="bench_scale_")).layout.policy_architecture
    expected = arch.num_layers * arch.num_experts_per_tok + 1  # uint8 experts, and the `routed` flag
    print(f"routing replay at {sizes[0]} rollouts: policy grid {replayed['policy_grid_bytes_per_step'] / 1e6:.1f} MB "
          f"a step against {plain['policy_grid_bytes_per_step'] / 1e6:.1f} MB without (x "
          f"{replayed['policy_grid_bytes_per_step'] / plain['policy_grid_bytes_per_step']:.2f}): {per_token:.1f} "
          f"bytes a token more ({arch.num_layers} layers x top-{arch.num_experts_per_tok} uint8 + 1 = {expected})")  # fmt: skip

    async_rows, calibration = [], {}
    for example, group_size in ((SAO, 1), (GRPO, 8)):
        rates = model
        if args.balance:
            rates, calibration[group_size] = balanced(example, group_size, args.async_steps, model, args.seed)
            c = calibration[group_size]
            print(f"group size {group_size}: generation {c['generate_s']:.0f} s, the rest of a sync step "
                  f"{c['rest_s']:.0f} s at --decode-tokens-per-s {model.decode_tokens_per_s:g}: inference "
                  f"rates x {c['rate_factor']:.3f} (decode {rates.decode_tokens_per_s:.1f} tokens/s)")  # fmt: skip
        for level in (0, 1, 2):
            async_rows.append(async_row(example, group_size, level, args.async_steps, rates, args.seed))
    print(f"\n2. 64 rollouts a step, {args.async_steps} steps (median step after the first)")
    print(f"{'group':>6}{'async':>6}{'step s':>9}{'/ sync':>8}{'busy':>7}{'slots':>7}{'gen s':>8}{'critic s':>9}"
          f"{'p50 tok':>8}{'p99 tok':>8}{'trunc':>7}")  # fmt: skip
    ratios = {}
    for r in async_rows:
        sync = next(x for x in async_rows if x["group_size"] == r["group_size"] and x["max_async_level"] == 0)
        r["ratio"] = ratios[(r["group_size"], r["max_async_level"])] = r["step_s"] / sync["step_s"]
        print(f"{r['group_size']:>6}{r['max_async_level']:>6}{r['step_s']:>9.0f}{r['ratio']:>8.3f}{r['server_busy']:>7.2f}"
              f"{r['server_slots']:>7.3f}{r['first_step_generate_s']:>8.0f}{r['first_step_critic_train_s']:>9.0f}"
              f"{r['completion_p50']:>8.0f}{r['completion_p99']:>8.0f}{r['truncated']:>7.3f}")  # fmt: skip
    best = min(ratios[(1, 1)], ratios[(1, 2)])
    for group_size in (1, 8):
        print(f"async / sync, group size {group_size}: {ratios[(group_size, 1)]:.3f} (level 1), "
              f"{ratios[(group_size, 2)]:.3f} (level 2); goal <= 0.6")  # fmt: skip

    record = dict(
        figure={"cpu_exponent": exponent, "largest_share": largest["share"], "async_over_sync": best},
        reference={"goal_exponent": 1.1, "goal_share": 0.01, "goal_async_over_sync": 0.6},
        ratio=best, params=vars(args) | {"model": asdict(model)}, scale=rows, asynchrony=async_rows,
        routing_replay={"row": replayed, "bytes_per_token": per_token, "expected_bytes_per_token": expected},
        calibration={str(g): c for g, c in calibration.items()},
    )  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=2))
        print(f"wrote {args.out}")
    else:
        print(f"wrote {write_result('scale', **record)}")
    return 0 if math.isfinite(exponent) else 1


if __name__ == "__main__":
    sys.exit(main())
