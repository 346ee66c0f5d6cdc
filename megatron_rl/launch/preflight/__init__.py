"""`megatron-rl preflight CONFIG`: checks of an allocation before a long job, in minutes.

Each check (`REGISTRY`, registry.py) prints one line, `PASS|FAIL|NOT RUN  name  figures or
reason`; any FAIL makes the exit status 1. A check runs on the configured backend: NCCL with
CUDA, its gloo twin on the CPU (`--cpu`, or a machine without CUDA), so that every check runs
in the CPU tests. tests/gpu/checks.py takes the same entries into the GPU script's table.

    host_checks.py   versions against their declared ranges, TE's torch extension, ports, memory
    services.py      a teacher and a judge: reachable (the user's) or loadable (the run's), the tokenizer
    rank_checks.py   collectives over every group of each role's layout, one forward/backward of
                     the configured layer spec, a weight update into one vLLM server (spawned ranks)
    sbatch.py        the sbatch script that runs preflight on every node of the config's allocation
"""

from megatron_rl.launch.preflight.registry import (
    REGISTRY,
    Check,
    CheckFailed,
    Context,
    NotRun,
    Result,
    context_for,
    format_result,
    run_checks,
)

__all__ = [
    "REGISTRY", "Check", "CheckFailed", "Context", "NotRun", "Result", "context_for", "format_result", "run_checks",
]  # fmt: skip
