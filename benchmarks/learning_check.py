"""How many steps the demo's learning checks need: learning against noise, over seeds.

    python benchmarks/learning_check.py [--tasks count,tool] [--seeds 0,1,2] [--steps 20] [--min-steps 6]
                                        [--out runs/learning_check]

The two learning checks of tests/e2e/test_demo.py run the demo's SAO job for a number of steps
and compare rewards. For each task (`count`: the SAO demo's test;
`tool`: `test_tool_demo_calls_the_tool_through_the_stack_and_learns`) this runs the same job
(`demo_learning.run_or_reuse`: `launch/demo.sh`'s `run_demo` with the local launcher) for
`--steps` steps at every seed twice:

- **learning**: the demo's own policy learning rate (count 3e-3, tool 5e-4);
- **noise**: the policy's learning rate NOISE_LR (1e-30). The config refuses 0
  (`optimizer.lr` must be > 0); an Adam step of at most ~1e-30 a weight leaves every float32
  weight of this model as it was. Each run records the largest |change| of any weight between
  the model it started from (`RUN/model`) and the last weights it published, so the freeze is
  checked, not assumed. Nothing learns, so the reward moves only by sampling (prompts and
  answers); the critic still trains, which changes no sample.

Both runs of a seed start from the same model (for `tool`: the same warm start), so step 0 is
the same. From `reward_mean` in each run's orchestrator_metrics.jsonl it computes, for every
N from `--min-steps` to `--steps`, the check's statistic on the run's first N steps, as the test
computes it on an N-step run (a run's first N steps are an N-step run: the learning rate is
constant and nothing else depends on the number of steps; checked on count at seed 0, where a
6-step run's rewards equal the first 6 of the 20-step run's, learning and frozen alike):

- `windows` (both tests' statistic): the mean reward of the last w of the N steps minus that of
  the first w, with w = min(5, N // 2) so the two windows never overlap;
- `step0` (the tool test's statistic before, for comparison): the mean reward of steps
  N-5..N-1 minus step 0's (the warm-started model's).

It prints a table per task: N, w, the smallest learning rise over the seeds, the largest noise
rise, the gap between them, the noise's spread (the standard deviation of the statistic when
nothing learns: the pooled within-run standard deviation of the noise runs' per-step rewards,
times sqrt(2 / w) for `windows` and sqrt(1 + 1/5) for `step0`), the learning rises' spread (their
standard deviation over the seeds) and the mean seconds of training the N steps took in the
learning runs. The chosen N is the smallest from which on every N up to `--steps` separates
clearly: gap >= CLEAR_FACTOR (2) x the larger of the two spreads. Its margin is halfway between
the smallest learning rise and the largest noise rise, so it sits at least one spread from
each. When no N does, the figure is the row of `--steps` itself, marked `"clear": false`. For
`tool` a second table applies `step0` to the same runs, for comparison; the choice is the
tests' statistic's (`windows`). Writes
benchmarks/results/learning_check.json: figure (per task: the chosen N, window, margin and
training seconds), reference (per task: `--steps` and its training seconds), ratio (their
training seconds), params, the tables, and every run's per-step rewards and step seconds so the
choice can be re-derived. Run directories `OUT/TASK-learning-sS` and `OUT/TASK-noise-sS` are
reused when finished (a sweep that was cut short continues).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

from demo_learning import finished_run, run_or_reuse

NOISE_LR = 1e-30
CLEAR_FACTOR = 2.0
WINDOW = 5  # the tests' window: five steps


def count_window(steps: int) -> int:
    """The `windows` statistic's window for an N-step run: 5, or N // 2 when 5 + 5 steps do not fit."""
    return min(WINDOW, steps // 2)


def windows_statistic(rewards: list[float], steps: int) -> float:
    """Mean reward of the last w of the first `steps` steps minus that of the first w."""
    w, head = count_window(steps), rewards[:steps]
    return sum(head[-w:]) / w - sum(head[:w]) / w


def step0_statistic(rewards: list[float], steps: int) -> float:
    """Mean reward of steps N-5..N-1 minus step 0's, N = `steps`."""
    return sum(rewards[steps - WINDOW : steps]) / WINDOW - rewards[0]


STATISTICS = {"windows": windows_statistic, "step0": step0_statistic}
TASKS = ("count", "tool")


def statistic_sd(statistic: str, steps: int, step_sd: float) -> float:
    """The statistic's standard deviation for independent steps of standard deviation `step_sd`."""
    if statistic == "windows":
        return step_sd * math.sqrt(2 / count_window(steps))
    return step_sd * math.sqrt(1 + 1 / WINDOW)


def pooled_step_sd(runs: list[list[float]]) -> float:
    """The pooled within-run standard deviation of per-step rewards (each run about its own mean)."""
    squares = sum(sum((r - sum(run) / len(run)) ** 2 for r in run) for run in runs)
    return math.sqrt(squares / sum(len(run) - 1 for run in runs))


def largest_weight_change(run_dir: Path) -> float:
    """max |w_last - w_start| over every tensor: the run's starting model (`RUN/model`) against
    the last version it published (`RUN/published/latest`)."""
    from safetensors.torch import load_file

    def tensors(directory: Path) -> dict:
        found = {}
        for path in sorted(directory.glob("*.safetensors")):
            found.update(load_file(path))
        return found

    start = tensors(run_dir / "model")
    last = tensors(run_dir / "published" / (run_dir / "published" / "latest").read_text().strip())
    if start.keys() != last.keys():
        raise ValueError(
            f"{run_dir}: the published tensors {sorted(last)} are not the model's {sorted(start)}"
        )
    return max((last[name].double() - start[name].double()).abs().max().item() for name in start)


def table(
    statistic: str, learning: list[dict], noise: list[dict], min_steps: int, max_steps: int
) -> list[dict]:
    """One row per N: `statistic` (a STATISTICS name) of the learning and noise runs over the seeds,
    the gap, both spreads, whether it separates clearly and the halfway margin."""
    step_sd = pooled_step_sd([run["rewards"] for run in noise])
    rows = []
    for steps in range(min_steps, max_steps + 1):
        learning_rises = [STATISTICS[statistic](run["rewards"], steps) for run in learning]
        noise_rises = [STATISTICS[statistic](run["rewards"], steps) for run in noise]
        noise_sd = statistic_sd(statistic, steps, step_sd)
        learning_sd = statistics.stdev(learning_rises) if len(learning_rises) > 1 else 0.0
        gap = min(learning_rises) - max(noise_rises)
        train_s = sum(sum(run["step_seconds"][:steps]) for run in learning) / len(learning)
        rows.append({"steps": steps, "window": count_window(steps) if statistic == "windows" else WINDOW,
                     "learning": [round(x, 4) for x in learning_rises], "noise": [round(x, 4) for x in noise_rises],
                     "learning_min": round(min(learning_rises), 4), "noise_max": round(max(noise_rises), 4),
                     "gap": round(gap, 4), "noise_sd": round(noise_sd, 4), "learning_sd": round(learning_sd, 4),
                     "clear": gap >= CLEAR_FACTOR * max(noise_sd, learning_sd),
                     "margin": round((min(learning_rises) + max(noise_rises)) / 2, 2),
                     "train_s": round(train_s, 1)})  # fmt: skip
    return rows


def choose(rows: list[dict]) -> dict | None:
    """The row of the smallest N from which on every larger N separates clearly; None if none does."""
    chosen = None
    for row in reversed(rows):
        if not row["clear"]:
            break
        chosen = row
    return chosen


def print_table(title: str, rows: list[dict], chosen: dict | None) -> None:
    print(f"\n[learning-check] {title}: the statistic on the first N steps, over the seeds (* clear)")
    print(f"{'N':>3} {'w':>2} {'learning min':>12} {'noise max':>9} {'gap':>7} {'noise sd':>8} {'learn sd':>8} "
          f"{'gap/sd':>6} {'margin':>6} {'train s':>7}  learning | noise")  # fmt: skip
    for row in rows:
        mark = " <-" if row is chosen else ("  *" if row["clear"] else "   ")
        print(f"{row['steps']:>3} {row['window']:>2} {row['learning_min']:>+12.3f} {row['noise_max']:>+9.3f} "
              f"{row['gap']:>+7.3f} {row['noise_sd']:>8.3f} {row['learning_sd']:>8.3f} "
              f"{row['gap'] / max(row['noise_sd'], row['learning_sd']):>6.1f} {row['margin']:>+6.2f} "
              f"{row['train_s']:>7.1f}{mark} {' '.join(f'{x:+.3f}' for x in row['learning'])} | "
              f"{' '.join(f'{x:+.3f}' for x in row['noise'])}")  # fmt: skip
    if chosen is None:
        print(f"[learning-check] {title}: no N up to {rows[-1]['steps']} separates clearly "
              f"(gap >= {CLEAR_FACTOR:g} x the larger spread)")  # fmt: skip
    else:
        print(f"[learning-check] {title}: N = {chosen['steps']} (window {chosen['window']}), margin "
              f"{chosen['margin']:+.2f} (halfway between {chosen['noise_max']:+.3f} and {chosen['learning_min']:+.3f}; "
              f"gap {chosen['gap'] / max(chosen['noise_sd'], chosen['learning_sd']):.1f} x the larger spread)")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    # As launch/demo.sh runs it, and so the tests: one thread a process unless set otherwise
    # (before torch is imported, for the in-process warm start too).
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from _results import write_result

    from megatron_rl.demo.plot import load_run
    from megatron_rl.demo.run import DEFAULTS, TOOL

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tasks", default="count,tool")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=20, help="N_max: the steps of every run")
    parser.add_argument("--min-steps", type=int, default=6, help="the smallest N in the table")
    parser.add_argument("--out", type=Path, default=Path("runs/learning_check"))
    args = parser.parse_args(argv)
    tasks, seeds = args.tasks.split(","), [int(s) for s in args.seeds.split(",")]
    for task in tasks:
        if task not in TASKS:
            parser.error(f"--tasks: {task!r} is not one of {list(TASKS)}")
    if not 2 <= args.min_steps <= args.steps or args.steps < WINDOW + 1:
        parser.error(f"--min-steps {args.min_steps} and --steps {args.steps}: need 2 <= min-steps <= steps "
                     f"and steps > {WINDOW}")  # fmt: skip
    if "tool" in tasks and args.min_steps < WINDOW + 1:
        parser.error(
            f"--min-steps {args.min_steps}: the tool check needs N > {WINDOW} (steps N-5..N-1 after step 0)"
        )
    settings = {"count": (DEFAULTS["sft_steps"], DEFAULTS["lr"]), "tool": (TOOL["sft_steps"], TOOL["lr"])}
    runs = []
    for task in tasks:
        sft_steps, lr = settings[task]
        for seed in seeds:
            for kind, run_lr in (("learning", lr), ("noise", NOISE_LR)):
                out = args.out / f"{task}-{kind}-s{seed}"
                wall_file = args.out / f"{out.name}.wall.json"
                finished = finished_run(out, args.steps)
                began = time.monotonic()
                print(f"[learning-check] {task} {kind} seed {seed} (lr {run_lr:g}) -> {out}", flush=True)
                code = run_or_reuse(out, "sao", seed, args.steps, task, sft_steps, run_lr)
                if code != 0:
                    print(
                        f"[learning-check] {task} {kind} seed {seed} exited {code}; see {out}/logs",
                        file=sys.stderr,
                    )
                    return code
                if not finished:  # the whole run's seconds, start-up included, kept for a later reuse
                    wall_file.write_text(json.dumps({"wall_s": round(time.monotonic() - began, 1)}))
                records = load_run(out)["orchestrator"]
                runs.append({"task": task, "kind": kind, "seed": seed, "lr": run_lr,
                             "rewards": [r["reward_mean"] for r in records],
                             "step_seconds": [r["time"]["total"] for r in records],
                             "wall_s": json.loads(wall_file.read_text())["wall_s"] if wall_file.is_file() else None,
                             "largest_weight_change": largest_weight_change(out)})  # fmt: skip
    tables, figure, reference, ratio = {}, {}, {}, {}
    for task in tasks:
        learning = [r for r in runs if r["task"] == task and r["kind"] == "learning"]
        noise = [r for r in runs if r["task"] == task and r["kind"] == "noise"]
        for run in runs:
            if run["task"] == task:
                print(f"[learning-check] {task} {run['kind']} seed {run['seed']}: largest weight change "
                      f"{run['largest_weight_change']:.3g}, {sum(run['step_seconds']):.0f} s training, "
                      f"{run['wall_s']} s in all")  # fmt: skip
        rows = tables[task] = table("windows", learning, noise, args.min_steps, args.steps)
        chosen = choose(rows)
        print_table(task, rows, chosen)
        if task == "tool":  # the same runs under the statistic the tool test had before
            against_step0 = tables["tool, against step 0"] = table(
                "step0", learning, noise, args.min_steps, args.steps
            )
            print_table("tool, against step 0", against_step0, choose(against_step0))
        reference[task] = {"steps": args.steps, "train_s": rows[-1]["train_s"]}
        row = chosen or rows[-1]  # none separates clearly: the row of --steps, marked clear false
        figure[task] = {k: row[k] for k in ("steps", "window", "margin", "clear", "train_s", "learning_min",
                                            "noise_max", "gap", "noise_sd", "learning_sd")}  # fmt: skip
        ratio[task] = round(row["train_s"] / rows[-1]["train_s"], 3)
    path = write_result(
        "learning_check", figure=figure, reference=reference, ratio=ratio,
        params={"tasks": tasks, "seeds": seeds, "steps": args.steps, "min_steps": args.min_steps,
                "noise_lr": NOISE_LR, "clear_factor": CLEAR_FACTOR, "algo": "sao",
                "lr": {task: settings[task][1] for task in tasks}},
        tables=tables, runs=runs,
        note="figure: per task, the smallest N from which on every N separates learning from noise "
        "(smallest learning rise - largest noise rise >= clear_factor x the larger of the noise's sd and the "
        "learning rises' sd over seeds), its window, its margin (halfway) and its training seconds, or the row "
        "of --steps with clear false; reference: the same at --steps; ratio: their training seconds",
    )  # fmt: skip
    print(f"[learning-check] wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
