"""Start a `megatron-rl` role on N local ranks the way torchrun does (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT), one process per rank, each with its own log file, and
stop them with SIGTERM. Each rank leads its own process group (session), which is killed on
exit: a rank killed with SIGKILL leaves children behind (megatron's checkpoint writer starts a
multiprocessing Manager) that would otherwise outlive the test. Used by tests and benchmarks
that run a role's ranks.

A rank is a fork of the session's forkserver (tests/support/spawn.py: torch, megatron-core and
the test modules imported once) running `megatron-rl ROLE ...`'s `main(argv)` with the rank's
environment, instead of a fresh interpreter that spends ~11 s of CPU on the same imports (a
stack run starts two roles, the restart loop a dozen). What a process of its own gives stays:
its pid and session, signals and exit codes (a rank killed with SIGKILL exits -9), its output
in its log file, SIGTERM when the process that started it (the forkserver, which ends with the
test session) dies. The one module that reads the environment when it is imported,
`megatron_rl.faults` (the kill point of a restart test), is imported again in the rank.

`start_service_ranks` starts a role that serves HTTP (the critic, the Megatron teacher) and
returns once its /health answers.
"""

from __future__ import annotations

import asyncio
import atexit
import ctypes
import importlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from megatron_rl.parallel import free_port
from tests.support.spawn import forkserver_context


def _forked_main(target, args: tuple, env: dict[str, str], log_path: str) -> None:
    """In the forked process: a session of its own, SIGTERM when its starter dies, output to its
    log, its environment (with what reads it at import read again), then `target(*args)`."""
    os.setsid()
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.environ.clear()
    os.environ.update(env)
    import torch

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    from megatron_rl import faults

    importlib.reload(faults)  # MEGATRON_RL_KILL_AT is read at import: this process's, not the forkserver's
    try:
        target(*args)
    finally:
        atexit._run_exitfuncs()  # what an interpreter's exit runs (logging's flush, torch's teardown)


def run_cli(argv: list[str]) -> None:
    """`megatron-rl ARGV` as its command line runs it (the exit code is main's)."""
    from megatron_rl.launch import cli

    sys.argv = ["megatron-rl", *argv]
    sys.exit(cli.main(argv))


class ForkedProcess:
    """`target(*args)` in a fork of the session's forkserver, with `env` and its output in
    `log_path`; what the tests use of subprocess.Popen: pid, poll, wait, send_signal, kill,
    returncode (a process killed by a signal gives minus its number)."""

    def __init__(self, target, args: tuple, env: dict[str, str], log_path: Path):
        self._process = forkserver_context().Process(target=_forked_main, args=(target, args, env, str(log_path)))
        self._process.start()
        self.pid = self._process.pid
        self.args = [getattr(target, "__name__", str(target)), *map(str, args)]

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class RankProcesses:
    def __init__(self, argv: list[str], world_size: int, log_dir: str | Path, env: dict | None = None):
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        port = free_port()
        self.processes: list[ForkedProcess] = []
        self.logs = [self.log_dir / f"rank{rank}.log" for rank in range(world_size)]
        for rank in range(world_size):
            rank_env = {
                **os.environ,
                "OMP_NUM_THREADS": "1",
                **(env or {}),
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(world_size),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
            }
            self.processes.append(ForkedProcess(run_cli, (list(argv),), rank_env, self.logs[rank]))

    def output(self, rank: int = 0) -> str:
        return self.logs[rank].read_text()

    def check_alive(self) -> None:
        for rank, process in enumerate(self.processes):
            if process.poll() is not None:
                raise RuntimeError(
                    f"rank {rank} exited with {process.returncode}:\n{self.output(rank)[-4000:]}"
                )

    def stop(self, timeout_s: float = 60.0) -> list[int]:
        """SIGTERM to every rank, then wait; returns the exit codes (killed ranks give -9)."""
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        codes = []
        for process in self.processes:
            try:
                codes.append(process.wait(timeout=timeout_s))
            except subprocess.TimeoutExpired:
                process.kill()
                codes.append(process.wait())
        return codes

    def __enter__(self) -> RankProcesses:
        return self

    def __exit__(self, *exc) -> None:
        for process in self.processes:
            kill_process_group(process)


def start_service_ranks(argv: list[str], world_size: int, log_dir: str | Path, client: Callable[[], object],
                        timeout_s: float = 240.0) -> RankProcesses:  # fmt: skip
    """Starts `megatron-rl ARGV` on `world_size` ranks (RankProcesses) and waits until the
    service's /health answers: `client()` makes a client of it (critic/client.py ServiceClient:
    async health(), close()), one per poll, each in its own event loop. A rank that exits first
    raises with its output, and so does `timeout_s` with rank 0's; either way the ranks are
    killed. The returned RankProcesses kills them when its `with` block ends."""
    ranks = RankProcesses(argv, world_size, log_dir)
    deadline = time.monotonic() + timeout_s
    try:
        while not asyncio.run(_healthy(client())):
            ranks.check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{argv[0]} not healthy within {timeout_s}s:\n{ranks.output()[-3000:]}")
            time.sleep(0.5)
    except BaseException:
        ranks.__exit__(None, None, None)
        raise
    return ranks


async def _healthy(client) -> bool:
    try:
        return await client.health()
    finally:
        await client.close()


def kill_process_group(process: ForkedProcess | subprocess.Popen) -> None:
    """SIGKILL to the process group `process` leads (itself and whatever it left behind)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()

