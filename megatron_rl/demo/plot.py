"""`megatron-rl plot RUN_DIR [RUN_DIR ...] [--out PNG]`: one figure of a run's metrics, several
runs overlaid (so algorithms can be compared on one chart), and a one-screen summary table.

Panels against the step: reward (mean, with min-max band for one run), the critic's value loss
and the explained variance of the returns, the train-inference mismatch KL (log scale), and the
step's time split (stacked for one run; total for several). Reads `orchestrator_metrics.jsonl`,
`critic_metrics.jsonl` and `policy_metrics.jsonl` from each run directory (`logging.dir`).
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import argparse

import matplotlib.pyplot as plt  # noqa: E402

TIME_PARTS = ["generate", "score", "critic_train", "policy_send", "wait_weights", "eval"]


def read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def last_per_step(records: list[dict], key: str = "step") -> list[dict]:
    """One record per step (the newest, when a resumed run repeated one), in step order."""
    by_step = {}
    for record in records:
        if key in record:
            by_step[record[key]] = record
    return [by_step[s] for s in sorted(by_step)]


def load_run(run_dir: str | Path) -> dict:
    run_dir = Path(run_dir)
    critic = [r for r in read_jsonl(run_dir / "critic_metrics.jsonl") if r.get("phase", "rl") == "rl"]
    return {
        "name": run_dir.name,
        "orchestrator": last_per_step(read_jsonl(run_dir / "orchestrator_metrics.jsonl")),
        "critic": last_per_step(critic),
        "policy": last_per_step(read_jsonl(run_dir / "policy_metrics.jsonl")),
    }


def _series(records, key):
    points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    return [p[0] for p in points], [p[1] for p in points]


def plot_runs(run_dirs: list[str | Path], out: str | Path) -> Path:
    runs = [load_run(d) for d in run_dirs]
    figure, axes = plt.subplots(2, 2, figsize=(12, 8))
    (reward_ax, value_ax), (kl_ax, time_ax) = axes
    ev_ax = value_ax.twinx()
    for run in runs:
        steps, reward = _series(run["orchestrator"], "reward_mean")
        (line,) = reward_ax.plot(steps, reward, label=run["name"])
        if len(runs) == 1:
            _, low = _series(run["orchestrator"], "reward_min")
            _, high = _series(run["orchestrator"], "reward_max")
            if len(low) == len(steps):
                reward_ax.fill_between(steps, low, high, alpha=0.15, color=line.get_color())
        steps, loss = _series(run["critic"], "loss")
        if steps:
            value_ax.plot(steps, loss, color=line.get_color(), label=f"{run['name']} value loss")
        steps, ev = _series(run["orchestrator"], "explained_variance")
        if steps:
            ev_ax.plot(
                steps, ev, color=line.get_color(), linestyle="--", label=f"{run['name']} explained var."
            )
        steps, kl = _series(run["policy"], "mismatch_kl")
        if steps:
            kl_ax.plot(steps, [max(k, 1e-18) for k in kl], color=line.get_color(), label=run["name"])
        records = run["orchestrator"]
        if len(runs) == 1 and records:
            bottom = [0.0] * len(records)
            for part in TIME_PARTS:
                values = [r["time"].get(part, 0.0) for r in records]
                time_ax.bar([r["step"] for r in records], values, bottom=bottom, label=part, width=0.9)
                bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        else:
            time_ax.plot([r["step"] for r in records], [r["time"]["total"] for r in records], color=line.get_color(),
                         label=run["name"])  # fmt: skip
    reward_ax.set(title="reward (mean; band: min-max)", xlabel="step")
    value_ax.set(
        title="critic: value loss (solid), explained variance (dashed)", xlabel="step", ylabel="value loss"
    )
    ev_ax.set_ylabel("explained variance")
    kl_ax.set(title="train-inference mismatch KL (k3, policy)", xlabel="step", yscale="log")
    time_ax.set(title="step time split (s)", xlabel="step")
    for ax in (reward_ax, kl_ax, time_ax):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    figure.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=100)
    plt.close(figure)
    return out


def summary_table(run_dirs: list[str | Path], first_k: int = 5) -> str:
    """Reward of the first and last k steps, the rise, value loss, mismatch KL, seconds per step."""
    lines = [f"{'run':<18}{'steps':>6}{f'reward first {first_k}':>17}{f'last {first_k}':>9}{'rise':>8}"
             f"{'value loss':>12}{'mismatch KL':>13}{'s/step':>8}"]  # fmt: skip
    for run_dir in run_dirs:
        run = load_run(run_dir)
        rewards = [r["reward_mean"] for r in run["orchestrator"] if r.get("reward_mean") is not None]
        if not rewards:
            lines.append(f"{run['name']:<18}  (no steps)")
            continue
        first = sum(rewards[:first_k]) / len(rewards[:first_k])
        last = sum(rewards[-first_k:]) / len(rewards[-first_k:])
        value = run["critic"][-1].get("loss") if run["critic"] else None
        kl = max((r.get("mismatch_kl") or 0.0) for r in run["policy"]) if run["policy"] else None
        seconds = [r["time"]["total"] for r in run["orchestrator"]]
        lines.append(
            f"{run['name']:<18}{len(rewards):>6}{first:>17.3f}{last:>9.3f}{last - first:>+8.3f}"
            f"{(f'{value:.4f}' if value is not None else '-'):>12}{(f'{kl:.1e}' if kl is not None else '-'):>13}"
            f"{sum(seconds) / len(seconds):>8.2f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megatron-rl plot", description=__doc__)
    parser.add_argument("runs", nargs="+", help="run directories (logging.dir)")
    parser.add_argument(
        "--out", default=None, help="PNG path (default: RUN_DIR/metrics.png for one run, else compare.png)"
    )
    args = parser.parse_args(argv)
    out = args.out or (Path(args.runs[0]) / "metrics.png" if len(args.runs) == 1 else Path("compare.png"))
    print(f"wrote {plot_runs(args.runs, out)}")
    print(summary_table(args.runs))
    return 0
