"""The step a killed run's roles resume from together (trainer/checkpoint.run_resume_step)."""

from __future__ import annotations

import pytest

from megatron_rl.orchestrator.run import trainer_resume_step
from megatron_rl.trainer.resume import CheckpointMismatch, complete_steps, run_resume_step
from tests.support.orchestrator import orchestrator_config


def checkpoint(root, role, step, complete=True):
    path = root / role / f"step_{step:08d}"
    path.mkdir(parents=True)
    if complete:
        (path / "meta.json").write_text("{}")


def test_roles_resume_from_the_newest_step_both_checkpointed(tmp_path):
    resolved = orchestrator_config("sao", checkpoint_dir=str(tmp_path))
    assert run_resume_step(resolved) is None and trainer_resume_step(resolved) == 0
    checkpoint(tmp_path, "critic", -1)  # value pretraining: the critic's own
    checkpoint(tmp_path, "critic", 0)  # the critic checkpointed step 0, the policy not yet
    assert run_resume_step(resolved) is None  # training starts afresh
    checkpoint(tmp_path, "policy", 0)
    checkpoint(tmp_path, "policy", 1)
    checkpoint(tmp_path, "critic", 1)
    checkpoint(tmp_path, "critic", 2)  # killed after the critic's step 2, before the policy's
    checkpoint(tmp_path, "policy", 2, complete=False)  # half-written: not a checkpoint
    assert complete_steps(tmp_path / "critic") == [-1, 0, 1, 2] and complete_steps(tmp_path / "policy") == [
        0,
        1,
    ]
    assert run_resume_step(resolved) == 1 and trainer_resume_step(resolved) == 2


def test_a_policy_alone_resumes_from_its_latest_and_no_common_step_is_an_error(tmp_path):
    grpo = orchestrator_config("grpo", checkpoint_dir=str(tmp_path))
    checkpoint(tmp_path, "policy", 3)
    checkpoint(tmp_path, "critic", 9)  # ignored: no critic in a GRPO run
    assert run_resume_step(grpo) == 3
    sao = orchestrator_config("sao", checkpoint_dir=str(tmp_path))
    with pytest.raises(
        CheckpointMismatch, match=r"policy has checkpoints of steps \[3\] and the critic of \[9\]"
    ):
        run_resume_step(sao)
