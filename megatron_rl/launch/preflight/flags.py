"""The inter-node network figure that `megatron-rl preflight --slurm` judges groups across nodes
against, and that the across-nodes module it starts takes: `--network-gbytes-per-s`, in gigabytes
per second per GPU (50 for one 400 Gb/s NIC per GPU). Its old name, `--network-gbps`, reads as
gigabits though it always meant gigabytes; it is still accepted, with a warning that says so."""

from __future__ import annotations

import argparse
import sys

NETWORK_FLAG = "--network-gbytes-per-s"
DEPRECATED_NETWORK_FLAG = "--network-gbps"


class _DeprecatedNetworkFlag(argparse.Action):
    """Stores the value as NETWORK_FLAG does and warns on stderr that the name is deprecated."""

    def __call__(self, parser, namespace, values, option_string=None):
        print(
            f"{parser.prog}: {option_string} is deprecated: it is read in gigabytes per second (GB/s), not "
            f"gigabits; give {NETWORK_FLAG} {values:g} for the same figure",
            file=sys.stderr,
        )
        setattr(namespace, self.dest, values)


def add_network_flag(parser: argparse.ArgumentParser, help: str) -> None:
    """NETWORK_FLAG (into `args.network_gbytes_per_s`, None when not given) and its deprecated alias."""
    parser.add_argument(NETWORK_FLAG, dest="network_gbytes_per_s", type=float, default=None, metavar="GB_PER_S",
                        help=help)  # fmt: skip
    parser.add_argument(DEPRECATED_NETWORK_FLAG, dest="network_gbytes_per_s", type=float, default=None,
                        metavar="GB_PER_S", action=_DeprecatedNetworkFlag,
                        help=f"deprecated name of {NETWORK_FLAG}, in the same unit (GB/s, not Gb/s)")  # fmt: skip


def network_args(gbytes_per_s: float | None) -> list[str]:
    """The arguments that pass `gbytes_per_s` on to the across-nodes check (none when not given)."""
    return [NETWORK_FLAG, f"{gbytes_per_s:g}"] if gbytes_per_s else []
