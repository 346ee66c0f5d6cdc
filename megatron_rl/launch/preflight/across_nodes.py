"""The collectives check of one role across the nodes it spans: every rank of the role runs this
module under `megatron_rl.launch.torchrun` (the sbatch script of `megatron-rl preflight --slurm`
starts it on each of the role's nodes, as the job starts the role), builds megatron's groups of
the role's layout and runs `rank_checks.collectives_rank` on each group. Rank 0 prints one line,
`PASS|FAIL  collectives  ROLE across N nodes ...`, with each group's all-reduce bus bandwidth and
how many nodes it crosses (groups within one node judged against NVLink as on one host; groups
across nodes against `--network-gbytes-per-s`, the network's figure per GPU in GB/s, when
given, else printed and not judged). A rank whose check
fails prints its own FAIL line naming its rank and node; the exit status is 1 then.

    python -m megatron_rl.launch.torchrun --nnodes N --node_rank I --nproc_per_node G \\
        --master_addr ADDR --master_port PORT -m megatron_rl.launch.preflight.across_nodes \\
        {policy,critic,teacher} CONFIG [--set KEY=VALUE ...] [--network-gbytes-per-s GB_PER_S]
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

import megatron_rl.compat  # noqa: F401  (before megatron-core)

from megatron_rl.config import ConfigError, load_config
from megatron_rl.launch.preflight.base import Result
from megatron_rl.launch.preflight.flags import NETWORK_FLAG, add_network_flag
from megatron_rl.launch.preflight.rank_checks import PAYLOAD_BYTES, collectives_rank, describe_collectives
from megatron_rl.launch.preflight.registry import context_for, format_result

TIMEOUT_S = 120


def node_name() -> str:
    """The SLURM node this rank runs on (its hostname outside SLURM)."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def judged(cuda: bool, network_gbytes_per_s: float | None) -> str:
    if not cuda:
        return " (gloo: bandwidth not judged)"
    if network_gbytes_per_s is None:
        return f" (across nodes: not judged, no {NETWORK_FLAG})"
    return ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("role", choices=["policy", "critic", "teacher"])
    parser.add_argument("config")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    add_network_flag(parser, help="the inter-node network's nominal bandwidth per GPU, GB/s")
    args = parser.parse_args(argv)
    try:
        resolved = load_config(args.config, args.set)
    except ConfigError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    if args.role == "teacher":  # the Megatron teacher (distillation.teacher.megatron)
        teacher = resolved.layout.services.get("teacher")
        layout = teacher.megatron if teacher is not None else None
    else:
        layout = resolved.layout.policy if args.role == "policy" else resolved.layout.critic
    if layout is None:
        print(f"across_nodes: the config has no {args.role}", file=sys.stderr)
        return 2
    import torch.distributed as dist

    from megatron_rl import parallel
    from megatron_rl.launch.preflight.rank_checks import nominal_link_gbps

    context = context_for(resolved)
    parallel.initialize_distributed(timeout_s=TIMEOUT_S)
    rank, world = dist.get_rank(), dist.get_world_size()
    hosts: list[str] = [""] * world
    dist.all_gather_object(hosts, node_name())
    nodes = len(set(hosts))
    status, detail = "PASS", ""
    try:
        if world != layout.world_size:
            raise RuntimeError(f"started with {world} ranks, the {args.role}'s layout has {layout.world_size}")
        figures = collectives_rank(rank, world, layout.model_dump(), PAYLOAD_BYTES[context.backend])
        device, nominal = nominal_link_gbps() if context.cuda else ("cpu", None)
        network = args.network_gbytes_per_s if context.cuda else None
        line, problems = describe_collectives(args.role, world, figures, device, nominal, hosts, network)
        if problems:
            status, detail = "FAIL", "; ".join(problems)
        else:
            detail = f"{line} on {context.backend}" + judged(context.cuda, args.network_gbytes_per_s)
    except Exception as exc:  # noqa: BLE001  (this rank's FAIL line names it)
        status, detail = "FAIL", f"{args.role} rank {rank} on {hosts[rank]}: {type(exc).__name__}: {exc}"
    if rank == 0 or status == "FAIL":
        print(format_result(Result("collectives", status, f"across {nodes} node{'s' if nodes > 1 else ''}: {detail}")), flush=True)
    if status == "PASS":
        parallel.finished()
    parallel.destroy()
    return 0 if status == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
