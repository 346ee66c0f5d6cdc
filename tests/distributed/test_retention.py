"""Retention at small step counts, at the component level: a trainer that checkpoints every step
with `checkpoint.keep_last` K keeps exactly its newest K checkpoints, publishes weights (path (a),
`publish_hf_weights`, what `SafetensorsPublisher` calls: 2 versions kept) and critic snapshots
(`export_snapshot`, 2 kept) with no partial, stale or replaced directory left over; and a new
process resumed from the *oldest* kept checkpoint reproduces the uninterrupted run's later losses
exactly. The policy and the critic both checkpoint through `Role.save` (trainer/role.py), which
passes `checkpoint.keep_last` to the `save_checkpoint` tested here; the orchestrator's state is
one file (`checkpoint.dir/orchestrator/state.json`), replaced atomically, not versions."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from megatron_rl import parallel
from megatron_rl.models.builder import build_gpt_model
from megatron_rl.models.sharding import load_full_state_dict
from tests.support.ranks import DENSE, reference_weights
from tests.support.samples import training_samples
from tests.support.spawn import run_ranks

ARCH = DENSE.model_copy(update=dict(num_layers=1))
PUBLISHED_KEPT = 2  # publish_hf_weights's default keep_last (make_publisher keeps versions_kept(L), at least 2)
SNAPSHOTS_KEPT = 2  # export_snapshot's keep_last, as the policy trainer calls it


@pytest.fixture(scope="module")
def weights():
    return run_ranks(reference_weights, 1, ARCH, 5)[0]


def names(root: Path) -> list[str]:
    """Every entry of `root` but `latest`: committed names and any leftovers (.partial, .stale, .replaced)."""
    return sorted(p.name for p in root.iterdir() if p.name != "latest")


@pytest.mark.parametrize("num_steps, keep_last", [(5, 3), (3, 1)])
def test_exactly_keep_last_checkpoints_and_the_kept_versions_remain(weights, tmp_path, num_steps, keep_last):
    run_ranks(retained_training, 1, ARCH, weights, str(tmp_path), range(num_steps), keep_last)
    kept = range(num_steps - keep_last, num_steps)
    assert names(tmp_path / "checkpoints") == [f"step_{s:08d}" for s in kept]
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == f"step_{num_steps - 1:08d}"
    versions = range(
        num_steps + 1 - PUBLISHED_KEPT, num_steps + 1
    )  # version v is the weights after step v - 1
    assert names(tmp_path / "published") == [f"version_{v:08d}" for v in versions]
    assert (tmp_path / "published" / "latest").read_text().strip() == f"version_{num_steps:08d}"
    snapshots = range(num_steps + 1 - SNAPSHOTS_KEPT, num_steps + 1)
    assert names(tmp_path / "snapshots") == [f"version_{v:08d}" for v in snapshots]


def test_a_resume_from_the_oldest_kept_checkpoint_reproduces_the_later_losses(weights, tmp_path):
    num_steps, keep_last = 5, 3
    uninterrupted = run_ranks(
        retained_training, 1, ARCH, weights, str(tmp_path / "a"), range(num_steps), keep_last
    )[0]
    assert len(set(uninterrupted.values())) == num_steps  # the losses move
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    oldest = num_steps - keep_last
    resumed = run_ranks(
        retained_training,
        1,
        ARCH,
        weights,
        str(tmp_path / "b"),
        range(oldest + 1, num_steps),
        keep_last,
        oldest,
    )[0]
    assert resumed == {s: uninterrupted[s] for s in range(oldest + 1, num_steps)}
    # the redone steps replaced their old checkpoints: still exactly keep_last, none left over
    assert names(tmp_path / "b" / "checkpoints") == [f"step_{s:08d}" for s in range(oldest, num_steps)]


def test_resuming_from_a_pruned_step_names_it(weights, tmp_path):
    run_ranks(retained_training, 1, ARCH, weights, str(tmp_path), range(3), 1)
    with pytest.raises(RuntimeError, match=r"step_00000000: no complete checkpoint of step 0"):
        run_ranks(retained_training, 1, ARCH, weights, str(tmp_path), range(1, 3), 1, 0)


# Rank function: module-level, so that the spawned ranks can import it.


def retained_training(rank, world_size, arch, full, directory, steps, keep_last, resume_from=None):
    """Runs `steps` (a range) of SAO train_step on per-step samples, after loading checkpoint
    `resume_from` when given; after each step saves a checkpoint (keep `keep_last`), publishes
    version step + 1 and exports it as a snapshot, under `directory`/{checkpoints, published,
    snapshots}. Returns {step: loss}."""
    from megatron.core import parallel_state

    from megatron_rl.config import AlgorithmConfig, OptimizerConfig
    from megatron_rl.data.packing import pack_into_grid
    from megatron_rl.policy.loss import policy_loss_func
    from megatron_rl.policy.publish import publish_hf_weights
    from megatron_rl.trainer.checkpoint import load_checkpoint, save_checkpoint
    from megatron_rl.trainer.optimizer import build_trainable
    from megatron_rl.trainer.snapshot import export_snapshot
    from megatron_rl.trainer.step import train_step

    root = Path(directory)
    parallel.initialize_model_parallel()
    model = build_gpt_model(arch, dtype="float32")
    load_full_state_dict(model, full)
    trainable = build_trainable(
        model, OptimizerConfig(lr=1e-3, warmup_steps=1, lr_decay_style="cosine"), total_steps=8
    )
    if resume_from is not None:
        meta = load_checkpoint(root / "checkpoints", trainable, resume_from)
        assert meta["step"] == resume_from, meta
    loss_func = policy_loss_func(AlgorithmConfig(type="sao"))
    dp = parallel_state.get_data_parallel_world_size()
    losses = {}
    for step in steps:
        grid = pack_into_grid(training_samples(6, arch.vocab_size, seed=step), 64, dp)
        losses[step] = train_step(trainable, grid[parallel_state.get_data_parallel_rank()], loss_func)["loss"]
        save_checkpoint(root / "checkpoints", step, trainable, keep_last=keep_last)
        publish_hf_weights(model, arch, root / "published", step + 1)
        export_snapshot(model, root / "snapshots", step + 1)
    return losses
