"""Run a function on N gloo ranks in fresh processes and collect each rank's return value.

`run_ranks(fn, world_size, *args)` returns `[result_of_rank_0, ...]`. Results travel back as
files written with torch.save in a private temporary directory (no sockets involved). `fn` must
be importable by name (module level): ranks start from a forkserver that imported torch,
megatron_rl.compat and megatron-core once (`PRELOAD`), so each rank is a fork of a process that
has paid the imports (several seconds a rank on a small machine) instead of a fresh interpreter.
The forkserver never initialises CUDA or a process group, so its forks start clean.
"""

from __future__ import annotations

import os
import sys
import tempfile
import traceback
from pathlib import Path

import torch
import torch.multiprocessing as mp

from megatron_rl.parallel import free_port

# What the forkserver imports once for every later rank (compat before megatron-core).
PRELOAD = [
    "megatron_rl.compat", "megatron.core.parallel_state", "megatron.core.models.gpt", "megatron_rl.parallel",
    # what a role's rank imports (tests/support/processes.py forks them from here too)
    "megatron_rl.launch.cli", "megatron_rl.policy.trainer", "megatron_rl.critic.worker",
]  # fmt: skip


def _preload() -> list[str]:
    """PRELOAD, plus the test modules already imported (pytest imports them all when it collects,
    before the first test runs): a rank function lives in its test's module, and importing that
    module (pytest, its helpers) in every rank would cost seconds a rank."""
    tests = sorted(name for name in sys.modules if name.startswith("tests."))
    return PRELOAD + tests


def _rank_main(rank: int, world_size: int, port: int, out_dir: str, fn, args) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    import megatron_rl.compat  # noqa: F401  (before megatron-core)

    from megatron_rl import parallel

    try:
        parallel.initialize_distributed(timeout_s=300)
        result = fn(rank, world_size, *args)
        parallel.finished()
        torch.save({"ok": True, "result": result}, Path(out_dir) / f"rank{rank}.pt")
    except BaseException:
        torch.save({"ok": False, "error": traceback.format_exc()}, Path(out_dir) / f"rank{rank}.pt")
        raise
    finally:
        parallel.destroy()


def forkserver_context():
    """The multiprocessing context of the session's forkserver (started on first use with
    `_preload()`), which run_ranks and tests/support/processes.py fork from."""
    mp.set_forkserver_preload(_preload())  # before the forkserver starts (ignored afterwards)
    return mp.get_context("forkserver")


def run_ranks(fn, world_size: int, *args, timeout_s: float = 600.0, start_method: str = "forkserver") -> list:
    """`start_method` "spawn": fresh interpreters instead of forks (NCCL ranks on GPUs, which must
    not fork a process that asked CUDA anything: tests/gpu/multi_gpu.py); the backend and device
    follow megatron_rl.compat (NCCL and one GPU a rank, LOCAL_RANK, where CUDA is available). When
    rank 0's rendezvous store finds its port taken (StoreAddressTaken), the ranks start again on
    another port, up to three times in all."""
    if start_method not in ("forkserver", "spawn"):
        raise ValueError(f"run_ranks: start_method {start_method!r} is not 'forkserver' or 'spawn'")
    if start_method == "forkserver":
        forkserver_context()
    for attempt in range(3):
        try:
            return _run_ranks_once(fn, world_size, args, timeout_s, start_method)
        except StoreAddressTaken:
            if attempt == 2:
                raise


class StoreAddressTaken(RuntimeError):
    """Rank 0's rendezvous store could not listen: the free port found for it was taken by another
    process before it bound (a race no port probe avoids); run_ranks retries with another port."""


def _run_ranks_once(fn, world_size: int, args, timeout_s: float, start_method: str) -> list:
    with tempfile.TemporaryDirectory() as out_dir:
        context = mp.start_processes(
            _rank_main,
            args=(world_size, free_port(), out_dir, fn, args),
            nprocs=world_size,
            join=False,
            start_method=start_method,
        )
        for process in context.processes:
            process.join(timeout_s)
        for process in context.processes:
            if process.is_alive():
                process.kill()
        payloads, errors = [], []
        for rank, process in enumerate(context.processes):
            path = Path(out_dir) / f"rank{rank}.pt"
            if not path.exists():
                errors.append(f"rank {rank}: exited with code {process.exitcode} and no result")
                continue
            payload = torch.load(path, weights_only=False)
            if not payload["ok"]:
                errors.append(f"rank {rank} failed:\n{payload['error']}")
            payloads.append(payload)
        if errors:
            # The root cause is usually the shortest traceback; the others are its victims.
            message = "\n".join(sorted(errors, key=len))
            if "initialize_distributed" in message and "EADDRINUSE" in message:
                raise StoreAddressTaken(message)
            raise RuntimeError(message)
        return [p["result"] for p in payloads]
