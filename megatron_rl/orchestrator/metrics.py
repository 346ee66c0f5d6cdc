"""One JSON line of orchestrator metrics per step (`logging.dir/orchestrator_metrics.jsonl`)
and a console line: rewards, pass rate, lengths, truncation, multi-turn rollouts (turns, tool
calls and errors, observation tokens, the token budget), an LLM judge's verdicts (their mean, the
unparsable ones), admission counts by rule, stale
drops, dynamic sampling's cost (groups generated for the step, extra generation as a fraction of
the batch, the bound hit, a smaller batch), overlong shaping, the off-policy lag histogram,
partial rollouts (the version span of samples, the fraction of action tokens per lag,
interruptions and the tokens they sent again), advantages, the critic's values and explained
variance of the returns, on-policy distillation's teacher KL and its share of the reward, the train-inference
mismatch KL reported by the policy, and the step's time split."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from megatron_rl.algorithms.distillation import distillation_metrics
from megatron_rl.config import OverlongConfig


def explained_variance(values: np.ndarray, returns: np.ndarray) -> float | None:
    """1 - Var(returns - values) / Var(returns) over action tokens; None when undefined."""
    if len(returns) < 2 or float(np.var(returns)) == 0.0:
        return None
    return float(1.0 - np.var(returns - values) / np.var(returns))


def _stats(prefix: str, values) -> dict:
    values = np.asarray(values, dtype=np.float64)
    if values.size == 0:
        return {f"{prefix}_mean": None, f"{prefix}_std": None, f"{prefix}_min": None, f"{prefix}_max": None}
    return {f"{prefix}_mean": float(values.mean()), f"{prefix}_std": float(values.std()),
            f"{prefix}_min": float(values.min()), f"{prefix}_max": float(values.max())}  # fmt: skip


def overlong_metrics(samples, overlong: OverlongConfig | None) -> dict:
    """How many samples the length shaping touched: `overlong_shaped` (a nonzero penalty),
    `overlong_penalty_mean` (over every sample of the step), `overlong_masked` (mask mode: every
    truncated sample), `score_mean` (the environment's reward before shaping)."""
    penalties = [s.reward - s.score for s in samples]
    masking = overlong is not None and overlong.mode == "mask"
    return {
        "score_mean": float(np.mean([s.score for s in samples])) if samples else None,
        "overlong_shaped": sum(1 for p in penalties if p != 0.0),
        "overlong_penalty_mean": float(np.mean(penalties)) if samples else None,
        "overlong_masked": sum(1 for s in samples if s.truncated) if masking else 0,
    }


def turn_metrics(members) -> dict:
    """Multi-turn rollouts of the step's finished members: `turns_mean` (completions per
    rollout), `tool_calls`, `tool_errors` and `tool_malformed` (totals; malformed: calls the
    parser could not read, part of the errors), `observation_tokens_mean` (tokens the
    environment appended, loss mask 0), `budget_exhausted_rate` (rollouts cut by the token budget
    before their episode ended: bootstrapped by the critic's value), `template_rewrites` (tool
    messages the chat template could not render as an extension of the rollout: rendered after a
    reference conversation instead, orchestrator/chat.py), and a hub environment's named rewards and
    metrics (`env/reward/NAME_mean`, `env/metric/NAME_mean`: means over the members that have them)."""
    if not members:
        return {"turns_mean": None, "tool_calls": 0, "tool_errors": 0, "tool_malformed": 0, "observation_tokens_mean": None,
                "budget_exhausted_rate": None, "template_rewrites": 0}  # fmt: skip
    judged = [m.judge_score for m in members if m.judge_score is not None]
    named: dict[str, list[float]] = {}
    for member in members:
        for name, value in (member.scores or {}).items():
            named.setdefault(name, []).append(value)
    return {
        **({"judge_score_mean": float(np.mean(judged))} if judged else {}),
        "turns_mean": float(np.mean([m.turns for m in members])),
        "tool_calls": int(sum(m.tool_calls for m in members)),
        "tool_errors": int(sum(m.tool_errors for m in members)),
        "tool_malformed": int(sum(m.tool_malformed for m in members)),
        "observation_tokens_mean": float(np.mean([m.observation_tokens for m in members])),
        "budget_exhausted_rate": float(np.mean([m.budget_exhausted for m in members])),
        "template_rewrites": int(sum(m.template_rewrites for m in members)),
        **{f"env/{name}_mean": float(np.mean(values)) for name, values in sorted(named.items())},
    }


def version_metrics(step: int, samples) -> dict:
    """Partial rollouts: `version_span_mean` / `_max` (newest minus oldest version behind a
    sample's action tokens), `samples_spanning_versions` (samples with more than one), and
    `token_lag` (the fraction of the step's action tokens per lag, step - the version that
    sampled the token)."""
    spans, lags = [], []
    for sample in samples:
        versions = sample.versions()[sample.loss_mask]
        if versions.size:
            spans.append(int(versions.max() - versions.min()))
            lags.append(step - versions)
    lags = np.concatenate(lags) if lags else np.zeros(0, dtype=np.int64)
    values, counts = np.unique(lags, return_counts=True)
    return {
        "version_span_mean": float(np.mean(spans)) if spans else None,
        "version_span_max": max(spans) if spans else None,
        "samples_spanning_versions": sum(1 for span in spans if span > 0),
        "token_lag": {str(int(v)): round(float(c) / lags.size, 6) for v, c in zip(values, counts)},
    }


def step_metrics(
    step, batch, samples, counts, dispatcher, times, critic_status, live_version, batch_size,
    overlong: OverlongConfig | None = None, distillation=None,
) -> dict:
    """`counts`: the dispatcher's StepCounts of this step; `overlong`: the OverlongConfig or None;
    `distillation`: the algorithm's (the teacher's signal: `distillation_metrics`) or None."""
    members = [m for group, _ in batch for m in group.members if m.status == "finished"]
    unparsable = sum(1 for group, _ in batch for m in group.members
                     if m.status == "failed" and (m.error or "").startswith("JudgeVerdictError"))  # fmt: skip
    passed = [m.passed for m in members if m.passed is not None]
    mask = [s.loss_mask for s in samples]
    advantages = np.concatenate([s.advantages[s.loss_mask] for s in samples]) if samples else np.zeros(0)
    record = {
        "step": step,
        **_stats("reward", [s.reward for s in samples]),
        "pass_rate": float(np.mean(passed)) if passed else None,
        "completion_tokens_mean": float(np.mean([m.sum() for m in mask])) if samples else None,
        "sequence_tokens_mean": float(np.mean([len(s) for s in samples])) if samples else None,
        "truncation_rate": float(np.mean([s.truncated for s in samples])) if samples else None,
        **turn_metrics(members),
        "groups_generated": counts.generated,
        "groups_admitted": len(batch),
        "group_ids": [group.group_id for group, _ in batch],
        "samples": len(samples),
        "groups_rejected": dict(counts.rejected),
        "members_dropped": dict(counts.members_dropped),
        **({"member_errors": dict(counts.member_errors)} if counts.member_errors else {}),
        **({"judge_unparsable": unparsable} if unparsable else {}),
        "stale_dropped": counts.stale,
        "extra_generation": max(0, counts.generated - batch_size) / batch_size,
        "dynamic_sampling_limit_hit": counts.limit_hit,
        "batch_partial": counts.partial,
        "groups_restarted": counts.restarted,
        **overlong_metrics(samples, overlong),
        "off_policy_lag": {str(k): v for k, v in sorted(dispatcher.lag_histogram.items())},
        **version_metrics(step, samples),
        "interruptions": int(sum(m.interruptions for m in members)),
        "reprefilled_tokens": int(sum(m.reprefilled_tokens for m in members)),
        "advantage_mean": float(advantages.mean()) if advantages.size else None,
        "advantage_std": float(advantages.std()) if advantages.size else None,
        "live_version": live_version,
        "finished_at": time.time(),
        "time": {k: round(v, 4) for k, v in times.items()},
    }
    if distillation is not None:
        record.update(distillation_metrics(samples, distillation.coef, distillation.mode, distillation.baseline))
    if samples and samples[0].values is not None:
        values = np.concatenate([s.values[s.loss_mask] for s in samples])
        returns = np.concatenate([s.returns[s.loss_mask] for s in samples])
        record["value_mean"] = float(values.mean()) if values.size else None
        record["explained_variance"] = explained_variance(values, returns)
        record["critic_trained_step"] = critic_status.get("trained_step") if critic_status else None
    dispatcher.lag_histogram.clear()
    return record


class MetricsWriter:
    """Appends records to the JSONL file, adds the policy's mismatch KL for the newest step it
    has reported (`policy_metrics.jsonl`: `mismatch_kl`, KL between the sampler's and the
    trainer's log-probs on the same tokens before the update), prints a console line, and hands
    the record as written to `tracker` (W&B / TensorBoard, orchestrator/tracking.py) when given."""

    def __init__(self, log_dir: str | Path, console: bool = True, num_steps: int | None = None, tracker=None):
        self.dir = Path(log_dir)
        self.tracker = tracker
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "orchestrator_metrics.jsonl"
        self.console, self.num_steps = console, num_steps
        self.began = None
        self.first_step = 0
        self._progress = None
        self._task = None

    def policy_mismatch(self) -> tuple[int | None, float | None]:
        path = self.dir / "policy_metrics.jsonl"
        if not path.is_file():
            return None, None
        with open(path, "rb") as f:  # only the last line: the file grows every step
            f.seek(max(0, f.seek(0, 2) - 65536))
            lines = [line for line in f.read().splitlines() if line.strip()]
        if not lines:
            return None, None
        last = json.loads(lines[-1])
        return last.get("step"), last.get("mismatch_kl")

    def _line(self, record: dict, left_s: float | None) -> str:
        reward, ev, kl = record["reward_mean"], record.get("explained_variance"), record.get("mismatch_kl")
        parts = [
            f"step {record['step']}",
            f"reward {reward:.4f}" if reward is not None else "reward -",
            f"groups {record['groups_admitted']}/{record['groups_generated']}",
            f"stale {record['stale_dropped']}",
            f"ev {ev:.3f}" if ev is not None else "",
            f"mismatch_kl {kl:.2e}" if kl is not None else "",
            f"{record['time']['total']:.2f}s",
            f"left ~{left_s:.0f}s" if left_s is not None else "",
        ]
        return " | ".join(p for p in parts if p)

    def __call__(self, record: dict) -> None:
        policy_step, mismatch = self.policy_mismatch()
        record = {**record, "mismatch_kl": mismatch, "mismatch_kl_policy_step": policy_step}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tracker is not None:  # after the JSONL line: the file is the source of truth
            self.tracker.log(record)
        if self.began is None:
            self.began = time.monotonic() - record["time"]["total"]
            self.first_step = record["step"]
        if not self.console:
            return
        done = record["step"] - self.first_step + 1
        left = None
        if self.num_steps:
            left = (time.monotonic() - self.began) / done * (self.num_steps - record["step"] - 1)
        line = self._line(record, left)
        if sys.stdout.isatty():  # a live progress bar; a plain line per step in logs
            self._progress_update(record, line)
        else:
            print(f"[orchestrator] {line}", flush=True)

    def _progress_update(self, record: dict, line: str) -> None:
        if self._progress is None:
            self._progress = Progress(TextColumn("[bold]RL[/bold]"), BarColumn(), TextColumn("{task.description}"),
                                      TimeRemainingColumn())  # fmt: skip
            self._progress.start()
            self._task = self._progress.add_task(line, total=self.num_steps, completed=record["step"])
        self._progress.update(self._task, completed=record["step"] + 1, description=line)
        if self.num_steps and record["step"] + 1 >= self.num_steps:
            self._progress.stop()
