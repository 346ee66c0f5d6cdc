"""Watching a whole run from outside, for the end-to-end tests of a launcher (`megatron-rl run`,
`bash launch/demo.sh`): every TCP listener of its process tree while it runs, and the checks that
none listens on all interfaces and that ours listen on 127.0.0.1 only."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import psutil

WILDCARDS = {"0.0.0.0", "::"}


def listening(root: psutil.Process) -> set[tuple[str, int, str]]:
    """(address, port, process name) of every TCP socket in LISTEN state held by `root` or any of
    its descendants."""
    found = set()
    try:
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return found
    for process in processes:
        try:
            name = process.name()
            for connection in process.net_connections(kind="inet"):
                if connection.status == psutil.CONN_LISTEN:
                    found.add((connection.laddr.ip, connection.laddr.port, name))
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def run_watched(argv: list[str], cwd: Path, output: Path, timeout_s: float) -> tuple[int, str, set]:
    """Runs `argv` (its output to the file `output`), reading its process tree's listeners every
    0.3 s until it exits: (exit code, output, listeners seen)."""
    with open(output, "w") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, text=True, cwd=cwd)
    seen: set[tuple[str, int, str]] = set()
    root, deadline = psutil.Process(process.pid), time.monotonic() + timeout_s
    while process.poll() is None and time.monotonic() < deadline:
        seen |= listening(root)
        time.sleep(0.3)
    if process.poll() is None:
        process.kill()
    process.wait()
    return process.returncode, output.read_text(), seen


def assert_local_listeners(seen: set, configured: set[int], torchrun_groups: int, routers: int = 1) -> None:
    """No listener on all interfaces; the `configured` ports, torchrun's rendezvous stores (one a
    group) and each of the `routers` vllm-routers' HTTP and metrics ports listen on 127.0.0.1 only."""
    wildcard = sorted(s for s in seen if s[0] in WILDCARDS)
    assert wildcard == [], f"listening on all interfaces: {wildcard}"
    addresses: dict[int, set[str]] = {}
    for address, port, _ in seen:
        addresses.setdefault(port, set()).add(address)
    rendezvous = {port for _, port, name in seen if name == "pt_elastic"}  # torchrun's agents
    router = {port for _, port, name in seen if name == "vllm::router"}  # its HTTP and metrics ports
    assert len(rendezvous) == torchrun_groups and len(router) == 2 * routers, sorted(seen)
    assert configured <= set(addresses), (configured - set(addresses), sorted(seen))
    for port in configured | rendezvous | router:
        assert addresses.get(port) == {"127.0.0.1"}, (port, sorted(seen))


def stray_processes(marker: Path) -> list[str]:
    """The pids of processes whose command line names `marker` (a run's directory)."""
    return subprocess.run(["pgrep", "-f", str(marker)], capture_output=True, text=True).stdout.split()
