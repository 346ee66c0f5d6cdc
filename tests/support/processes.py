"""Start a `megatron-rl` role on N local ranks the way torchrun does (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT), one subprocess per rank, each with its own log file, and
stop them with SIGTERM. Each rank leads its own process group, which is killed on exit: a rank
killed with SIGKILL leaves children behind (megatron's checkpoint writer starts a
multiprocessing Manager) that would otherwise outlive the test. Used by tests and benchmarks
that run a role's ranks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from megatron_rl.lifetime import bound_to_parent
from megatron_rl.parallel import free_port


class RankProcesses:
    def __init__(self, argv: list[str], world_size: int, log_dir: str | Path, env: dict | None = None):
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        port = free_port()
        self.processes: list[subprocess.Popen] = []
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
            with open(self.logs[rank], "w") as log:
                self.processes.append(
                    subprocess.Popen(
                        bound_to_parent([sys.executable, "-m", "megatron_rl.launch.cli", *argv]),
                        env=rank_env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )

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


def kill_process_group(process: subprocess.Popen) -> None:
    """SIGKILL to the process group `process` leads (itself and whatever it left behind)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()
