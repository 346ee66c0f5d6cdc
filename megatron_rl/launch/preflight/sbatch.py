"""`megatron-rl preflight CONFIG --slurm`: an sbatch script that runs preflight on every node of
the config's allocation (the nodes and GPUs per node `megatron-rl slurm` asks for), one task a
node, each node's lines prefixed with its name by srun; the job fails when a node's preflight does."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from megatron_rl.config import ResolvedConfig
from megatron_rl.launch.local import training_env
from megatron_rl.launch.slurm import place, srun_export

SCRIPT = """#!/bin/bash
# Rendered by `megatron-rl preflight --slurm` (megatron_rl/launch/preflight/sbatch.py).
#SBATCH --job-name=megatron-rl-preflight
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node={gpus_per_node}
#SBATCH --output={log_dir}/preflight-%j.out
{options}set -euo pipefail

# Every node checks itself (versions, TE, ports, memory, collectives and the layer step on its GPUs).
srun --nodes={nodes} --ntasks-per-node=1 --gpus-per-node={gpus_per_node} --kill-on-bad-exit=0 --label \\
  --export={export} \\
  {python} -m megatron_rl.launch.cli preflight {config}{sets}
"""


def render(resolved: ResolvedConfig, config_path: Path, overrides: list[str], partition: str | None = None,
           time_limit: str | None = None, python: str | None = None) -> str:  # fmt: skip
    place(resolved)  # the layout must fit the allocation, as for the job itself (SlurmError otherwise)
    options = "".join(f"#SBATCH --{key}={value}\n" for key, value in (("partition", partition), ("time", time_limit))
                      if value)  # fmt: skip
    return SCRIPT.format(
        nodes=resolved.deployment.nodes,
        gpus_per_node=resolved.deployment.gpus_per_node,
        log_dir=(Path(resolved.logging.dir) / "logs").resolve(),
        options=options,
        export=shlex.quote(srun_export(training_env(resolved, "policy"))),
        python=shlex.quote(python or sys.executable),
        config=shlex.quote(str(config_path.resolve())),
        sets="".join(f" --set {shlex.quote(s)}" for s in overrides),
    )
