"""`megatron-rl plot` (the figure and summary of finished runs, what the demo prints at its end)
and the `router` job step's hand-over to vllm-router (it replaces its own process: the real exec
runs in tests/slurm/test_slurm_jobs.py, where the router step serves the job's rollouts)."""

from __future__ import annotations

import json
from unittest import mock

import pytest

from megatron_rl.launch import job_steps
from tests.support.cli import run_cli
from tests.support.orchestrator import orchestrator_config


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_plot_draws_runs_and_summarises_each_one_without_a_critic_or_without_steps(tmp_path):
    grpo, empty = tmp_path / "grpo", tmp_path / "empty"
    grpo.mkdir(), empty.mkdir()
    rewards = [0.1, 0.2, 0.4, 0.5]
    write_jsonl(grpo / "orchestrator_metrics.jsonl",
                [{"step": s, "reward_mean": r, "time": {"total": 2.0, "generate": 1.5}} for s, r in enumerate(rewards)])  # fmt: skip
    write_jsonl(grpo / "policy_metrics.jsonl", [{"step": s, "mismatch_kl": 1e-9 * (s + 1)} for s in range(4)])
    # no critic_metrics.jsonl: a GRPO run has no critic
    out = tmp_path / "figures" / "compare.png"
    result = run_cli("plot", str(grpo), str(empty), "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert out.stat().st_size > 10_000 and f"wrote {out}" in result.stdout
    row = next(line for line in result.stdout.splitlines() if line.startswith("grpo"))
    first, last = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4  # first 5 and last 5 of 4 steps
    assert row.split()[1:6] == ["4", f"{first:.3f}", f"{last:.3f}", f"{last - first:+.3f}", "-"]
    assert row.split()[6:] == ["4.0e-09", "2.00"]
    assert "empty               (no steps)" in result.stdout


def test_router_job_step_hands_the_resolved_config_to_the_router(tmp_path):
    resolved = orchestrator_config("grpo")
    path = tmp_path / "resolved.json"
    path.write_text(resolved.model_dump_json())

    class Exec(Exception):
        """What the real exec_router never does: return."""

    with mock.patch.object(job_steps, "exec_router", side_effect=Exec) as exec_router, pytest.raises(Exec):
        run_cli("router", "--config", str(path))
    (config, service), _ = exec_router.call_args
    assert service is None  # the policy's router (--service names a served model's)
    assert config.inference.router_port == resolved.inference.router_port
    assert config.layout.inference_urls == resolved.layout.inference_urls
    bad = run_cli("router", "--config", str(tmp_path / "missing.json"))
    assert bad.returncode == 2 and "missing.json" in bad.stderr and "not a resolved config" in bad.stderr
