"""`megatron-rl preflight CONFIG --slurm`: an sbatch script (templates/preflight.sbatch.j2) for
the config's allocation (the nodes and GPUs per node `megatron-rl slurm` asks for), in two parts:

1. every node runs preflight on itself, one task a node (its lines prefixed by srun's task
   number), with its own GPUs: a role whose ranks do not fit on one node reports its collectives
   NOT RUN there;
2. each role that spans nodes (where `megatron-rl slurm` places it) runs its collectives across
   those nodes: `megatron_rl.launch.torchrun` on each of them with the GPUs the role has there,
   the rendezvous on its first node's address at a probed port, every rank in
   `preflight/across_nodes.py`, which prints one PASS or FAIL line.

Every part runs; the job exits 1 naming the parts that failed."""

from __future__ import annotations

import sys
from pathlib import Path

from megatron_rl.config import ResolvedConfig
from megatron_rl.launch.local import training_env
from megatron_rl.launch.preflight.flags import network_args
from megatron_rl.launch.slurm import StepPlacement, fixed_ports, place, srun_export, template


def spanning_roles(resolved: ResolvedConfig) -> list[StepPlacement]:
    """The training roles placed on more than one node."""
    placement = place(resolved)  # the layout must fit the allocation, as for the job itself (SlurmError)
    return [placement[role] for role in ("policy", "critic", "teacher") if role in placement and len(placement[role].nodes) > 1]


def render(resolved: ResolvedConfig, config_path: Path, overrides: list[str], partition: str | None = None,
           time_limit: str | None = None, python: str | None = None, only: list[str] | None = None,
           network_gbytes_per_s: float | None = None) -> str:  # fmt: skip
    """`only`: the checks to run (default all); part 2 runs when collectives is among them, and
    judges groups across nodes against `network_gbytes_per_s` (GB/s per GPU) when given."""
    spanning = spanning_roles(resolved) if only is None or "collectives" in only else []
    return template("preflight.sbatch.j2").render(
        nodes=resolved.deployment.nodes,
        gpus_per_node=resolved.deployment.gpus_per_node,
        log_dir=(Path(resolved.logging.dir) / "logs").resolve(),
        partition=partition,
        time_limit=time_limit,
        python=python or sys.executable,
        config=str(config_path.resolve()),
        sets=[a for s in overrides for a in ("--set", s)],
        only=["--only", *only] if only else [],
        export=srun_export(training_env(resolved, "policy")),
        spanning=[{"name": role.name, "nodes": role.nodes, "gpus_per_node": role.gpus_per_node,
                   "export": srun_export(training_env(resolved, role.name))} for role in spanning],  # fmt: skip
        fixed_ports=fixed_ports(resolved.layout),
        network=network_args(network_gbytes_per_s),
    )
