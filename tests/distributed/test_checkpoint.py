"""Training checkpoints: resume in new processes reproduces an uninterrupted run exactly (also
with the optimizer offloaded); saves are atomic (an interrupted save never becomes current);
keep-last-N prunes; each rank saves and loads only its own optimizer shard (measured against
megatron's fully_reshardable format); a checkpoint refuses another TP layout by name; the
default CUDA generator is part of the RNG state."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from megatron_rl import parallel
from megatron_rl.models.builder import build_gpt_model
from megatron_rl.models.sharding import load_full_state_dict
from megatron_rl.trainer.checkpoint import OPTIMIZER_FORMAT, latest_checkpoint
from tests.support.ranks import DENSE, reference_weights
from tests.support.samples import training_samples
from tests.support.spawn import run_ranks

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


def test_resume_with_the_optimizer_offloaded_reproduces_the_uninterrupted_losses(weights, tmp_path):
    # megatron's hybrid device optimizer (its host copies emulated on CPU), DP=2, bf16
    options = (1, 2, True, "bfloat16")  # tp, keep_last, offload, dtype
    uninterrupted = run_ranks(
        resumable_training, 2, ARCH, weights, str(tmp_path / "a"), range(4), None, *options
    )[0]
    run_ranks(resumable_training, 2, ARCH, weights, str(tmp_path / "b"), range(2), 1, *options)
    resumed = run_ranks(
        resumable_training, 2, ARCH, weights, str(tmp_path / "b"), range(2, 4), None, *options
    )[0]
    assert resumed == {2: uninterrupted[2], 3: uninterrupted[3]}
    assert len(set(uninterrupted.values())) == 4


def test_each_rank_saves_and_loads_only_its_optimizer_shard(weights):
    """Bytes of optimizer state each rank holds for a save and for a load, at DP=2 (one rank's
    model is the whole model: its Adam state is 3 fp32 tensors per parameter, split over DP)."""
    figures = run_ranks(optimizer_checkpoint_bytes, 2, ARCH, weights)
    total = figures[0]["whole_state_bytes"]
    for rank in figures:
        # megatron's fully_reshardable (the format used before): the whole state on every rank
        assert rank["fully_reshardable"]["save"] >= total and rank["fully_reshardable"]["load"] >= total
        # the format written now: the rank's own shard (up to the distributed optimizer's padding)
        for kind in ("save", "load"):
            assert rank[OPTIMIZER_FORMAT][kind] <= 0.51 * total, (kind, rank)
    assert sum(rank[OPTIMIZER_FORMAT]["save"] for rank in figures) == pytest.approx(total, rel=0.01)


def test_a_checkpoint_refuses_another_tensor_parallel_layout_by_name(weights, tmp_path):
    run_ranks(resumable_training, 2, ARCH, weights, str(tmp_path), range(1), 0)  # TP=1, DP=2
    with pytest.raises(RuntimeError, match=r"written at tp 1, this run has tp 2; its optimizer state"):
        run_ranks(resumable_training, 2, ARCH, weights, str(tmp_path), range(1, 2), None, 2)


@pytest.mark.parametrize("saved_with, resumed_with", [("te", "local"), ("local", "te")])
def test_a_checkpoint_refuses_the_other_layer_spec_by_name(saved_with, resumed_with, tmp_path):
    """TransformerEngine and local specs name some weights differently and order their
    parameters differently (the optimizer state follows that order): resuming across them is
    refused, saying how to start from the weights instead (dense and MoE; TE's modules are
    tests/support/te_standins.py's on CPU)."""
    moe = ARCH.model_copy(update=dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32))
    for arch, name in ((ARCH, "dense"), (moe, "moe")):
        directory = str(tmp_path / name)
        run_ranks(spec_checkpoint, 1, arch, directory, saved_with, True)
        run_ranks(spec_checkpoint, 1, arch, directory, saved_with, False)  # the same spec resumes
        with pytest.raises(RuntimeError, match=r"written with the other layer spec .*set model.checkpoint"):
            run_ranks(spec_checkpoint, 1, arch, directory, resumed_with, False)


def test_the_default_cuda_generator_is_saved_and_restored(weights, tmp_path):
    before, after = run_ranks(cuda_generator_roundtrip, 1, ARCH, weights, str(tmp_path))[0]
    assert torch.equal(before, after)  # the draws after a load repeat the draws after the save


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


# Rank functions: module-level, so that the spawned ranks can import them.


def spec_checkpoint(rank, world_size, arch, directory, spec, save):
    """A `spec` ("te": megatron's TE spec with the CPU stand-ins, or "local") model's trainable:
    one step then checkpoint 0 (`save`), or a load of the latest."""
    from megatron_rl.config import AlgorithmConfig, OptimizerConfig
    from megatron_rl.data.packing import pack_into_grid
    from megatron_rl.policy.loss import policy_loss_func
    from megatron_rl.trainer.checkpoint import load_checkpoint, save_checkpoint
    from megatron_rl.trainer.optimizer import build_trainable
    from megatron_rl.trainer.step import train_step
    from tests.support.te_standins import build_te_style_model

    parallel.initialize_model_parallel()
    model = build_te_style_model(arch) if spec == "te" else build_gpt_model(arch, transformer_engine=False)
    trainable = build_trainable(model, OptimizerConfig(lr=1e-3), total_steps=4)
    if save:
        grid = pack_into_grid(training_samples(3, arch.vocab_size), 64, 1)
        train_step(trainable, grid[0], policy_loss_func(AlgorithmConfig(type="sao")))
        save_checkpoint(directory, 0, trainable)
    else:
        assert load_checkpoint(directory, trainable)["step"] == 0


def resumable_training(
    rank,
    world_size,
    arch,
    full,
    directory,
    steps,
    save_at=None,
    tp=1,
    keep_last=2,
    offload=False,
    dtype="float32",
):
    """Runs `steps` (a range) of SAO train_step on per-step samples; loads the latest checkpoint in
    `directory` first if there is one; saves after step `save_at`. `offload`: the optimizer on
    megatron's hybrid device optimizer (host copies emulated on CPU). Returns {step: loss}."""
    from megatron.core import parallel_state

    from megatron_rl.config import AlgorithmConfig, OptimizerConfig
    from megatron_rl.data.packing import pack_into_grid
    from megatron_rl.policy.loss import policy_loss_func
    from megatron_rl.trainer.checkpoint import load_checkpoint, save_checkpoint
    from megatron_rl.trainer.optimizer import build_trainable
    from megatron_rl.trainer.step import train_step
    from tests.support import host_offload

    if offload:
        host_offload.install()
    parallel.initialize_model_parallel(tp=tp)
    model = build_gpt_model(arch, tp=tp, dtype=dtype)
    load_full_state_dict(model, full)
    config = OptimizerConfig(lr=1e-3, warmup_steps=2, lr_decay_style="cosine", cpu_offload=offload)
    trainable = build_trainable(model, config, total_steps=8)
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


def _trained(arch, full):
    """A DP=world model after one SAO step (Adam state exists)."""
    from megatron.core import parallel_state

    from megatron_rl.config import AlgorithmConfig, OptimizerConfig
    from megatron_rl.data.packing import pack_into_grid
    from megatron_rl.policy.loss import policy_loss_func
    from megatron_rl.trainer.optimizer import build_trainable
    from megatron_rl.trainer.step import train_step

    parallel.initialize_model_parallel()
    model = build_gpt_model(arch)
    load_full_state_dict(model, full)
    trainable = build_trainable(model, OptimizerConfig(lr=1e-3), total_steps=4)
    dp = parallel_state.get_data_parallel_world_size()
    grid = pack_into_grid(training_samples(6, arch.vocab_size, seed=0), 64, dp)
    train_step(
        trainable,
        grid[parallel_state.get_data_parallel_rank()],
        policy_loss_func(AlgorithmConfig(type="sao")),
    )
    return model, trainable


def optimizer_checkpoint_bytes(rank, world_size, arch, full):
    """Per format: bytes of the optimizer tensors this rank hands dist_checkpointing to save, and
    allocates to load into; and the whole DP group's Adam state (3 fp32 tensors per parameter)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    model, trainable = _trained(arch, full)

    def tensor_bytes(state) -> int:
        tensors = {}  # distinct tensors (several entries may share one)
        for value in nested_values(state):
            if isinstance(value, (ShardedTensor, ShardedTensorFactory)):
                tensors[(value.data.data_ptr(), value.data.numel())] = value.data.nbytes
        return sum(tensors.values())

    figures = {"whole_state_bytes": 3 * 4 * sum(p.numel() for p in model.parameters())}
    for sharding in ("fully_reshardable", OPTIMIZER_FORMAT):
        metadata = {"distrib_optim_sharding_type": sharding}
        figures[sharding] = {
            kind: tensor_bytes(
                trainable.optimizer.sharded_state_dict(
                    model.sharded_state_dict(), is_loading=kind == "load", metadata=metadata
                )  # fmt: skip
            )
            for kind in ("save", "load")
        }
    return figures


def cuda_generator_roundtrip(rank, world_size, arch, full, directory):
    """With CUDA reported present and the CUDA generator standing in as its own generator: the
    draws after a save equal the draws after loading that checkpoint."""
    from megatron_rl.trainer import checkpoint

    _, trainable = _trained(arch, full)
    device_generator = torch.Generator().manual_seed(7)
    checkpoint._cuda_present = lambda: True
    torch.cuda.get_rng_state = lambda device="cuda": device_generator.get_state()
    torch.cuda.set_rng_state = lambda state, device="cuda": device_generator.set_state(state)
    checkpoint.save_checkpoint(directory, 0, trainable)
    before = torch.rand(8, generator=device_generator)
    checkpoint.load_checkpoint(directory, trainable)
    return before, torch.rand(8, generator=device_generator)
