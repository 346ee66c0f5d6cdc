"""The GPU environment (setup.py's `gpu` extra) agrees with itself, checked on CPU without installing:
scripts/check_gpu_env.py resolves it from the package index (metadata only) and finds torch to be
vLLM's torch, TransformerEngine inside megatron-core's declared range and built for torch's CUDA;
a conflicting requirement exits 1 naming it; an unreachable index exits 2 within its timeout, saying
so; `scripts/ensure_venv.sh --gpu --dry-run` prints the plan and runs that check, installing nothing.

Two tests here read PyPI (about 6 s and 2 s): without it they fail saying the index is unreachable."""

from __future__ import annotations

import importlib.metadata
import json
import os
import runpy
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "check_gpu_env.py"
check = runpy.run_path(str(SCRIPT), run_name="check_gpu_env")


def _check(*args: str, timeout: float = 150, env: dict | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, str(SCRIPT), "--timeout", "15", "--resolver-timeout", "120", *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)


def _reachable(proc: subprocess.CompletedProcess) -> None:
    if proc.returncode == check["NOT_CHECKED"]:
        pytest.fail(f"scripts/check_gpu_env.py could not check (this test reads the package index):\n{proc.stderr}")


@pytest.fixture
def silent_index():
    """An index URL whose server accepts connections and never answers."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(16)
        yield f"http://127.0.0.1:{server.getsockname()[1]}/simple"


def test_the_gpu_extra_resolves_on_vllms_torch_and_megatrons_te_range(tmp_path):
    report = tmp_path / "resolved.json"
    proc = _check("--json", str(report))
    _reachable(proc)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(report.read_text())
    facts, resolved = result["facts"], result["resolved"]
    _, gpu = check["setup_requirements"]()
    pins = {Requirement(r).name: next(iter(Requirement(r).specifier)).version for r in gpu}
    # Before: "transformer-engine[pytorch]" unpinned (2.20 resolved, outside megatron-core's range).
    assert set(pins) == {"vllm", "vllm-router", "transformer-engine"}
    assert {name: resolved[name] for name in pins} == pins
    assert Requirement(facts["vllm_torch"]).specifier.contains(resolved["torch"])
    assert Requirement(facts["megatron_te"]).specifier.contains(resolved["transformer-engine"], prereleases=True)
    # The range read from the index is the one of the installed megatron-core's metadata.
    declared = [r for r in importlib.metadata.requires("megatron-core") if r.startswith("transformer-engine")]
    assert [str(Requirement(r).specifier) for r in declared] == [str(Requirement(facts["megatron_te"]).specifier)]
    cuda = check["cuda_major"](resolved)
    assert cuda == 13 and f"transformer-engine-cu{cuda}" in resolved and "transformer-engine-cu12" not in resolved
    assert set(facts["te_torch_requires"]) >= {"einops", "onnx", "torch>=2.1"}  # the torch extension's, resolved too
    assert result["problems"] == []
    rows = {line.split()[0]: line.split()[1] for line in proc.stdout.splitlines() if line[:1].isalpha() and "  " in line}
    assert rows["torch"] == resolved["torch"] and rows["transformer-engine-torch"] == pins["transformer-engine"]
    assert "agree: torch" in proc.stdout


def test_a_conflicting_requirement_exits_1_naming_it():
    proc = _check("--with", "torch==2.12.0")
    _reachable(proc)
    assert proc.returncode == check["DISAGREE"] == 1, proc.stdout + proc.stderr
    assert "DISAGREE" in proc.stderr and "torch==2.12.0" in proc.stderr and "vllm==0.32.0" in proc.stderr


def test_an_unreachable_index_exits_2_within_its_timeout_saying_so(silent_index):
    began = time.monotonic()
    proc = subprocess.run([sys.executable, str(SCRIPT), "--index-url", silent_index, "--timeout", "2"],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == check["NOT_CHECKED"] == 2, proc.stdout + proc.stderr
    assert "NOT CHECKED: package index unreachable" in proc.stderr and silent_index in proc.stderr
    assert time.monotonic() - began < 30


def test_each_disagreement_is_named():
    facts = check["Facts"](vllm="0.32.0", vllm_torch="torch==2.13.0", megatron_core="0.16.1",
                           megatron_te="transformer-engine[core_cu13,pytorch]<2.12.0,>=2.9.0a0", te="2.11.0",
                           te_extras=["core_cu13"])  # fmt: skip
    gpu = ["vllm==0.32.0", "vllm-router==0.1.17", "transformer-engine[core_cu13]==2.11.0"]
    agreeing = {"torch": "2.13.0", "vllm": "0.32.0", "vllm-router": "0.1.17", "transformer-engine": "2.11.0",
                "transformer-engine-cu13": "2.11.0", "nvidia-cuda-runtime": "13.0.96"}  # fmt: skip
    assert check["disagreements"](facts, gpu, agreeing) == []
    broken = {**agreeing, "torch": "2.12.0", "transformer-engine": "2.20.2", "vllm-router": "0.1.18",
              "nvidia-cuda-runtime-cu12": "12.8.90"}  # fmt: skip
    broken.pop("nvidia-cuda-runtime")
    problems = check["disagreements"](facts, gpu, broken)
    assert len(problems) == 5, problems
    torch, te_range, te_cuda, router_pin, te_pin = problems
    assert "torch 2.12.0" in torch and "torch==2.13.0" in torch
    assert "transformer-engine 2.20.2" in te_range and "<2.12.0" in te_range
    assert "CUDA 12" in te_cuda and "core_cu12" in te_cuda
    assert "transformer-engine[core_cu13]==2.11.0" in te_pin and "vllm-router 0.1.18" in router_pin


def test_an_unpinned_gpu_requirement_is_refused_naming_it():
    with pytest.raises(check["Disagree"], match=r"'transformer-engine\[pytorch\]' is not pinned"):
        check["pinned"](["vllm==0.32.0", "transformer-engine[pytorch]"], "transformer-engine")


def test_ensure_venv_gpu_dry_run_prints_the_plan_runs_the_check_and_installs_nothing():
    with socket.socket() as closed:  # a port nothing listens on: the index refuses at once
        closed.bind(("127.0.0.1", 0))
        refused = f"http://127.0.0.1:{closed.getsockname()[1]}/simple"
    stamps = sorted((ROOT / ".venv").glob(".megatron_rl-*"))
    env = {**os.environ, "PIP_INDEX_URL": refused}
    proc = subprocess.run(["bash", "scripts/ensure_venv.sh", "--gpu", "--dry-run"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    te = subprocess.run([sys.executable, str(SCRIPT), "--te-version"], capture_output=True, text=True).stdout.strip()
    assert te == "2.11.0"
    assert f"pip install --no-build-isolation transformer-engine-torch=={te}" in proc.stdout, proc.stdout
    assert "[gpu,dev,tracking]" in proc.stdout and "dry run: nothing installed" in proc.stdout
    # The plan of the TransformerEngine build (scripts/gpu_build_env.py; tests/unit/test_gpu_build_env.py).
    for step in ("R580 or newer", "release 13.x", "CPATH=<site-packages>/nvidia/cudnn/include:<site-packages>/nvidia/nccl/include",
                 "NVTE_NO_LOCAL_VERSION=1", "NVTE_PYTORCH_FORCE_BUILD=TRUE", "megatron_rl_cuda_libs.pth",
                 "CUDNN_HOME, NVRTC_HOME,", "NVTE_CUDA_INCLUDE_DIR"):  # fmt: skip
        assert step in proc.stdout, step
    assert proc.stdout.index("R580") < proc.stdout.index("pip install")  # the driver is checked first
    if shutil.which("nvidia-smi") is None:
        assert "driver here: not checked (no nvidia-smi)" in proc.stdout
    # The check ran (against the silent index here) and its exit status is the script's.
    assert proc.returncode == 2 and "package index unreachable" in proc.stderr, proc.stdout + proc.stderr
    assert sorted((ROOT / ".venv").glob(".megatron_rl-*")) == stamps


# On a GPU machine `ensure_venv.sh --gpu` would install the GPU environment for real (gigabytes);
# the refusal it checks only exists where there is no GPU.
@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a machine with nvidia-smi: --gpu would install")
def test_ensure_venv_gpu_refuses_a_machine_without_cuda():
    proc = subprocess.run(["bash", "scripts/ensure_venv.sh", "--gpu"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert proc.returncode == 3 and "no CUDA device" in proc.stderr and "--gpu --dry-run" in proc.stderr
