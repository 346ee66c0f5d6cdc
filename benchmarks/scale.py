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

4. The long tail of the target runs: SAO, 64 rollouts a step, completions lognormal up to a
   31,744-token budget (median 4,000, sigma 0.9: p99 at the budget), policy and critic seq_len
   32,768 at the smallest context parallelism the memory plan accepts; batch order dataset /
   finish / finish with partial rollouts (`inference.update_mode: interrupt`; the others keep)
   at max_async_level 1 and 2 and max_off_policy_steps 1, 4, 8 (a bound below the level is
   skipped), oversample --tail-oversample under finish order and a sweep of it; against the
   synchronous baseline of the same configuration (level 0, dataset order, keep): step time,
   async / sync (goal <= 0.5), servers busy generating (goal >= 0.9), slots, tokens re-prefilled
   per weight update, tokens generated and never trained, stale groups, the samples' version
   span. Written to benchmarks/results/scale_tail.json.

Every parameter of the cluster model is a flag (below; defaults: the 30B configs and the seed's
figures, 227-773 s critic steps at 64 x 31K tokens on 4 GPUs and a 48.7 s NCCL broadcast).
Writes benchmarks/results/scale.json (sections 1-3) and scale_tail.json (section 4), or --out.

    python benchmarks/scale.py [--sections 1,2,3,4] [--sizes 64,256,1024,4096] [--steps 3] [--async-steps 8]
                               [--tail-steps 12] [--FLAG VALUE ...]
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

from megatron_rl.config import ConfigError
from megatron_rl.sim.cluster import SimCluster, cluster_config, steady_step_s
from megatron_rl.sim.models import ClusterModel

ROOT = Path(__file__).resolve().parents[1]
SAO = ROOT / "examples/configs/qwen3_30b_a3b_sao.yaml"
GRPO = ROOT / "examples/configs/qwen3_30b_a3b_grpo.yaml"


def simulate(example, model, seed, algorithm=None, settings=None, **orchestrator):
    run_dir = tempfile.mkdtemp(prefix="bench_scale_")
    resolved = cluster_config(example, run_dir, algorithm, settings, **orchestrator)
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


# Section 4: the long tail of the target runs
TAIL_ROWS = (("dataset", "keep"), ("finish", "keep"), ("finish", "interrupt"))  # batch order, update mode


def tail_settings(args, update_mode: str, cp: int) -> dict:
    """The config keys beyond the orchestrator's: both models' seq_len and CP, the update mode."""
    return {"model.seq_len": args.tail_seq_len, "value.model.seq_len": args.tail_seq_len, "model.cp": cp,
            "value.model.cp": cp, "inference.update_mode": update_mode}  # fmt: skip


def tail_context_parallel(args) -> int:
    """The smallest context parallelism (1, 2, 4) at which the 30B SAO config with seq_len
    --tail-seq-len passes the config's checks, its memory plan included."""
    errors = []
    for cp in (1, 2, 4):
        try:
            cluster_config(SAO, tempfile.mkdtemp(prefix="bench_scale_"), None, tail_settings(args, "keep", cp),
                           max_completion_tokens=args.tail_budget)  # fmt: skip
            return cp
        except ConfigError as exc:
            errors.append(f"cp {cp}: {exc}")
    raise SystemExit("section 4: no context parallelism fits: " + "; ".join(errors))


def busy_spans(events, start: str, end: str, offset: int) -> float:
    """Median simulated seconds from each `start` event of step n to the `end` event of step
    n + offset, after the first step."""
    begun = {a: t for t, kind, a, _ in events if kind == start}
    ended = {a - offset: t for t, kind, a, _ in events if kind == end}
    spans = [ended[n] - begun[n] for n in sorted(begun) if n in ended and n > 0]
    return float(np.median(spans)) if spans else 0.0


def tail_row(order: str, mode: str, level: int, bound: int, oversample: int, args, model, cp: int) -> dict:
    result = simulate(SAO, model, args.seed, settings=tail_settings(args, mode, cp), batch_size=args.tail_rollouts,
                      group_size=1, num_steps=args.tail_steps, max_async_level=level, max_off_policy_steps=bound,
                      max_completion_tokens=args.tail_budget, batch_order=order, oversample=oversample)  # fmt: skip
    records, updates = result.records, max(1, len(result.updates))
    spans = [r["version_span_mean"] for r in records if r["version_span_mean"] is not None]
    trained = sum(r["completion_tokens_mean"] * r["samples"] for r in records if r["samples"])
    tokens = np.asarray(result.completion_tokens)
    return {
        "batch_order": order, "update_mode": mode, "max_async_level": level, "max_off_policy_steps": bound,
        "oversample": oversample, "step_s": steady_step_s(result), "server_busy": result.server_busy_steady,
        "server_slots": result.server_slots_steady, "server_busy_whole_run": result.server_busy,
        "server_paused": result.server_paused_steady,
        "window_step_mean_s": (result.step_end_s[-1] - result.step_end_s[1]) / (result.steps - 2),
        "server_reprefilling": result.server_reprefilling, "updates": len(result.updates),
        "reprefilled_tokens_per_update": sum(result.reprefilled_tokens.values()) / updates,
        "wasted_tokens_per_step": result.wasted_tokens / result.steps, "wasted_share": result.wasted_tokens / (trained + result.wasted_tokens),
        "trained_tokens_per_step": trained / result.steps, "stale_dropped": sum(r["stale_dropped"] for r in records),
        "wasted_groups": len(result.wasted_groups), "unconsumed_groups_at_end": result.unconsumed_groups,
        "version_span_mean": float(np.mean(spans)) if spans else 0.0,
        "version_span_max": max((r["version_span_max"] or 0 for r in records), default=0),
        "samples_spanning_versions": sum(r["samples_spanning_versions"] for r in records),
        "true_version_span_mean": float(np.mean(result.true_version_spans)) if result.true_version_spans else 0.0,
        "interruptions": sum(r["interruptions"] for r in records),
        "generate_s": float(np.median([r["time"]["generate"] for r in records[1:]])),
        "critic_s": busy_spans(result.events, "critic_train_start", "critic_trained", 0),
        "policy_and_broadcast_s": busy_spans(result.events, "policy_train_start", "version_live", 1),
        "score_s": float(np.median([r["time"]["score"] for r in records[1:]])),
        "completion_p50": float(np.percentile(tokens, 50)), "completion_p99": float(np.percentile(tokens, 99)),
        "truncated": float(np.mean([r["truncation_rate"] for r in records])), "steps": result.steps,
        "wall_s": result.wall_s,
    }  # fmt: skip


def tail_sync_and_ratios(sync: dict, rows: list[dict]) -> None:
    """Each row's step time and time per trained token as a fraction of the synchronous run's."""
    per_token = sync["step_s"] / sync["trained_tokens_per_step"]
    for row in [sync, *rows]:
        row["ratio"] = row["step_s"] / sync["step_s"]
        row["per_token_ratio"] = row["step_s"] / row["trained_tokens_per_step"] / per_token


def print_tail_rows(rows: list[dict]) -> None:
    print(f"{'order':>8}{'update':>10}{'level':>6}{'stale':>6}{'over':>5}{'step s':>8}{'/ sync':>8}{'/tok':>6}{'busy':>6}"
          f"{'slots':>7}{'paused':>7}{'reprefill/upd':>14}{'trained/step':>13}{'wasted/step':>12}{'dropped':>8}"
          f"{'span':>6}{'max':>4}{'true':>6}{'gen s':>7}{'critic s':>9}{'policy+bc s':>12}")  # fmt: skip
    for r in rows:
        print(f"{r['batch_order']:>8}{r['update_mode']:>10}{r['max_async_level']:>6}{r['max_off_policy_steps']:>6}"
              f"{r['oversample']:>5}{r['step_s']:>8.0f}{r['ratio']:>8.3f}{r['per_token_ratio']:>6.2f}{r['server_busy']:>6.2f}"
              f"{r['server_slots']:>7.3f}{r['server_paused']:>7.2f}{r['reprefilled_tokens_per_update']:>14,.0f}"
              f"{r['trained_tokens_per_step']:>13,.0f}{r['wasted_tokens_per_step']:>12,.0f}{r['stale_dropped']:>8}"
              f"{r['version_span_mean']:>6.2f}{r['version_span_max']:>4}{r['true_version_span_mean']:>6.2f}"
              f"{r['generate_s']:>7.0f}{r['critic_s']:>9.0f}{r['policy_and_broadcast_s']:>12.0f}")  # fmt: skip


def tail_section(args, model: ClusterModel) -> dict:
    """Section 4: the grid of TAIL_ROWS x levels x staleness bounds against the synchronous
    baseline (level 0, dataset order, update mode keep), the oversample sweep, and the level-1
    partial-rollout rows again with a shorter broadcast (against their own baseline)."""
    tail = replace(model, completion_median_tokens=args.tail_median_tokens, completion_sigma=args.tail_sigma)
    cp = tail_context_parallel(args)
    sync = tail_row("dataset", "keep", 0, 1, 0, args, tail, cp)
    rows, skipped = [], []
    for order, mode in TAIL_ROWS:
        for level in args.tail_levels:
            for bound in args.tail_bounds:
                if bound < level:  # the lead gate lets batches start `level` versions back: all stale
                    if {"max_async_level": level, "max_off_policy_steps": bound} not in skipped:
                        skipped.append({"max_async_level": level, "max_off_policy_steps": bound})
                    continue
                oversample = args.tail_oversample if order == "finish" else 0
                rows.append(tail_row(order, mode, level, bound, oversample, args, tail, cp))
    sweep_values = sorted({int(x) for x in args.tail_oversample_sweep.split(",") if x} - {args.tail_oversample})
    sweep = [tail_row("finish", "interrupt", 1, args.tail_sweep_bound, o, args, tail, cp) for o in sweep_values]
    tail_sync_and_ratios(sync, rows + sweep)
    print(f"\n4. The long tail: SAO, {args.tail_rollouts} rollouts a step (group size 1), lognormal completions "
          f"(median {args.tail_median_tokens:g}, sigma {args.tail_sigma:g}, budget {args.tail_budget:,}: p50 "
          f"{sync['completion_p50']:.0f}, p99 {sync['completion_p99']:.0f}, {sync['truncated']:.1%} truncated), "
          f"seq_len {args.tail_seq_len:,} at CP {cp}, {args.tail_steps} steps (median step after the first); "
          f"oversample {args.tail_oversample} under finish order, then a sweep of it")  # fmt: skip
    print_tail_rows([sync, *rows, *sweep])
    print(f"skipped (a staleness bound below the level drops the batches the lead gate lets start that many versions "
          f"back): {[(s['max_async_level'], s['max_off_policy_steps']) for s in skipped]} (level, bound)")  # fmt: skip
    # The goal at level 1 with partial rollouts: async / sync <= 0.5 and servers busy >= 0.9 at once.
    partial = [r for r in rows + sweep if r["update_mode"] == "interrupt" and r["max_async_level"] == 1]
    fast = [r for r in partial if r["ratio"] <= 0.5]
    best = max(fast, key=lambda r: r["server_busy"]) if fast else min(partial, key=lambda r: r["ratio"])
    met = best["ratio"] <= 0.5 and best["server_busy"] >= 0.9
    needed = 0.1 * 0.5 * sync["step_s"]  # busy <= 1 - broadcast / step, step <= sync / 2
    print(f"level 1 with partial rollouts, the busiest at async / sync <= 0.5: oversample {best['oversample']}, "
          f"staleness {best['max_off_policy_steps']}: async / sync {best['ratio']:.3f}, servers busy {best['server_busy']:.2f} "
          f"(goal >= 0.9): {'met' if met else 'not met'}; paused for updates {best['server_paused']:.2f} of the time, so "
          f"busy <= {1 - best['server_paused']:.2f}; both goals at once need a broadcast <= 0.1 x 0.5 x "
          f"{sync['step_s']:.0f} s = {needed:.0f} s (it is {model.broadcast_s:g} s)")  # fmt: skip
    what_if = {}
    if args.tail_what_if_broadcast is not None:
        short = replace(tail, broadcast_s=args.tail_what_if_broadcast)
        what_if["sync"] = tail_row("dataset", "keep", 0, 1, 0, args, short, cp)
        what_if["rows"] = [tail_row("finish", "interrupt", 1, args.tail_sweep_bound, o, args, short, cp)
                           for o in sorted({args.tail_oversample, *sweep_values})]  # fmt: skip
        tail_sync_and_ratios(what_if["sync"], what_if["rows"])
        print(f"the same with a {args.tail_what_if_broadcast:g} s broadcast (its own synchronous baseline):")
        print_tail_rows([what_if["sync"], *what_if["rows"]])
        what_if["goal_met"] = any(r["ratio"] <= 0.5 and r["server_busy"] >= 0.9 for r in what_if["rows"])
    return {"figure": {"async_over_sync": best["ratio"], "server_busy": best["server_busy"]},
            "reference": {"sync_step_s": sync["step_s"], "goal_async_over_sync": 0.5, "goal_server_busy": 0.9},
            "ratio": best["ratio"], "best": {k: best[k] for k in ("batch_order", "update_mode", "max_async_level",
            "max_off_policy_steps", "oversample")}, "goal_met": met, "broadcast_needed_s": needed,
            "context_parallel": cp, "sync": sync, "rows": rows, "oversample_sweep": sweep, "skipped": skipped,
            "what_if_broadcast": what_if}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="64,256,1024,4096", help="rollouts a step of the scale table")
    parser.add_argument("--steps", type=int, default=3, help="steps of each scale run")
    parser.add_argument("--async-steps", type=int, default=8, help="steps of each asynchrony run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sections", default="1,2,3,4",
                        help="which sections to run (1: scale, 2: asynchrony, 3: routing replay, 4: the long tail)")
    parser.add_argument("--tail-steps", type=int, default=12, help="section 4: steps of each run")
    parser.add_argument("--tail-rollouts", type=int, default=64, help="section 4: rollouts a step (group size 1)")
    parser.add_argument("--tail-budget", type=int, default=31_744, help="section 4: max_completion_tokens")
    parser.add_argument("--tail-seq-len", type=int, default=32_768, help="section 4: policy and critic seq_len")
    parser.add_argument("--tail-median-tokens", type=float, default=4000.0,
                        help="section 4: median completion (lognormal; the p99 at the budget with sigma 0.9)")
    parser.add_argument("--tail-sigma", type=float, default=0.9, help="section 4: sigma of the lognormal")
    parser.add_argument("--tail-oversample", type=int, default=64,
                        help="section 4: orchestrator.oversample of the finish-order rows")
    parser.add_argument("--tail-oversample-sweep", default="16,32,128",
                        help="section 4: more oversample values, at level 1, finish order with partial rollouts")
    parser.add_argument("--tail-sweep-bound", type=int, default=4, help="section 4: the sweep's max_off_policy_steps")
    parser.add_argument("--tail-levels", default="1,2", help="section 4: max_async_level values")
    parser.add_argument("--tail-what-if-broadcast", type=float, default=10.0,
                        help="section 4: run the level-1 partial-rollout rows again with this broadcast (s)")
    parser.add_argument("--tail-bounds", default="1,4,8", help="section 4: max_off_policy_steps values")
    parser.add_argument(
        "--out", default=None, help="write the JSON here instead of benchmarks/results/scale.json "
        "(section 4: beside it, NAME_tail.json instead of benchmarks/results/scale_tail.json)"
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
        sections = {int(s) for s in args.sections.split(",")}
        args.tail_levels = [int(s) for s in args.tail_levels.split(",")]
        args.tail_bounds = [int(s) for s in args.tail_bounds.split(",")]
    except ValueError as exc:
        parser.error(f"{exc} (--sizes {args.sizes!r}, --sections {args.sections!r})" if "invalid literal" in str(exc) else str(exc))
    if len(sizes) < 2 or min(sizes) < 1 or args.steps < 1 or args.async_steps < 3:
        parser.error("--sizes needs two or more sizes >= 1, --steps >= 1, --async-steps >= 3")
    if not sections or not sections <= {1, 2, 3, 4} or args.tail_steps < 3:
        parser.error(f"--sections: some of 1, 2, 3, 4, got {args.sections!r}; --tail-steps >= 3")

    record = dict(figure={}, reference={}, ratio=None, params=vars(args) | {"model": asdict(model)})
    if 1 in sections:
        record |= scale_section(args, model, sizes)
    if 3 in sections:
        plain = record["scale"][0] if 1 in sections else scale_row(sizes[0], args.steps, model, args.seed)
        record["routing_replay"] = replay_section(args, model, sizes[0], plain)
    if 2 in sections:
        asynchrony = async_section(args, model)
        record["figure"]["async_over_sync"] = record["ratio"] = asynchrony.pop("best")
        record["reference"]["goal_async_over_sync"] = 0.6
        record |= asynchrony
    out = Path(args.out) if args.out else None
    if sections & {1, 2, 3}:
        if record["ratio"] is None:  # section 1 alone: the ratio is its exponent against the goal
            record["ratio"] = record["figure"]["cpu_exponent"] / record["reference"]["goal_exponent"]
        print(f"wrote {write_json(out, 'scale', record)}")
    if 4 in sections:
        tail = tail_section(args, model)
        tail["params"] = record["params"]
        print(f"wrote {write_json(out and out.with_name(out.stem + '_tail.json'), 'scale_tail', tail)}")
    return 0 if all(math.isfinite(v) for v in record["figure"].values()) else 1


def write_json(out: Path | None, name: str, record: dict) -> Path:
    """`record` to `out`, or to benchmarks/results/NAME.json."""
    if out is None:
        return write_result(name, **record)
    out.write_text(json.dumps(record, indent=2))
    return out


def scale_section(args, model: ClusterModel, sizes: list[int]) -> dict:
    """Section 1: the orchestrator's CPU and bytes at each size; its figures and rows."""
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
    return {"figure": {"cpu_exponent": exponent, "largest_share": largest["share"]},
            "reference": {"goal_exponent": 1.1, "goal_share": 0.01}, "scale": rows}  # fmt: skip


def replay_section(args, model: ClusterModel, size: int, plain: dict) -> dict:
    """Section 3: the policy grid with routing replay against `plain` (the same run without)."""
    replayed = scale_row(size, args.steps, model, args.seed, routing_replay="replay")
    added = replayed["policy_grid_bytes_per_step"] - plain["policy_grid_bytes_per_step"]
    per_token = added / replayed["policy_grid_tokens_per_step"]
    arch = cluster_config(SAO, tempfile.mkdtemp(prefix="bench_scale_")).layout.policy_architecture
    expected = arch.num_layers * arch.num_experts_per_tok + 1  # uint8 experts, and the `routed` flag
    print(f"routing replay at {size} rollouts: policy grid {replayed['policy_grid_bytes_per_step'] / 1e6:.1f} MB "
          f"a step against {plain['policy_grid_bytes_per_step'] / 1e6:.1f} MB without (x "
          f"{replayed['policy_grid_bytes_per_step'] / plain['policy_grid_bytes_per_step']:.2f}): {per_token:.1f} "
          f"bytes a token more ({arch.num_layers} layers x top-{arch.num_experts_per_tok} uint8 + 1 = {expected})")  # fmt: skip
    return {"row": replayed, "bytes_per_token": per_token, "expected_bytes_per_token": expected}


def async_section(args, model: ClusterModel) -> dict:
    """Section 2: levels 0-2 for SAO and GRPO; the rows, calibration and the best SAO ratio."""
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
    for group_size in (1, 8):
        print(f"async / sync, group size {group_size}: {ratios[(group_size, 1)]:.3f} (level 1), "
              f"{ratios[(group_size, 2)]:.3f} (level 2); goal <= 0.6")  # fmt: skip
    return {"best": min(ratios[(1, 1)], ratios[(1, 2)]), "asynchrony": async_rows,
            "calibration": {str(g): c for g, c in calibration.items()}}  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
