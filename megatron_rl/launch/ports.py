"""Rendezvous port probing on the binding node.

`probe_ports(count, hosts, exclude)` returns `count` distinct ports that were free a moment ago
on **every** address in `hosts` (the target host address and loopback), none of them in
`exclude` (the configured broadcast, service, ZMQ and inference ports). A port is tested by
binding each address itself, never `0.0.0.0`, and candidates are drawn at random from a range
above the usual fixed ports, so two launches at the same moment do not pick the same ports
(torch's fixed 29500 collides between concurrent jobs). The range stops below the kernel's
ephemeral range (`probe_range`) where that leaves enough ports: the kernel hands ephemeral ports
out at any moment as the local ports of outgoing connections, and one taken between the probe
and the bind fails the bind (EADDRINUSE). All ports one node needs (policy and
critic rendezvous on a shared node) are chosen in one call, so they cannot collide with each
other. A port lost between probe and bind is the caller's to retry with a new probe
(`retry_on_address_in_use`).
"""

from __future__ import annotations

import argparse
import errno
import random
import socket
from collections.abc import Callable, Iterable

PORT_RANGE = (20000, 60000)
MIN_PROBE_PORTS = 8000  # below the ephemeral range when at least this many ports are left there


def probe_range(port_range: tuple[int, int] = PORT_RANGE) -> tuple[int, int]:
    """[low, high) to draw rendezvous ports from: `port_range` cut below the kernel's ephemeral
    range (/proc/sys/net/ipv4/ip_local_port_range; 32768 on Linux by default) when at least
    MIN_PROBE_PORTS remain, else `port_range` as it is."""
    low, high = port_range
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return low, high
    return (low, min(high, ephemeral_low)) if ephemeral_low - low >= MIN_PROBE_PORTS else (low, high)
ADDRESS_IN_USE_MARKERS = ("Address already in use", "EADDRINUSE", "errno: 98", "address already in use")


class PortProbeError(RuntimeError):
    pass


def free_on(host: str, port: int) -> bool:
    """Whether (host, port) can be bound now; PortProbeError when `host` is not an address of
    this machine."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            if exc.errno == errno.EADDRNOTAVAIL:
                raise PortProbeError(
                    f"cannot probe ports on {host}: the address is not on this machine"
                ) from None
            raise
    return True


def probe_ports(
    count: int,
    hosts: Iterable[str] = ("127.0.0.1",),
    exclude: Iterable[int] = (),
    rng: random.Random | None = None,
    attempts: int = 2000,
) -> list[int]:
    hosts = list(dict.fromkeys(hosts))  # target address and loopback, once each
    if "0.0.0.0" in hosts or "::" in hosts:
        raise PortProbeError(
            "ports are probed on the host's own address and loopback, never on all interfaces"
        )
    excluded = set(exclude)
    rng = rng or random.SystemRandom()
    draw_from = probe_range()
    chosen: list[int] = []
    for _ in range(attempts):
        if len(chosen) == count:
            return chosen
        port = rng.randrange(*draw_from)
        if port in excluded or port in chosen:
            continue
        if all(free_on(host, port) for host in hosts):
            chosen.append(port)
    if len(chosen) == count:
        return chosen
    raise PortProbeError(f"found only {len(chosen)} of {count} free ports on {hosts} in {attempts} tries")


def lost_port(log_text: str) -> bool:
    """Whether a component's log says its port was taken between probe and bind."""
    return any(marker in log_text for marker in ADDRESS_IN_USE_MARKERS)


def retry_on_address_in_use(start: Callable[[list[int]], object], probe: Callable[[], list[int]],
                            failed_with_lost_port: Callable[[object], bool], tries: int = 3):  # fmt: skip
    """`start(ports)` with freshly probed ports; again (new probe) while it fails because a port
    was taken in between, up to `tries` times."""
    for attempt in range(tries):
        result = start(probe())
        if not failed_with_lost_port(result) or attempt == tries - 1:
            return result
    raise AssertionError("unreachable")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="print free rendezvous ports (SLURM job steps use it)")
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--hosts", nargs="+", default=["127.0.0.1"])
    parser.add_argument("--exclude", nargs="*", type=int, default=[])
    args = parser.parse_args(argv)
    print(" ".join(str(p) for p in probe_ports(args.count, args.hosts, args.exclude)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
