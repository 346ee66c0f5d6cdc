"""Every listener of ours binds the configured host, never all interfaces: the ZMQ grid sender,
the critic's HTTP service and the weight-update group's TCPStore (torch's store listens on every
interface unless handed a bound socket). Read from /proc/net/tcp{,6} while each one listens."""

from __future__ import annotations

import socket
from pathlib import Path

from megatron_rl.critic.service import CriticState, ScoreQueue, ScoringService
from megatron_rl.transport import GridSender
from megatron_rl.transport.weight_buckets import WeightUpdateGroup


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listen_addresses(port: int) -> set[str]:
    """The local addresses in LISTEN state (0A) on `port`, as hex from /proc/net/tcp{,6}."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, hex_port = fields[1].split(":")
            if int(hex_port, 16) == port and fields[3] == "0A":
                found.add(address)
    return found


LOOPBACK = {"0100007F"}  # 127.0.0.1 in /proc/net/tcp's byte order


def test_grid_sender_critic_service_and_weight_store_listen_on_the_configured_host_only():
    port = free_port()
    with GridSender("127.0.0.1", port, data_parallel_size=1):
        assert listen_addresses(port) == LOOPBACK
    port = free_port()
    service = ScoringService("127.0.0.1", port, ScoreQueue(), CriticState({}), 100, 16, 4, 5.0)
    service.start()
    try:
        assert listen_addresses(port) == LOOPBACK
    finally:
        service.stop()
    port = free_port()
    group = WeightUpdateGroup("127.0.0.1", port, rank=0, world_size=1, backend="gloo", timeout_s=30)
    assert listen_addresses(port) == LOOPBACK
    del group
