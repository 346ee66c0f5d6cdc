"""Components end with their launcher: a launcher killed with SIGKILL (no teardown) leaves no
component running, a torchrun group's ranks included (megatron_rl/lifetime.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from megatron_rl.lifetime import _SHIM, bound_to_parent

ROOT = Path(__file__).resolve().parents[2]


def alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):  # gone before the open, or between it and the read
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.2)
    return [p for p in pids if alive(p)]


def read_pids(path: Path, count: int, timeout_s: float = 60.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists():
            pids = [int(x) for x in path.read_text().split()]
            if len(pids) >= count:
                return pids
        time.sleep(0.2)
    raise AssertionError(f"{path}: fewer than {count} pids after {timeout_s} s")


# A launcher: the Supervisor of `megatron-rl run` over a plain component and a torchrun group of
# one rank; each process appends its pid to PIDS.
LAUNCHER = """
import sys, pathlib
from megatron_rl.launch.local import Component, Supervisor, TORCHRUN
pids, tmp = sys.argv[1], pathlib.Path(sys.argv[2])
record = f"import os, time; open({pids!r}, 'a').write(f'{{os.getpid()}} '); time.sleep(300)"
(tmp / "rank.py").write_text(record)
components = [
    Component("router", [sys.executable, "-c", record], tmp / "router.log"),
    Component("critic", [*TORCHRUN, "--nproc_per_node", "1", "--master_port", sys.argv[3], str(tmp / "rank.py")],
              tmp / "critic.log", torchrun=True),
]
Supervisor(components, grace_s=5).run("fake", 10)
"""


def test_a_launcher_killed_without_teardown_leaves_no_component_running(tmp_path):
    from megatron_rl.parallel import free_port

    pids_file = tmp_path / "pids"
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(pids_file), str(tmp_path), str(free_port())],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        component_pids = read_pids(pids_file, 2)  # the router's and the critic rank's
        agent = int(next(line for line in launcher.stdout if "started critic" in line).split("pid ")[1].split(",")[0])
        assert all(alive(p) for p in [*component_pids, agent])
        launcher.kill()  # SIGKILL: no teardown runs
        launcher.wait()
        assert wait_gone([*component_pids, agent], timeout_s=60) == []
    finally:
        for pid in read_pids(pids_file, 0):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_child_whose_starter_is_already_gone_does_not_start():
    # The shim ran after its starter died (a race with prctl): it refuses instead of orphaning.
    proc = subprocess.run([sys.executable, "-S", "-c", _SHIM, "1", "true"], capture_output=True, text=True)
    assert proc.returncode == 1 and "the starting process 1 is gone; not starting" in proc.stderr


def test_only_the_main_thread_binds_its_children():
    command = ["true"]
    assert bound_to_parent(command)[-1] == "true" and len(bound_to_parent(command)) > 1
    seen = []
    thread = threading.Thread(target=lambda: seen.append(bound_to_parent(command)))
    thread.start()
    thread.join()
    assert seen == [command]  # a thread's end would stop the child: not bound
