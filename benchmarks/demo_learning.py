"""The demo's learning curves over seeds: SAO, PPO and GRPO, each from the same random tiny model.

    python benchmarks/demo_learning.py [--algos sao,ppo,grpo,ppo-n4] [--seeds 0,1,2] [--steps 50] [--out runs/curves]
                                       [--task count|copy|reverse|tool]

Besides the three algorithms, `--algos` takes the variants in VARIANTS (an algorithm with config
overrides): `ppo-n4` is PPO with 4 mini-batch updates per step (`algorithm.policy_minibatches=4`);
`rloo`, `dr_grpo`, `reinforce_pp`, `gspo`, `cispo` are the algorithm toolbox's parts on the demo's
GRPO setting; `sao-obs-actions` is SAO with the observation tokens of a multi-turn task trained on
as actions (`orchestrator.train_on_observations`, the ablation of skip-observation GAE; with
`--task tool`); `sao-lora` is SAO with a LoRA policy (docs/lora.md), `sao-lora-lr3e-2` and `sao-lora-lr1e-1` the same at
other learning rates, `sao-lora-frozen` with its adapters frozen (the null the LoRA learning test's margin
is set against). `--task tool` runs the tool demo (its warm start and learning rate).
`--result NAME` names the results file (default demo_learning).

Runs `launch/demo.sh`'s job (`megatron_rl.demo.run.run_demo`, the full CPU stack) once per
algorithm and seed, one after the other, then prints the summary table (mean reward of the first
and last 5 steps, the rise), writes one overlaid figure per algorithm (`OUT/ALGO.png`) and all
runs in `OUT/all.png` (all panels) and `OUT/rewards.png` (reward only, one panel per
algorithm), and records the figures in `benchmarks/results/demo_learning.json`
(figure: the smallest rise over all runs; reference: the mean reward of the first 5 steps).
A run directory that already holds a finished run of `--steps` steps is reused, so a sweep that
was cut short continues where it stopped.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# name: (algorithm, run-config overrides)
VARIANTS = {
    "ppo-n4": ("ppo", ["algorithm.policy_minibatches=4"]),
    # The algorithm toolbox on the demo's GRPO setting (16 prompts x 4 a step).
    "rloo": ("grpo", ["algorithm.advantage=rloo"]),
    "dr_grpo": ("grpo", ["algorithm.advantage=dr_grpo", "algorithm.loss_aggregation=seq-mean-token-sum-norm"]),
    "reinforce_pp": ("grpo", ["algorithm.advantage=reinforce_pp"]),
    "gspo": ("grpo", ["algorithm.policy_loss=gspo", "algorithm.policy_minibatches=2", "algorithm.old_logprobs=recompute"]),
    "cispo": ("grpo", ["algorithm.policy_loss=cispo", "algorithm.eps_high=0.28", "algorithm.policy_minibatches=2",
                       "algorithm.old_logprobs=recompute"]),
    # The tool demo's ablation: observations trained on as actions (mask 1).
    "sao-obs-actions": ("sao", ["orchestrator.train_on_observations=true"]),
    # A LoRA policy (rank 8 on every linear, served to vLLM as adapters) at about 3x the demo's
    # full fine-tuning learning rate (LoRA takes a larger one; docs/lora.md).
    "sao-lora": ("sao", ["lora.rank=8", "lora.alpha=16", "optimizer.lr=1e-2"]),
    "sao-lora-lr3e-2": ("sao", ["lora.rank=8", "lora.alpha=16", "optimizer.lr=3e-2"]),
    "sao-lora-lr1e-1": ("sao", ["lora.rank=8", "lora.alpha=16", "optimizer.lr=1e-1"]),
    # The same LoRA policy frozen (lr 1e-30: no adapter moves): the null a learning test's margin is set against.
    "sao-lora-frozen": ("sao", ["lora.rank=8", "lora.alpha=16", "optimizer.lr=1e-30"]),
}
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def rise(run_dir: Path, k: int = 5) -> tuple[float, float]:
    from megatron_rl.demo.plot import load_run

    rewards = [r["reward_mean"] for r in load_run(run_dir)["orchestrator"]]
    return sum(rewards[:k]) / k, sum(rewards[-k:]) / k


def finished_run(out: Path, steps: int) -> bool:
    """Whether `out` holds a run that finished `steps` steps."""
    from megatron_rl.demo.plot import load_run

    return out.is_dir() and len(load_run(out)["orchestrator"]) == steps


def run_or_reuse(out: Path, algo: str, seed: int, steps: int, task: str, sft_steps: int, lr: float) -> int:
    """Runs the demo's job (`algo`, or a VARIANTS name) into `out` and returns its exit code; a
    finished run of `steps` steps already in `out` is kept (exit code 0), anything else there is
    removed first."""
    from megatron_rl.demo.run import run_demo
    from megatron_rl.launch.local import run_local

    if finished_run(out, steps):  # a finished run of an earlier, cut-short sweep: keep it
        print(f"[curves] {algo} seed {seed}: reusing the finished run in {out}", flush=True)
        return 0
    if out.exists():
        shutil.rmtree(out)
    algorithm, overrides = VARIANTS.get(algo, (algo, []))
    return run_demo(
        algorithm, steps, out, seed, sft_steps, task, lr=lr, overrides=overrides, launcher=run_local
    )


def reward_figure(runs: dict[str, list[Path]], out: Path) -> Path:
    """One panel per algorithm: the mean reward of every seed's run against the step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from megatron_rl.demo.plot import load_run

    figure, axes = plt.subplots(1, len(runs), figsize=(4.2 * len(runs), 3.4), sharey=True, squeeze=False)
    for ax, (algo, dirs) in zip(axes[0], runs.items()):
        for run_dir in dirs:
            records = load_run(run_dir)["orchestrator"]
            ax.plot([r["step"] for r in records], [r["reward_mean"] for r in records], label=run_dir.name)
        ax.set_title(f"{algo.upper()}: mean reward per step")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("reward")
    figure.tight_layout()
    figure.savefig(out, dpi=80)
    plt.close(figure)
    return out


def main(argv: list[str] | None = None) -> int:
    from _results import write_result

    from megatron_rl.demo.plot import plot_runs, summary_table
    from megatron_rl.demo.run import DEFAULTS, TASKS, TOOL

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algos", default="sao,ppo,grpo")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=DEFAULTS["steps"])
    parser.add_argument("--out", type=Path, default=Path("runs/curves"))
    parser.add_argument("--result", default="demo_learning", help="benchmarks/results/NAME.json")
    parser.add_argument("--task", default=DEFAULTS["task"], choices=TASKS)
    args = parser.parse_args(argv)
    tool = args.task == "tool"
    sft_steps, lr = (TOOL["sft_steps"], TOOL["lr"]) if tool else (DEFAULTS["sft_steps"], DEFAULTS["lr"])
    algos, seeds = args.algos.split(","), [int(s) for s in args.seeds.split(",")]
    runs, records = {}, []
    for seed in seeds:  # seed-major: a cut-short sweep still has every algorithm
        for algo in algos:
            out = args.out / f"{algo}-s{seed}"
            began = time.monotonic()
            code = run_or_reuse(out, algo, seed, args.steps, args.task, sft_steps, lr)
            if code != 0:
                print(f"[curves] {algo} seed {seed} exited {code}; see {out}/logs", file=sys.stderr)
                return code
            first, last = rise(out)
            records.append({"algo": algo, "seed": seed, "first5": round(first, 4), "last5": round(last, 4),
                            "rise": round(last - first, 4), "wall_s": round(time.monotonic() - began, 1)})  # fmt: skip
            runs.setdefault(algo, []).append(out)
    for algo, dirs in runs.items():
        plot_runs(dirs, args.out / f"{algo}.png")
    plot_runs([d for dirs in runs.values() for d in dirs], args.out / "all.png")
    reward_figure(runs, args.out / "rewards.png")
    print(summary_table([d for dirs in runs.values() for d in dirs]))
    worst = min(r["rise"] for r in records)
    first = sum(r["first5"] for r in records) / len(records)
    path = write_result(
        args.result, figure=worst, reference=first, ratio=worst / first if first else float("inf"),
        params={"steps": args.steps, "algos": algos, "seeds": seeds, **DEFAULTS, "task": args.task,
                "sft_steps": sft_steps, "lr": lr, **({"tool": TOOL} if tool else {})},
        runs=records, note="figure: smallest rise (last 5 minus first 5 steps' mean reward) over all runs; "
        "reference: mean reward of the first 5 steps",
    )  # fmt: skip
    print(json.dumps(records, indent=1))
    print(f"[curves] smallest rise {worst:+.3f} over {len(records)} runs; wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
