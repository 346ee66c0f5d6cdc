"""`bash launch/demo.sh` for a few steps of each algorithm: it runs to completion, writes the
metrics and the figure, the inference servers move to the new policy version every step, and the
train-inference mismatch KL stays below 1e-3 (float32)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("algo", ["sao", "ppo", "grpo"])
def test_demo_runs_each_algorithm(tmp_path, algo):
    out = tmp_path / f"demo-{algo}"
    result = subprocess.run(
        ["bash", str(ROOT / "launch" / "demo.sh"), "--algo", algo, "--steps", "3", "--out", out.name,
         "--sft-steps", "5", "--seed", "3"],  # a relative --out, as a user types it
        capture_output=True, text=True, timeout=900, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "[demo] step   2/3" in result.stdout and "reward first 5" in result.stdout
    assert (out / "metrics.png").stat().st_size > 10_000
    orchestrator = lines(out / "orchestrator_metrics.jsonl")
    assert [r["step"] for r in orchestrator] == [0, 1, 2]
    assert [r["live_version"] for r in orchestrator] == [0, 1, 2]  # a new version live every step
    assert (out / "published" / "latest").read_text().strip() == "v00000003"
    policy = lines(out / "policy_metrics.jsonl")
    assert all(0 <= r["approx_kl"] < 1e-3 for r in policy)
    if algo != "grpo":
        assert [r["step"] for r in lines(out / "critic_metrics.jsonl") if r["phase"] == "rl"] == [0, 1, 2]
