"""Which step a killed run resumes from: file operations only (no megatron-core), so the
orchestrator and the launcher can ask too."""

from __future__ import annotations

from pathlib import Path

from megatron_rl.config import ResolvedConfig
from megatron_rl.trainer import atomic_dir


class CheckpointMismatch(RuntimeError):
    """The roles of a run have no checkpointed step in common."""


def complete_steps(directory: str | Path) -> list[int]:
    """The steps with a complete checkpoint under `directory` (partial ones excluded), sorted."""
    complete = atomic_dir.committed(Path(directory), "step_*", "meta.json")
    return sorted(int(name.removeprefix("step_")) for name in complete)


def run_resume_step(resolved: ResolvedConfig) -> int | None:
    """The training step the roles of a run resume from together: the policy's newest
    checkpointed step that the critic (when there is one with checkpoints) has checkpointed too;
    None while the policy has none (training starts afresh). The critic trains each step before
    the policy, so a killed run's critic is often one checkpoint ahead: it goes back and redoes
    that step with the same data (`checkpoint.keep_last` >= 2 keeps the common step). Steps
    below 0 (the critic's value pretraining) belong to the critic alone."""
    paths = resolved.layout.paths
    policy = {s for s in complete_steps(paths.policy_checkpoints) if s >= 0}
    if not policy:
        return None
    critic = {s for s in complete_steps(paths.critic_checkpoints) if s >= 0} if resolved.value is not None else set()
    if not critic:  # no critic, or one without training checkpoints (a policy trained alone)
        return max(policy)
    common = policy & critic
    if not common:
        raise CheckpointMismatch(
            f"{resolved.checkpoint.dir}: the policy has checkpoints of steps {sorted(policy)} and the critic of {sorted(critic)}, "
            "none in common: cannot resume them together (checkpoint.keep_last >= 2 keeps a common step)"
        )
    return max(common)
