"""The asynchronous demo (`bash launch/demo.sh --async`) against the synchronous one, over seeds.

    python benchmarks/async_learning.py [--seeds 0,1,2] [--steps 20] [--min-steps 6]
                                        [--variants async,async-gae,async-noise,sync48,sync]
                                        [--out runs/async_learning]

For every seed this runs the demo's SAO job on `count` (`demo_learning.run_or_reuse`, the full CPU
stack) for `--steps` steps in these variants:

- `async`: the `--async` preset (`megatron_rl.demo.run.ASYNC`: max_async_level 2, staleness 4,
  finish order with 32 groups oversampled, partial rollouts under `inference.update_mode`
  interrupt, `algorithm.value_targets` version_bootstrap, completions of up to 48 tokens);
- `async-gae`: the same with `algorithm.value_targets=gae` (the critic's plain lambda-returns);
- `async-noise`: the preset with the policy's learning rate at learning_check.NOISE_LR (1e-30: no
  weight moves; the reward moves only by sampling), the null the learning check is set against;
- `sync48`: the synchronous demo (max_async_level 0) at the preset's completion budget (48 tokens),
  the like-for-like reference: the budget changes the task (a random 48-token answer has more
  characters that are not `x`, each costing 0.1 of the reward) and the seconds a step;
- `sync`: the synchronous demo as it is (12 tokens), what the suite's SAO test ran before.

Each run records per step: `reward_mean`, `explained_variance` (the critic's values against the
step's value targets: for version_bootstrap those are the cut targets), the version span,
the samples spanning versions, interruptions, re-prefilled tokens, the off-policy lag histogram
(per sample: step - the oldest version behind it), the token lag, stale drops and the step's
seconds; and the largest |change| of any weight (learning_check.largest_weight_change: the frozen
policy is checked, not assumed).

It prints, per variant over the seeds: the `windows` statistic (learning_check's: the mean reward
of the last w of the first N steps minus the first w, w = min(5, N // 2)) at the chosen N and at
`--steps`, the reward and completion tokens of the last 5 steps, the explained variance over the
last 10 steps, the fraction of samples spanning versions, the mean off-policy lag and the seconds a
step; then the ratios async / sync48 (and async / sync) of the rise and of the seconds a step, and
async-gae's figures against async's. The suite's N and margin for the async run are chosen exactly
as learning_check chooses them (learning_check.table / choose: `async` against `async-noise`, the
smallest N from which on every N separates clearly, the margin halfway), and for that N it reports
at every seed whether the first N steps already had a sample of off-policy lag >= 1 and a sample
spanning versions (what the test asserts). Writes benchmarks/results/async_learning.json with every
run's per-step records, so the choice can be re-derived. Run directories `OUT/VARIANT-sS` are
reused when finished (a sweep that was cut short continues).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from demo_learning import VARIANTS, finished_run, run_or_reuse
from learning_check import (
    NOISE_LR,
    choose,
    count_window,
    largest_weight_change,
    print_table,
    table,
    windows_statistic,
)

NAMES = ("async", "async-gae", "async-noise", "sync48", "sync")
# The per-step fields of orchestrator_metrics.jsonl each run keeps (besides reward and seconds).
STEP_FIELDS = ("explained_variance", "samples", "version_span_max", "samples_spanning_versions", "interruptions",
               "reprefilled_tokens", "off_policy_lag", "token_lag", "stale_dropped", "live_version",
               "completion_tokens_mean")  # fmt: skip
EV_STEPS = 10  # explained variance: the mean over the last 10 steps
LAST = 5  # reward: the mean of the last 5 steps


def async_variants(asynchronous: dict, lr: float) -> dict[str, tuple[list[str], float]]:
    """name (NAMES): (run-config overrides, the policy's learning rate), from the `--async` preset
    `asynchronous` (demo.run.ASYNC) and the demo's learning rate `lr`."""
    preset = [f"{key}={value}" for key, value in asynchronous.items()]  # as `--async` writes them
    budget = asynchronous["orchestrator.max_completion_tokens"]
    return {"async": (preset, lr), "async-gae": ([*preset, "algorithm.value_targets=gae"], lr),
            "async-noise": (preset, NOISE_LR), "sync48": ([f"orchestrator.max_completion_tokens={budget}"], lr),
            "sync": ([], lr)}  # fmt: skip


def run_record(out: Path, variant: str, seed: int, lr: float, wall_s: float | None) -> dict:
    """The run in `out`: its per-step rewards, seconds and STEP_FIELDS, and its largest weight change."""
    from megatron_rl.demo.plot import load_run

    records = load_run(out)["orchestrator"]
    return {"variant": variant, "seed": seed, "lr": lr, "rewards": [r["reward_mean"] for r in records],
            "step_seconds": [r["time"]["total"] for r in records],
            **{field: [r.get(field) for r in records] for field in STEP_FIELDS},
            "wall_s": wall_s, "largest_weight_change": largest_weight_change(out)}  # fmt: skip


def mean_lag(run: dict, steps: int) -> float:
    """The mean off-policy lag of the samples of the first `steps` steps (the lag histograms)."""
    histograms = run["off_policy_lag"][:steps]
    count = sum(n for histogram in histograms for n in histogram.values())
    return sum(int(lag) * n for histogram in histograms for lag, n in histogram.items()) / count


def first_step(flags: list[bool]) -> int | None:
    """The first step whose flag is set; None if none is."""
    return next((step for step, flag in enumerate(flags) if flag), None)


def run_summary(run: dict, n: int, steps: int) -> dict:
    """One run's figures: the windows rise at N = `n` and at `steps`, the last 5 steps' reward and
    completion tokens (a sample's mean; the empty answer is 1 token, its expected reward 1 - 3.5 / 6), the
    explained variance over the last 10 steps, the fraction of samples spanning versions, the first
    steps with a sample of lag >= 1 and with one spanning versions, lags, drops and seconds a step."""
    ev = [x for x in run["explained_variance"][max(0, steps - EV_STEPS) : steps] if x is not None]
    return {
        "seed": run["seed"],
        "rise_n": round(windows_statistic(run["rewards"], n), 4),
        "rise_steps": round(windows_statistic(run["rewards"], steps), 4),
        "last5": round(sum(run["rewards"][steps - LAST : steps]) / LAST, 4),
        "tokens_last5": round(sum(run["completion_tokens_mean"][steps - LAST : steps]) / LAST, 2),
        "ev_last10": round(sum(ev) / len(ev), 4) if ev else None,
        "spanning_fraction": round(
            sum(run["samples_spanning_versions"][:steps]) / sum(run["samples"][:steps]), 4
        ),
        "version_span_max": max(run["version_span_max"][:steps]),
        "first_lagged_step": first_step([any(int(lag) >= 1 for lag in h) for h in run["off_policy_lag"]]),
        "first_spanning_step": first_step([count > 0 for count in run["samples_spanning_versions"]]),
        "mean_lag": round(mean_lag(run, steps), 3),
        "interruptions": sum(run["interruptions"][:steps]),
        "reprefilled_tokens": sum(run["reprefilled_tokens"][:steps]),
        "stale_dropped": sum(run["stale_dropped"][:steps]),
        "s_per_step": round(sum(run["step_seconds"][:steps]) / steps, 2),
        "train_s_n": round(sum(run["step_seconds"][:n]), 1),
    }


def variant_summary(summaries: list[dict]) -> dict:
    """The mean over the seeds of every figure of `run_summary` (None where a seed has none)."""
    keys = [
        k
        for k in summaries[0]
        if k not in ("seed", "first_lagged_step", "first_spanning_step", "version_span_max")
    ]
    mean = {k: round(statistics.fmean(s[k] for s in summaries), 4) if all(s[k] is not None for s in summaries)
            else None for k in keys}  # fmt: skip
    return {**mean, "version_span_max": max(s["version_span_max"] for s in summaries)}


def print_summaries(by_variant: dict[str, list[dict]], n: int, steps: int) -> None:
    w, w_steps = count_window(n), count_window(steps)
    print(f"\n[async-learning] per variant over the seeds (per seed, then the mean); rise: the last w of the first N "
          f"steps minus the first w (N {n}: w {w}; N {steps}: w {w_steps})")  # fmt: skip
    print(f"{'variant':<12} {'seed':>4} {f'rise@{n}':>8} {f'rise@{steps}':>8} {'last 5':>7} {'tokens':>6} {'EV last10':>9} "
          f"{'spanning':>8} {'span max':>8} {'1st lag':>7} {'1st span':>8} {'lag':>5} {'interr':>6} {'reprefill':>9} "
          f"{'stale':>5} {'s/step':>6}")  # fmt: skip
    for variant, summaries in by_variant.items():
        for s in [*summaries, {**variant_summary(summaries), "seed": "mean"}]:
            ev = "-" if s["ev_last10"] is None else f"{s['ev_last10']:+.3f}"
            print(f"{variant:<12} {s['seed']:>4} {s['rise_n']:>+8.3f} {s['rise_steps']:>+8.3f} {s['last5']:>7.3f} {s['tokens_last5']:>6.1f} "
                  f"{ev:>9} {s['spanning_fraction']:>8.3%} {s['version_span_max']:>8} "
                  f"{str(s.get('first_lagged_step', '')):>7} {str(s.get('first_spanning_step', '')):>8} "
                  f"{s['mean_lag']:>5.2f} {s['interruptions']:>6.0f} {s['reprefilled_tokens']:>9.0f} "
                  f"{s['stale_dropped']:>5.0f} {s['s_per_step']:>6.2f}")  # fmt: skip


def ratios(means: dict[str, dict], of: str, to: str) -> dict | None:
    """`of` / `to` of the mean rise (at N and at --steps), of the last 5 steps' reward and of the
    seconds a step; None when either variant was not run."""
    if of not in means or to not in means:
        return None
    return {k: round(means[of][k] / means[to][k], 3) if means[to][k] else None
            for k in ("rise_n", "rise_steps", "last5", "s_per_step")}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # as launch/demo.sh runs it
    from _results import write_result

    from megatron_rl.demo.run import ASYNC, DEFAULTS

    variant_settings = async_variants(ASYNC, DEFAULTS["lr"])
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=20, help="the steps of every run (N_max)")
    parser.add_argument("--min-steps", type=int, default=6, help="the smallest N in the learning table")
    parser.add_argument("--variants", default=",".join(NAMES))
    parser.add_argument("--out", type=Path, default=Path("runs/async_learning"))
    args = parser.parse_args(argv)
    seeds, variants = [int(s) for s in args.seeds.split(",")], args.variants.split(",")
    for variant in variants:
        if variant not in NAMES:
            parser.error(f"--variants: {variant!r} is not one of {list(NAMES)}")
    if "async" not in variants or "async-noise" not in variants:
        parser.error("--variants: the learning check needs 'async' and 'async-noise'")
    if not 2 <= args.min_steps <= args.steps or args.steps < LAST:
        parser.error(f"--min-steps {args.min_steps} and --steps {args.steps}: need 2 <= min-steps <= steps "
                     f"and steps >= {LAST}")  # fmt: skip
    for variant in variants:  # run_or_reuse runs a demo_learning.VARIANTS name: (algorithm, overrides)
        VARIANTS[variant] = ("sao", variant_settings[variant][0])
    runs = []
    for seed in seeds:  # seed-major: a cut-short sweep still has every variant
        for variant in variants:
            lr = variant_settings[variant][1]
            out = args.out / f"{variant}-s{seed}"
            wall_file = args.out / f"{out.name}.wall.json"
            finished, began = finished_run(out, args.steps), time.monotonic()
            print(f"[async-learning] {variant} seed {seed} (lr {lr:g}) -> {out}", flush=True)
            code = run_or_reuse(out, variant, seed, args.steps, DEFAULTS["task"], DEFAULTS["sft_steps"], lr)
            if code != 0:
                print(
                    f"[async-learning] {variant} seed {seed} exited {code}; see {out}/logs", file=sys.stderr
                )
                return code
            if not finished:  # the whole run's seconds, start-up included, kept for a later reuse
                wall_file.write_text(json.dumps({"wall_s": round(time.monotonic() - began, 1)}))
            wall_s = json.loads(wall_file.read_text())["wall_s"] if wall_file.is_file() else None
            runs.append(run_record(out, variant, seed, lr, wall_s))
    for run in runs:
        print(f"[async-learning] {run['variant']} seed {run['seed']}: largest weight change "
              f"{run['largest_weight_change']:.3g}, {sum(run['step_seconds']):.0f} s training, {run['wall_s']} s in all")  # fmt: skip

    of = {variant: [run for run in runs if run["variant"] == variant] for variant in variants}
    rows = table("windows", of["async"], of["async-noise"], args.min_steps, args.steps)
    chosen = choose(rows)
    print_table("async (learning: the --async preset; noise: the same, policy lr 1e-30)", rows, chosen)
    row = chosen or rows[-1]  # none separates clearly: the row of --steps, marked clear false
    n = row["steps"]
    summaries = {variant: [run_summary(run, n, args.steps) for run in of[variant]] for variant in variants}
    print_summaries(summaries, n, args.steps)
    means = {variant: variant_summary(s) for variant, s in summaries.items()}
    compared = {f"{a}/{b}": ratios(means, a, b) for a, b in
                (("async", "sync48"), ("async", "sync"), ("async-gae", "async"), ("sync48", "sync"))}  # fmt: skip
    print("\n[async-learning] ratios of the means over the seeds")
    for name, values in compared.items():
        if values is not None:
            print(
                f"  {name:<16} "
                + "  ".join(f"{k} {'-' if v is None else f'{v:.3f}'}" for k, v in values.items())
            )
    within_n = {run["seed"]: {"lagged": any(int(lag) >= 1 for h in run["off_policy_lag"][:n] for lag in h),
                              "spanning": any(c > 0 for c in run["samples_spanning_versions"][:n])}
                for run in of["async"]}  # fmt: skip
    print(f"[async-learning] async, the first {n} steps: " + ", ".join(
        f"seed {seed}: lag >= 1 {'yes' if f['lagged'] else 'no'}, spanning {'yes' if f['spanning'] else 'no'}"
        for seed, f in within_n.items()))  # fmt: skip
    figure = {k: row[k] for k in ("steps", "window", "margin", "clear", "train_s", "learning_min", "noise_max", "gap",
                                  "noise_sd", "learning_sd")}  # fmt: skip
    path = write_result(
        "async_learning", figure={**figure, "async": means["async"], "asynchrony_within_n": within_n},
        reference={variant: means[variant] for variant in variants if variant != "async"},
        ratio=compared,
        params={"seeds": seeds, "steps": args.steps, "min_steps": args.min_steps, "variants": variants,
                "overrides": {v: variant_settings[v][0] for v in variants},
                "lr": {v: variant_settings[v][1] for v in variants}, "algo": "sao", "task": DEFAULTS["task"]},
        table=rows, summaries=summaries, runs=runs,
        note="figure: the async learning check's N (the smallest from which on every N separates async from "
        "async-noise: smallest learning rise - largest noise rise >= 2 x the larger spread), its window, margin "
        "(halfway) and training seconds, the async variant's means over the seeds at that N, and whether each "
        "seed's first N steps had a sample of lag >= 1 and one spanning versions; reference: the other variants' "
        "means; ratio: the means' ratios (rise at N and at --steps, last 5 steps' reward, seconds a step)",
    )  # fmt: skip
    print(f"[async-learning] wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
