"""Free TCP ports for single-machine services and rendezvous (`free_port`), shared by every
process of a user on the machine (no heavy imports: the router's launcher uses it too).

A port is drawn below the kernel's ephemeral range: a port the kernel hands out itself (bind to
0) can be given again at once as the local port of some outgoing connection (gloo, HTTP
clients), and the server that meant to bind it then fails with EADDRINUSE. 24000-29499 also
avoids the demo's fixed ports (18000-23999) and torch's 29500.

Between the draw and the server's bind (seconds: a vLLM server starts before its router binds
the router's port) another process could draw the same free port. So each draw is also reserved
across processes: a file named by the port, created exclusively in a directory of this user's
(`reservation_dir`), which other draws skip for RESERVATION_TTL_S; an older one is taken over
(its server has long bound the port, which the bind probe then sees, or is gone). Seen before the
reservation: two suite runs in a row each lost a test to a port another test's process had drawn.
"""

from __future__ import annotations

import os
import random
import socket
import tempfile
import time
from pathlib import Path

FREE_PORT_RANGE = (24000, 29499)
RESERVATION_TTL_S = 600.0
_handed_out: set[int] = set()


def reservation_dir() -> Path:
    """Where draws are reserved: MEGATRON_RL_PORT_DIR, else a directory of this user's in the
    temporary directory."""
    configured = os.environ.get("MEGATRON_RL_PORT_DIR")
    return Path(configured) if configured else Path(tempfile.gettempdir()) / f"megatron_rl_ports_{os.getuid()}"


def _reserve(port: int) -> bool:
    """True when this process now holds `port`'s reservation (created exclusively, or taken over
    from one older than RESERVATION_TTL_S)."""
    directory = reservation_dir()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / str(port)
    for _ in range(2):
        try:
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
            return True
        except FileExistsError:
            try:
                if time.time() - path.stat().st_mtime < RESERVATION_TTL_S:
                    return False
                path.unlink()
            except FileNotFoundError:
                pass
    return False


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on `host` a moment ago (for single-machine rendezvous), not one
    this process handed out before nor one another process drew in the last RESERVATION_TTL_S,
    outside the ephemeral range when the kernel's allows it."""
    low, high = FREE_PORT_RANGE
    try:
        ephemeral_low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    if ephemeral_low > high:
        draw = random.Random()  # seeded from the OS: processes draw differently
        for _ in range(256):
            port = draw.randint(low, high)
            if port in _handed_out or not _bindable(host, port) or not _reserve(port):
                continue
            _handed_out.add(port)
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
