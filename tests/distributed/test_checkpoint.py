"""Training checkpoints: resume in new processes reproduces an uninterrupted run exactly;
saves are atomic (an interrupted save never becomes current); keep-last-N prunes."""

from __future__ import annotations

import json
import shutil

import pytest

from megatron_rl import parallel
from megatron_rl.models.builder import build_gpt_model
from megatron_rl.models.sharding import load_full_state_dict
from megatron_rl.testing.ranks import DENSE, reference_weights
from megatron_rl.testing.samples import training_samples
from megatron_rl.testing.spawn import run_ranks
from megatron_rl.trainer.checkpoint import latest_checkpoint

ARCH = DENSE.model_copy(update=dict(num_layers=2))


@pytest.fixture(scope="module")
def weights():
    return run_ranks(reference_weights, 1, ARCH, 9)[0]


def test_resume_after_restart_reproduces_the_uninterrupted_losses(weights, tmp_path):
    # DP=2, distributed optimizer, warmup + cosine schedule: 4 steps straight through ...
    uninterrupted = run_ranks(resumable_training, 2, ARCH, weights, str(tmp_path / "a"), range(4))[0]
    # ... vs 2 steps, save, processes end; new processes load and run steps 2 and 3.
    run_ranks(resumable_training, 2, ARCH, weights, str(tmp_path / "b"), range(2), 1)
    assert latest_checkpoint(tmp_path / "b").name == "step_00000001"
    meta = json.loads((latest_checkpoint(tmp_path / "b") / "meta.json").read_text())
    assert meta["extra"] == {"policy_version": 1}
    resumed = run_ranks(resumable_training, 2, ARCH, weights, str(tmp_path / "b"), range(2, 4))[0]
    assert resumed == {2: uninterrupted[2], 3: uninterrupted[3]}
    assert len(set(uninterrupted.values())) == 4  # the losses really move


def test_interrupted_save_leaves_the_previous_checkpoint_current(weights, tmp_path):
    run_ranks(resumable_training, 1, ARCH, weights, str(tmp_path), range(2), 1)
    # A save of step 2 that died midway: a partial directory, `latest` untouched.
    partial = tmp_path / "step_00000002.partial"
    shutil.copytree(tmp_path / "step_00000001", partial)
    (partial / "meta.json").unlink()
    assert latest_checkpoint(tmp_path).name == "step_00000001"
    losses = run_ranks(resumable_training, 1, ARCH, weights, str(tmp_path), range(2, 3), 2)[0]
    assert set(losses) == {2}
    assert latest_checkpoint(tmp_path).name == "step_00000002" and not partial.exists()


def test_keep_last_prunes_old_checkpoints(weights, tmp_path):
    for step in range(3):
        run_ranks(resumable_training, 1, ARCH, weights, str(tmp_path), range(step, step + 1), step, 1, 2)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_00000001", "step_00000002"]


# Rank functions: module-level, so that the spawned ranks can import them.


def resumable_training(rank, world_size, arch, full, directory, steps, save_at=None, tp=1, keep_last=2):
    """Runs `steps` (a range) of SAO train_step on per-step samples; loads the latest checkpoint in
    `directory` first if there is one; saves after step `save_at`. Returns {step: loss}."""
    from megatron.core import parallel_state

    from megatron_rl.config import AlgorithmConfig, OptimizerConfig
    from megatron_rl.data.packing import pack_into_grid
    from megatron_rl.trainer.checkpoint import load_checkpoint, save_checkpoint
    from megatron_rl.trainer.optimizer import build_trainable
    from megatron_rl.trainer.step import policy_loss_func, train_step

    parallel.initialize_model_parallel(tp=tp)
    model = build_gpt_model(arch, tp=tp)
    load_full_state_dict(model, full)
    trainable = build_trainable(
        model, OptimizerConfig(lr=1e-3, warmup_steps=2, lr_decay_style="cosine"), total_steps=8
    )
    meta = load_checkpoint(directory, trainable)
    if meta is not None:
        assert meta["step"] == steps[0] - 1, (meta["step"], steps)
    loss_func = policy_loss_func(AlgorithmConfig(type="sao"))
    dp = parallel_state.get_data_parallel_world_size()
    losses = {}
    for step in steps:
        grid = pack_into_grid(training_samples(6, arch.vocab_size, seed=step), 64, dp)
        losses[step] = train_step(trainable, grid[parallel_state.get_data_parallel_rank()], loss_func)["loss"]
        if step == save_at:
            save_checkpoint(directory, step, trainable, extra={"policy_version": step}, keep_last=keep_last)
    return losses
