"""tests/gpu (the GPU check script) on this CPU machine: run.sh and check.py are never green on
nothing (no CUDA device: exit 3, unless the caller explicitly skips, and then they say SKIPPED; no
torch: exit 4, skip or not); the checks themselves run at toy sizes on CPU (gloo; the offload check
on megatron's hybrid optimizer with its host copies emulated) and say which ones need CUDA; the
default run's limits fit its budget and 8 minutes, and a check whose limit no longer fits is NOT RUN, saying why; the MFU
arithmetic counts FLOPs as written down by hand; the distillation checks (teacher_process, top_k_kl) pass in their
CPU modes, and their criteria fail a misaligned teacher's top k and a KL off by 1e-4 relative."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_rl.config import Architecture
from megatron_rl.data.types import TeacherTopK
from megatron_rl.models import logprobs
from tests.gpu.check import NO_CUDA, NO_TORCH
from tests.gpu.check import main as check_main
from tests.gpu.checks import (
    AFTER_BUDGET,
    CPU_LIMIT_S,
    DEFAULT_BUDGET_S,
    LIMIT_S,
    MULTI_GPU,
    MULTI_GPU_BUDGET_S,
    MULTI_GPU_REGISTRY,
    REGISTRY,
    SHARED,
    model_flops,
)
from tests.gpu.distillation_checks import (
    TEACHER_TOL,
    check_teacher_process,
    check_top_k_kl,
    teacher_top_k_agreement,
)

ROOT = Path(__file__).resolve().parents[2]


def _run_sh(tmp_path, *args, **env):
    out = tmp_path / "out"
    out.mkdir()
    inherited = {k: v for k, v in os.environ.items() if k != "MEGATRON_RL_GPU_CHECKS"}  # no skip unless asked
    env = {**inherited, "OUT": str(out), "PYTHON": sys.executable, **env}
    proc = subprocess.run(["bash", "tests/gpu/run.sh", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert list(out.iterdir()) == []  # no record claims anything
    return proc


def test_run_sh_without_cuda_checks_nothing_and_fails(tmp_path):
    # Before: exit 0, a green that checked nothing.
    proc = _run_sh(tmp_path)
    assert proc.returncode == NO_CUDA == 3, proc.stdout + proc.stderr
    assert "no CUDA device" in proc.stderr and "nothing checked" in proc.stderr and "SKIPPED" not in proc.stderr


def test_run_sh_skips_without_cuda_only_when_asked_and_says_it_checked_nothing(tmp_path):
    proc = _run_sh(tmp_path, "--allow-no-gpu")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SKIPPED" in proc.stdout and "no CUDA device" in proc.stdout and "nothing checked" in proc.stdout


def test_check_py_without_cuda_fails_unless_asked_to_skip(monkeypatch, capsys):
    monkeypatch.delenv("MEGATRON_RL_GPU_CHECKS", raising=False)
    assert check_main([]) == NO_CUDA
    err = capsys.readouterr().err
    assert "no CUDA device" in err and "nothing checked" in err
    for args, env in [(["--allow-no-gpu"], None), ([], "skip")]:
        if env:
            monkeypatch.setenv("MEGATRON_RL_GPU_CHECKS", env)
        assert check_main(args) == 0
        out = capsys.readouterr().out
        assert "SKIPPED" in out and "no CUDA device" in out and "nothing checked" in out


def test_run_sh_without_torch_fails_even_when_asked_to_skip(tmp_path):
    # A torch that cannot be imported (as on a machine without it) comes first on the path.
    shadow = tmp_path / "shadow"
    (shadow / "torch").mkdir(parents=True)
    (shadow / "torch" / "__init__.py").write_text("raise ImportError('no torch here (test shadow)')\n")
    proc = _run_sh(tmp_path, "--allow-no-gpu", PYTHONPATH=str(shadow))
    assert proc.returncode == NO_TORCH == 4, proc.stdout + proc.stderr
    assert "torch not importable" in proc.stderr and "no torch here" in proc.stderr


def test_check_py_without_torch_fails_even_when_asked_to_skip(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    assert check_main(["--allow-no-gpu"]) == NO_TORCH
    err = capsys.readouterr().err
    assert "torch not importable" in err and "nothing checked" in err


@pytest.mark.slow  # the driver end to end: every check forked and run at toy sizes (about a minute)
def test_checks_run_at_toy_sizes_on_cpu(tmp_path):
    out = tmp_path / "gpu.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.gpu.check", "--cpu", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    status = {r["check"]: r["status"] for r in report["checks"]}
    assert status == {
        "versions": "PASS", "te_extension": "NOT RUN", "memory": "PASS", "collectives": "PASS", "layer_step": "PASS",
        "nccl": "PASS", "compile": "PASS", "te_spec": "NOT RUN", "bf16_policy": "PASS", "bf16_critic": "PASS",
        "offload": "PASS", "policy_process": "PASS", "critic_process": "PASS", "vllm": "NOT RUN",
        "te_checkpoints": "NOT RUN", "throughput": "PASS", "teacher_process": "PASS", "top_k_kl": "PASS",
        "vllm_lora": "NOT RUN", "expert_adapters": "PASS", "glm4_moe": "PASS", "deepseek_v3": "PASS",
        "multi_train_step": "NOT RUN",
        "multi_weight_broadcast": "NOT RUN", "multi_expert_all_to_all": "NOT RUN", "multi_moe_families": "NOT RUN",
    }  # fmt: skip
    checks = {r["check"]: r for r in report["checks"]}
    assert "CUDA" in checks["te_spec"]["detail"] and "CUDA" in checks["te_checkpoints"]["detail"]
    # preflight's checks (megatron_rl/launch/preflight), run by the driver on the tiny config
    assert "on gloo: policy (1 rank)" in checks["collectives"]["figures"]["preflight"]
    assert "policy 1 of 2 layers (local spec" in checks["layer_step"]["figures"]["preflight"]
    offload = checks["offload"]["figures"]
    assert offload["gpu_fp32_masters_offload_1.0"] == 0 and offload["max_bf16_ulps_snapshot_offload_vs_not"] <= 2
    assert checks["critic_process"]["figures"]["head_only"] == [True, False]
    policy = checks["bf16_policy"]["figures"]
    assert policy["loss_bf16"][1] < policy["loss_bf16"][0] and policy["mean_abs_output_diff"] < 0.02
    assert [row["tokens"] for row in checks["throughput"]["figures"]["rows"]] == [64, 128]
    assert checks["policy_process"]["figures"]["steps"] == [0, 1]
    experts = checks["expert_adapters"]["figures"]  # no TE on CPU: the grouped GEMM is not measured
    assert sorted(experts["seconds"]) == ["per_expert", "per_expert_adapters"] and experts["experts"] == 8
    # the fusion as the builder configures it on CPU (off): no graph; forced on in test_multi_gpu_twins.py
    compile_figures = checks["compile"]["figures"]
    assert compile_figures["bias_activation_fusion"] is False and compile_figures["graphs_per_step"][-1] == 0
    assert compile_figures["new_lengths_in_steady_steps"] > 0
    assert all(checks[name]["detail"].startswith("needs 2 GPUs, found 0 (--cpu)") for name in MULTI_GPU)
    # the MoE families on the local spec (no TE on CPU): transformers' logits, LoRA on every linear trained
    for family, attention in (("glm4_moe", ["linear_proj", "linear_qkv"]),
                              ("deepseek_v3", ["linear_kv_down_proj", "linear_kv_up_proj", "linear_proj",
                                               "linear_q_down_proj", "linear_q_up_proj"])):  # fmt: skip
        figures = checks[family]["figures"]
        assert figures["spec"] == "local" and figures["max_abs_logit_err_fp32"] < 1e-4, figures
        assert figures["attention_linears"] == attention and figures["adapters_moved"] == figures["adapters"]
        assert figures["lora_losses"][1] < figures["lora_losses"][0]
    assert report["mode"] == "cpu-smoke" and "toy sizes on CPU" in proc.stdout


def test_a_spent_budget_starts_no_check(tmp_path):
    out = tmp_path / "gpu.json"
    args = ["--cpu", "--budget-s", "0", "--only", "nccl", "--out", str(out)]
    proc = subprocess.run([sys.executable, "-m", "tests.gpu.check", *args], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    [record] = json.loads(out.read_text())["checks"]
    assert record["status"] == "NOT RUN" and "time budget" in record["detail"]


def test_the_gpu_registry_takes_preflight_checks_from_preflight_registry():
    from megatron_rl.launch.preflight import REGISTRY as PREFLIGHT

    shared = [(c.name, c.limit_s, c.shows) for c in PREFLIGHT if c.name in SHARED]
    assert [(c.name, c.limit_s, c.shows) for c in REGISTRY[: len(SHARED)]] == shared and len(shared) == len(SHARED)


def test_the_default_run_starts_every_check_within_8_minutes():
    # Each check gets its whole limit: the limits add up to the default budget at most (before:
    # 1,230 s of limits in a 420 s budget), and the budget leaves the driver 30 s of 8 minutes.
    # AFTER_BUDGET's checks run last, only when their limit fits in what the others left.
    counted = [check for check in REGISTRY if check.name not in AFTER_BUDGET]
    assert sum(check.limit_s for check in counted) <= DEFAULT_BUDGET_S <= 8 * 60 - 30
    assert [check.name for check in REGISTRY[-len(AFTER_BUDGET):]] == AFTER_BUDGET
    # The multi-GPU checks have a budget of their own, spent only with >= 2 GPUs.
    assert sum(check.limit_s for check in MULTI_GPU_REGISTRY) <= MULTI_GPU_BUDGET_S
    every = REGISTRY + MULTI_GPU_REGISTRY
    assert len({check.name for check in every}) == len(every) == len(LIMIT_S)
    assert all(check.limit_s > 0 and check.shows for check in every)


def test_multi_gpu_checks_are_not_run_without_two_gpus_and_spend_no_budget(tmp_path):
    out = tmp_path / "gpu.json"
    args = ["--cpu", "--budget-s", "0", "--only", *MULTI_GPU, "--out", str(out)]
    proc = subprocess.run([sys.executable, "-m", "tests.gpu.check", *args], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    records = json.loads(out.read_text())["checks"]
    assert [r["check"] for r in records] == MULTI_GPU
    for record in records:  # the reason, not the spent budget of the one-GPU checks
        assert record["status"] == "NOT RUN" and record["detail"].startswith("needs 2 GPUs, found 0"), record
        assert "test_multi_gpu_twins.py" in record["detail"]


def test_a_check_whose_limit_no_longer_fits_is_not_run_and_says_why(tmp_path):
    # Before: started with what was left and killed there, reported FAIL "timed out".
    out = tmp_path / "gpu.json"
    budget = CPU_LIMIT_S - 1
    args = ["--cpu", "--budget-s", str(budget), "--only", "nccl", "--out", str(out)]
    proc = subprocess.run([sys.executable, "-m", "tests.gpu.check", *args], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    [record] = json.loads(out.read_text())["checks"]
    assert record["status"] == "NOT RUN", record
    assert record["detail"] == (
        f"not started: {budget} s of the time budget ({budget} s) left, and it may take {CPU_LIMIT_S} s "
        "(run it alone: --only nccl)"
    )


def test_model_flops_by_hand():
    arch = Architecture(family="qwen3", hidden_size=8, num_layers=2, num_attention_heads=2,
                        num_key_value_heads=1, head_dim=4, intermediate_size=16, vocab_size=10)  # fmt: skip
    # per layer: q 8x8, k and v 8x4 each, o 8x8, gate/up/down 3 x 8x16 = 64+64+64+384 = 576 weights;
    # output layer 8x10 = 80. Linear FLOPs per token: 2 * (2*576 + 80) = 2464.
    # Causal attention per layer and sequence: 2 * s^2 * (heads*head_dim = 8) = 16 s^2.
    linear = 2464 * (3 + 5)
    attention = 2 * 16 * (3**2 + 5**2)
    assert model_flops(arch, [3, 5]) == 3 * (linear + attention)



def test_teacher_process_check_at_toy_size_on_cpu():
    """check_teacher_process's CPU mode: the teacher under torchrun on one gloo rank (local spec,
    float32) answers /logprobs, with top_k 8 and without, as transformers does, and torchrun exits 0
    after the launcher's SIGTERM."""
    figures = check_teacher_process(cpu=True)  # raises when a criterion fails
    assert figures["dtype"] == "float32" and figures["spec"] == "local" and figures["exit_code"] == 0
    assert max(figures[key] for key in ("max_abs_logprob_err", "max_abs_top_k_reply_logprob_err",
                                        "max_abs_top_logprob_err")) < TEACHER_TOL["float32"]  # fmt: skip
    assert figures["lengths"][1] > 2 * figures["lengths"][0]  # the two-turn chat is the one-turn chat and more
    assert figures["top_k_rows"] == sum(length - 1 for length in figures["lengths"])
    # the id comparison is not vacuous: most rows have no near-tie at the 8th place, and all agree
    assert figures["top_k_rows_ids_equal"] == figures["top_k_rows"] and figures["top_k_clear_rows"] > 0.9 * figures["top_k_rows"]
    assert figures["request_s"] > 0 and figures["scoring_passes"] == 2


def test_teacher_top_k_agreement_finds_swapped_ids():
    """The teacher check's id criterion: a top k taken from the right rows passes with no swap; one
    taken a position late (a misaligned teacher) swaps ids whose reference values are far apart."""
    reference = torch.log_softmax(3 * torch.randn(20, 64, generator=torch.Generator().manual_seed(0)), dim=-1).double()

    def top_k_of(rows):
        values, ids = rows.topk(8, dim=-1)
        pad = np.zeros((1, 8))
        return TeacherTopK(logprobs=np.zeros(len(rows) + 1, np.float32),
                           top_ids=np.concatenate([pad, ids.numpy()]).astype(np.int32),
                           top_logprobs=np.concatenate([pad, values.numpy()]).astype(np.float32))  # fmt: skip

    exact = teacher_top_k_agreement([top_k_of(reference)], [reference], 8, tol=1e-4)
    assert exact["max_swapped_ref_gap"] == 0 and exact["top_k_rows_ids_equal"] == exact["top_k_rows"] == 20
    assert exact["max_abs_top_logprob_err"] < 1e-6 and exact["top_k_sorted"]
    late = teacher_top_k_agreement([top_k_of(torch.roll(reference, 1, dims=0))], [reference], 8, tol=1e-4)
    assert late["max_swapped_ref_gap"] > 1.0 and late["top_k_rows_ids_equal"] < 20


def test_top_k_kl_check_at_toy_size_on_cpu(monkeypatch):
    """check_top_k_kl's CPU mode (vocabulary 4096): KL and gradient within its tolerances of float64,
    each single pass (the fused kernel's too) within the memory bound (the tracker saw the 2 B a
    logit gradient), the two functions on the same logits holding a second gradient that the fused
    kernel does not; a KL off by 1e-4 relative fails it."""
    figures = check_top_k_kl(cpu=True)
    assert figures["vocab"] == 4096 and figures["max_abs_kl_err_t1"] < 1e-5 and figures["max_abs_kl_err_t0.7"] < 1e-5
    assert figures["max_rel_grad_err_t1"] < 2**-7 and figures["mass_range_t1"][1] < 1  # a teacher's top k: mass < 1
    for name in ("logprobs", "top_k_kl", "fused"):
        assert 2 <= figures[f"peak_bytes_per_logit_{name}"] <= figures["bound_bytes_per_logit"]
    two = figures["peak_bytes_per_logit_logprobs_plus_top_k_kl"]
    assert two >= figures["peak_bytes_per_logit_fused"] + 1.5  # two functions: a second bf16 gradient

    real = logprobs.vocab_parallel_top_k_kl

    def off(*args, **kwargs):
        kl, mass = real(*args, **kwargs)
        return kl * (1 + 1e-4), mass

    monkeypatch.setattr(logprobs, "vocab_parallel_top_k_kl", off)
    with pytest.raises(AssertionError, match="KL at temperature 1.0 off by"):
        check_top_k_kl(cpu=True)
