"""A lost rank ends its whole group, named (issue 16, item 8): the heartbeat watchdog on bare
gloo groups (lost_rank_worker.py): a rank killed in a collective, a rank that hangs (stopped, so
its sockets stay open and gloo would wait for the process-group timeout), the rank that hosts
the store, and a normal exit at different times that must not count as a loss."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_rl.parallel import free_port
from megatron_rl.parallel.watchdog import LOST_PEER_EXIT

# Whole processes killed, stopped and timed out (fresh interpreters: a fork of the test's
# forkserver leaves the group faster than a launched rank and races the store): the slow group.
pytestmark = pytest.mark.slow

TIMEOUT_S = 4.0  # heartbeat timeout of these groups


def run_group(tmp_path: Path, scenario: str, world: int, kill_rank: int | None = None):
    """Starts `world` ranks, waits until all are ready, kills `kill_rank` (SIGKILL), waits for the
    others. Returns (exit codes, logs, seconds from the kill until the last survivor exited)."""
    port = free_port()
    logs = [tmp_path / f"{scenario}-rank{r}.log" for r in range(world)]
    processes = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}  # fmt: skip
        with open(logs[rank], "w") as log:
            processes.append(subprocess.Popen(
                [sys.executable, "-m", "tests.distributed.lost_rank_worker", scenario, str(TIMEOUT_S)],
                env=env, stdout=log, stderr=subprocess.STDOUT,
            ))  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not all("ready" in log.read_text() for log in logs):
            assert time.monotonic() < deadline, [log.read_text()[-2000:] for log in logs]
            time.sleep(0.2)
        began = time.monotonic()
        if kill_rank is not None:
            processes[kill_rank].kill()
        codes = {}
        for rank, process in enumerate(processes):
            if scenario in ("hang", "restarted") and rank == 1:
                continue  # stopped: it never exits by itself
            codes[rank] = process.wait(timeout=60)
        return codes, [log.read_text() for log in logs], time.monotonic() - began
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()


def test_killed_rank_is_named_by_every_other_rank(tmp_path):
    codes, logs, seconds = run_group(tmp_path, "collectives", 3, kill_rank=1)
    assert codes[1] == -9
    for rank in (0, 2):
        assert codes[rank] != 0, logs[rank]
        assert f"test rank {rank} of 3: lost rank 1:" in logs[rank], logs[rank]
    assert seconds < 2 * TIMEOUT_S + 10


def test_hanging_rank_ends_the_group_within_the_heartbeat_timeout(tmp_path):
    # Rank 1 stops itself between two all-reduces: its sockets stay open, so without the watchdog
    # ranks 0 and 2 would wait the whole process-group timeout (600 s in the worker).
    codes, logs, seconds = run_group(tmp_path, "hang", 3)
    assert codes[0] == LOST_PEER_EXIT, logs[0]
    assert "test rank 0 of 3: lost rank 1: no heartbeat for" in logs[0]
    assert "deployment.heartbeat_timeout_s = 4" in logs[0]
    # Rank 2 names rank 1 too, directly or as the rank that stopped before rank 0's store went away.
    assert codes[2] == LOST_PEER_EXIT, logs[2]
    assert "lost rank 1:" in logs[2] or "before that, rank 1 had stopped its heartbeat" in logs[2], logs[2]
    assert seconds < 2 * TIMEOUT_S + 15


def test_a_finished_rank_of_an_earlier_torchrun_attempt_does_not_hide_a_lost_one(tmp_path):
    # torchrun's store outlives a restart of its workers; heartbeats are kept per attempt.
    codes, logs, seconds = run_group(tmp_path, "restarted", 2)
    assert codes[0] == LOST_PEER_EXIT, logs[0]
    assert "test rank 0 of 2: lost rank 1: no heartbeat for" in logs[0]
    assert seconds < 2 * TIMEOUT_S + 15


def test_losing_the_store_host_is_named(tmp_path):
    codes, logs, _ = run_group(tmp_path, "collectives", 2, kill_rank=0)
    assert codes[1] != 0
    assert "test rank 1 of 2: lost rank 0 (the rendezvous store at 127.0.0.1:" in logs[1], logs[1]


def test_ranks_leaving_normally_at_different_times_are_not_lost(tmp_path):
    # Rank 0 leaves (and takes the store it hosts with it) two heartbeat timeouts before the others.
    codes, logs, _ = run_group(tmp_path, "finish", 3)
    assert codes == {0: 0, 1: 0, 2: 0}, logs
    assert not any("lost" in log for log in logs), logs
