"""`python -m megatron_rl.launch.torchrun ARGS`: torchrun, with its rendezvous store listening on
`--master_addr` only.

torchrun's static rendezvous (`--master_addr`/`--master_port`, what `megatron-rl run` and the
SLURM script use) has the agent of node 0 host a TCPStore, and torch's store server listens on
every interface (`*:PORT`) whatever address it is given: an unauthenticated key-value store
that every host of a shared cluster could reach. Handed a socket that is already bound and
listening, the store serves on that socket instead (the weight-update group does the same,
`megatron_rl.transport.weight_buckets.WeightUpdateGroup`).

This module takes torchrun's own command line unchanged and runs torchrun (`torch.distributed.run`)
with one difference: the static rendezvous is replaced by `BoundStaticRendezvous`, registered
under its own backend name (torch's registry refuses to replace "static"), which binds
(master_addr, master_port) itself on node 0. The ranks find the store as before (MASTER_ADDR,
MASTER_PORT, TORCHELASTIC_USE_AGENT_STORE) and connect to it as clients. A port taken between
probe and bind fails with "Address already in use", as torchrun's own bind does, so the
launcher's re-probe (`megatron_rl.launch.ports.lost_port`) still applies.
"""

from __future__ import annotations

import datetime
import inspect
import sys

import torch
from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry
from torch.distributed.run import parse_args, run

from megatron_rl.transport.weight_buckets import listening_socket

TESTED_TORCH = "2.13"  # the torch whose private rendezvous class this module was tested with
try:  # torch's private module: where it moved or changed, say so instead of a bare ImportError
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import (
        StaticTCPRendezvous,
        create_rdzv_handler,
    )
except ImportError as exc:
    raise ImportError(
        f"megatron_rl.launch.torchrun subclasses torch's private StaticTCPRendezvous "
        f"(torch.distributed.elastic.rendezvous.static_tcp_rendezvous), which torch {torch.__version__} does not "
        f"provide as expected ({exc}); it is written against torch {TESTED_TORCH}"
    ) from exc

BACKEND = "megatron-rl-static"
# What BoundStaticRendezvous relies on in torch's private class (tested with this torch).
RENDEZVOUS_PARAMETERS = ["master_addr", "master_port", "rank", "world_size", "run_id", "timeout"]


def check_rendezvous_api() -> str | None:
    """None when torch's StaticTCPRendezvous still has what BoundStaticRendezvous uses (its
    constructor's parameters, the attributes they set, `_store` unset until the first rendezvous,
    `next_rendezvous`), else what differs, naming the torch version."""
    problems = []
    parameters = list(inspect.signature(StaticTCPRendezvous.__init__).parameters)[1:]
    if parameters != RENDEZVOUS_PARAMETERS:
        problems.append(f"its constructor takes {parameters}, expected {RENDEZVOUS_PARAMETERS}")
    else:
        probe = StaticTCPRendezvous("127.0.0.1", 1, 0, 1, "probe", 1)  # sets attributes, connects nothing
        absent = [name for name in [*RENDEZVOUS_PARAMETERS, "_store"] if not hasattr(probe, name)]
        if absent:
            problems.append(f"it lacks the attributes {absent}")
        elif probe._store is not None or not isinstance(probe.timeout, datetime.timedelta):
            problems.append("its _store is set before the first rendezvous or its timeout is not a timedelta")
    if not callable(getattr(StaticTCPRendezvous, "next_rendezvous", None)):
        problems.append("it has no next_rendezvous")
    if not problems:
        return None
    return (f"torch {torch.__version__}: the private StaticTCPRendezvous that megatron_rl.launch.torchrun "
            f"subclasses changed ({'; '.join(problems)}); it is written against torch {TESTED_TORCH}")  # fmt: skip


class BoundStaticRendezvous(StaticTCPRendezvous):
    """torch's static rendezvous whose store, on node 0, serves on a socket bound to
    (master_addr, master_port) only."""

    def get_backend(self) -> str:
        return BACKEND

    def next_rendezvous(self):
        if self._store is None and self.rank == 0:
            self._listener = listening_socket(self.master_addr, self.master_port)
            self._store = TCPStore(
                self.master_addr, self.master_port, self.world_size, is_master=True, timeout=self.timeout,
                multi_tenant=True, master_listen_fd=self._listener.fileno(),
            )  # fmt: skip
        return super().next_rendezvous()


def create_bound_handler(params: RendezvousParameters) -> BoundStaticRendezvous:
    static = create_rdzv_handler(params)
    # torchrun hands the static backend its node rank as an int, --rdzv-conf values as strings
    return BoundStaticRendezvous(
        static.master_addr, static.master_port, int(static.rank), static.world_size, static.run_id,
        int(static.timeout.total_seconds()),
    )  # fmt: skip


def bound_args(argv: list[str]):
    """torchrun's parsed `argv`, its static rendezvous moved to BACKEND (same endpoint, node rank
    and timeout); other rendezvous backends are left as they are."""
    args = parse_args(argv)
    if args.rdzv_backend == "static" and not args.standalone:
        host = f"[{args.master_addr}]" if ":" in args.master_addr else args.master_addr  # IPv6
        port = args.master_port if args.master_port is not None else 29500  # torchrun's default
        endpoint = args.rdzv_endpoint or f"{host}:{port}"
        args.rdzv_backend, args.rdzv_endpoint = BACKEND, endpoint
        conf = f"rank={args.node_rank}"
        args.rdzv_conf = f"{args.rdzv_conf},{conf}" if args.rdzv_conf else conf
        args.node_rank = 0  # carried by rdzv_conf now (else torchrun warns that it ignores it)
    return args


def main(argv: list[str] | None = None) -> None:
    problem = check_rendezvous_api()
    if problem is not None:
        raise SystemExit(problem)
    rendezvous_handler_registry.register(BACKEND, create_bound_handler)
    run(bound_args(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()
