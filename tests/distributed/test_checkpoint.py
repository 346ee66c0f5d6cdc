"""Training checkpoints: resume in new processes reproduces an uninterrupted run exactly;
saves are atomic (an interrupted save never becomes current); keep-last-N prunes."""

from __future__ import annotations

import json
import shutil

import pytest

from megatron_rl.testing.spawn import run_ranks
from megatron_rl.trainer.checkpoint import latest_checkpoint
from tests.distributed import megatron_workers as w

ARCH = w.DENSE.model_copy(update=dict(num_layers=2))


@pytest.fixture(scope="module")
def weights():
    return run_ranks(w.reference_weights, 1, ARCH, 9)[0]


def test_resume_after_restart_reproduces_the_uninterrupted_losses(weights, tmp_path):
    # DP=2, distributed optimizer, warmup + cosine schedule: 4 steps straight through ...
    uninterrupted = run_ranks(w.resumable_training, 2, ARCH, weights, str(tmp_path / "a"), range(4))[0]
    # ... vs 2 steps, save, processes end; new processes load and run steps 2 and 3.
    run_ranks(w.resumable_training, 2, ARCH, weights, str(tmp_path / "b"), range(2), 1)
    assert latest_checkpoint(tmp_path / "b").name == "step_00000001"
    meta = json.loads((latest_checkpoint(tmp_path / "b") / "meta.json").read_text())
    assert meta["extra"] == {"policy_version": 1}
    resumed = run_ranks(w.resumable_training, 2, ARCH, weights, str(tmp_path / "b"), range(2, 4))[0]
    assert resumed == {2: uninterrupted[2], 3: uninterrupted[3]}
    assert len(set(uninterrupted.values())) == 4  # the losses really move


def test_interrupted_save_leaves_the_previous_checkpoint_current(weights, tmp_path):
    run_ranks(w.resumable_training, 1, ARCH, weights, str(tmp_path), range(2), 1)
    # A save of step 2 that died midway: a partial directory, `latest` untouched.
    partial = tmp_path / "step_00000002.partial"
    shutil.copytree(tmp_path / "step_00000001", partial)
    (partial / "meta.json").unlink()
    assert latest_checkpoint(tmp_path).name == "step_00000001"
    losses = run_ranks(w.resumable_training, 1, ARCH, weights, str(tmp_path), range(2, 3), 2)[0]
    assert set(losses) == {2}
    assert latest_checkpoint(tmp_path).name == "step_00000002" and not partial.exists()


def test_keep_last_prunes_old_checkpoints(weights, tmp_path):
    for step in range(3):
        run_ranks(w.resumable_training, 1, ARCH, weights, str(tmp_path), range(step, step + 1), step, 1, 2)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_00000001", "step_00000002"]
