"""The gloo twins of the GPU script's multi-GPU checks and of its `compile` check
(tests/gpu/multi_gpu.py, tests/gpu/compile_check.py): the same functions, `cpu=True`, on CPU.

- multi_train_step: DP=2 and TP=2 (test_train_step.py's one_training_step) and EP=2 on a MoE
  train like one process;
- multi_weight_broadcast: EP=2 policy ranks broadcast into the receiver process (the real
  WeightReceiverExtension around transformers) over gloo, bit for bit;
- multi_expert_all_to_all: EP=2 logits equal one process, the dispatcher's all-to-alls counted;
- compile: the policy model with bias_activation_fusion forced on (megatron's swiglu through
  torch.compile, inductor's C++ backend) over packed micro-batches of many lengths compiles each
  fused function at most twice and nothing in the steady steps; the time is not judged on CPU.
"""

from __future__ import annotations

import json

import pytest

from tests.gpu import compile_check, multi_gpu
from tests.support.spawn import run_ranks


def test_multi_gpu_checks_say_why_they_do_not_run_on_cpu():
    assert multi_gpu.not_run_reason(cpu=True).startswith("needs 2 GPUs, found 0 (--cpu)")


def test_multi_train_step_twin():
    figures = multi_gpu.check_multi_train_step(cpu=True)
    assert figures["dense_step_moved"] > 1e-4 and figures["moe_step_moved"] > 1e-4
    for layout in ("dp2", "tp2", "ep2"):
        assert figures[f"{layout}_max_param_diff"] <= multi_gpu.CPU_PARAM_ATOL, figures


def test_multi_weight_broadcast_twin():
    figures = multi_gpu.check_multi_weight_broadcast(cpu=True)
    assert figures["backend"] == "gloo" and figures["policy_ranks"] == 2 and figures["version"] == 7
    assert figures["tensors_differing"] == 0 and figures["tensors_sent"] == figures["tensors_expected"] > 0
    assert figures["receiver_device"] == "cpu" and figures["layer_by_layer"]


def test_multi_expert_all_to_all_twin():
    figures = multi_gpu.check_multi_expert_all_to_all(cpu=True)
    assert figures["max_abs_logit_diff_ep2"] <= multi_gpu.CPU_LOGIT_ATOL
    assert all(calls > 0 for calls in figures["all_to_all_calls_ep2"]), figures
    assert figures["swapped_experts_logit_change"] > 1e-3


def test_compile_twin_with_the_fusion_forced_on():
    [figures] = run_ranks(compile_figures, 1, True)
    assert figures["bias_activation_fusion"] and figures["jit_fuser"] == "torch.compile", figures
    # swiglu and swiglu_back: a static graph for the first length, then a dynamic one
    assert set(figures["compiled_entries"]) == {"fused_bias_swiglu.swiglu", "fused_bias_swiglu.swiglu_back"}
    assert all(n <= compile_check.GRAPHS_PER_FUNCTION for n in figures["compiled_entries"].values())
    assert figures["graphs_per_step"][-1] == sum(figures["compiled_entries"].values())
    assert figures["graphs_in_steady_steps"] == 0 and figures["new_lengths_in_steady_steps"] > 0
    assert compile_check.compile_problems(figures, None) == []
    assert figures["first_step_s"] > figures["steady_step_s"]  # the first step paid the compile


def test_compile_problems_name_a_recompiling_function_and_a_slow_cold_start():
    figures = {"jit_fuser": "torch.compile", "bias_activation_fusion": True, "first_step_s": 30.0,
               "steady_step_s": 0.1, "graphs_per_step": [4, 6, 8, 10], "graphs_in_steady_steps": 4,
               "compiled_entries": {"fused_bias_swiglu.swiglu": 5}, "micro_batch_lengths": 12,
               "new_lengths_in_steady_steps": 3}  # fmt: skip
    problems = compile_check.compile_problems(figures, 12.5)
    assert len(problems) == 3, problems
    assert "4 graphs compiled in the steady steps" in problems[0] and "swiglu': 5" in problems[1]
    assert "30.0 s > 12.5 s" in problems[2]
    assert compile_check.compile_problems({**figures, "new_lengths_in_steady_steps": 0}, None)[0].startswith(
        "the steady steps saw no new micro-batch length"
    )


def compile_figures(rank, world_size, fusion):
    """measure_compile on CPU in a fresh rank (dynamo's counters start at zero)."""
    from megatron_rl import parallel

    parallel.initialize_model_parallel()
    return compile_check.measure_compile(cpu=True, fusion=fusion)


def test_spawned_ranks_form_a_group_through_the_check_wrapper():
    # The GPU path of run_ranks: fresh interpreters ("spawn"), not forks; here over gloo.
    results = run_ranks(multi_gpu.exact_float32, 2, summed_rank, start_method="spawn")
    assert [float(r) for r in results] == [3.0, 3.0]
    with pytest.raises(ValueError, match="start_method 'fork' is not 'forkserver' or 'spawn'"):
        run_ranks(summed_rank, 1, start_method="fork")


def summed_rank(rank, world_size):
    """The all-reduced sum of rank + 1 over the group (a tensor, which the wrapper moves to the CPU)."""
    import torch
    import torch.distributed as dist

    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    return value


def test_multi_gpu_checks_spend_a_budget_of_their_own(monkeypatch, tmp_path):
    # As on a node with GPUs enough, but with the multi-GPU budget spent: each is "not started",
    # named against its own budget, while the one-GPU budget (--cpu: none) is untouched.
    from tests.gpu import check

    monkeypatch.setattr(check.multi_gpu, "not_run_reason", lambda cpu: None)
    monkeypatch.setattr(check, "MULTI_GPU_BUDGET_S", 0)
    out = tmp_path / "gpu.json"
    assert check.main(["--cpu", "--only", *check.MULTI_GPU, "--out", str(out)]) == 0
    records = json.loads(out.read_text())["checks"]
    assert [r["status"] for r in records] == ["NOT RUN"] * len(check.MULTI_GPU)
    assert all("of the time budget (0 s) left" in r["detail"] for r in records), records
