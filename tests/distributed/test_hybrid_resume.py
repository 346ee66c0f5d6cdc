"""The offloaded optimizer at fraction 0.5 saves and resumes through our checkpoint code (part of
issue 36): megatron's hybrid device optimizer with its host copies emulated on CPU
(tests/support/host_offload.py), DP = 2, bf16. Two runs: megatron's classes without TE (torch's
AdamW on both sides) and, as on a TE machine, two distinct classes (a FusedAdam stand-in,
tests/support/fused_adam.py, on the device side; torch's AdamW on the host), with megatron's
distributed optimizer on its TE code path. After the resume every state tensor belongs to the
sub-optimizer that steps its parameter and sits beside that parameter, and the next steps equal an
uninterrupted run's, losses and weights bit for bit."""

from __future__ import annotations

import pytest
import torch

from tests.support.ranks import DENSE, reference_weights
from tests.support.spawn import run_ranks

ARCH = DENSE.model_copy(update=dict(num_layers=2))


@pytest.fixture(scope="module")
def weights():
    return run_ranks(reference_weights, 1, ARCH, 9)[0]


@pytest.mark.parametrize("device_optimizer", ["torch_adamw", "fused_adam"])
def test_offload_at_half_resumes_with_each_state_beside_its_sub_optimizer(
    weights, tmp_path, device_optimizer
):
    uninterrupted = run_ranks(
        hybrid_training, 2, ARCH, weights, str(tmp_path / "a"), range(4), None, device_optimizer
    )[0]
    run_ranks(hybrid_training, 2, ARCH, weights, str(tmp_path / "b"), range(2), 1, device_optimizer)
    resumed = run_ranks(
        hybrid_training, 2, ARCH, weights, str(tmp_path / "b"), range(2, 4), None, device_optimizer
    )[0]
    assert resumed["losses"] == {2: uninterrupted["losses"][2], 3: uninterrupted["losses"][3]}
    assert len(set(uninterrupted["losses"].values())) == 4
    for name, value in uninterrupted["weights"].items():
        assert torch.equal(resumed["weights"][name], value), name
    # both halves were used: the fraction split the parameters between two sub-optimizer classes
    placement = resumed["placement_after_load"]
    assert placement == resumed["placement_at_end"] == uninterrupted["placement_at_end"]
    assert placement["host"] > 0 and placement["device"] > 0
    assert placement["device_class"] == ("FusedAdamStandIn" if device_optimizer == "fused_adam" else "AdamW")
    if device_optimizer == "fused_adam":  # FusedAdam counts per group: 4 steps, resumed or not
        assert set(resumed["device_group_steps"]) == set(uninterrupted["device_group_steps"]) == {4}


# Rank functions: module-level, so that the spawned ranks can import them.


def _placement(hybrid) -> dict:
    """Checks, for every sub-optimizer of `hybrid`, that it steps only host copies (the host
    optimizer) or only device tensors (the device one), that each parameter's state is the dict
    the hybrid optimizer shows for the original parameter, with `master_param` the stepped tensor
    and every other tensor of the parameter's shape on the parameter's device. Returns the counts
    of state tensors per side and the device sub-optimizer's class."""
    from tests.support import host_offload

    counts = {"host": 0, "device": 0, "device_class": None}
    for optimizer in hybrid.sub_optimizers:
        side = "device" if optimizer is hybrid.gpu_optimizer else "host"
        if side == "device":
            counts["device_class"] = type(optimizer).__name__
        for group in optimizer.param_groups:
            for param in group["params"]:
                assert host_offload.is_host_copy(param) == (side == "host"), (side, param.shape)
                state, original = optimizer.state[param], hybrid.inner_param_to_orig_param[param]
                assert hybrid.state[original] is state and state["master_param"] is param
                assert {"exp_avg", "exp_avg_sq"} <= set(state)
                for key, value in state.items():
                    if torch.is_tensor(value) and value.dim() > 0:
                        assert value.shape == param.shape and value.device == param.device, key
                        counts[side] += 1
    return counts


def hybrid_training(rank, world_size, arch, full, directory, steps, save_at, device_optimizer):
    """SAO steps (a range) with the optimizer offloaded at fraction 0.5; loads the latest
    checkpoint in `directory` first if there is one, saves after step `save_at`. Returns the
    losses, the full weights, the placement after the load (None without one) and at the end, and the device
    sub-optimizer's group step counts at the end."""
    from megatron.core import optimizer as megatron_optimizer
    from megatron.core import parallel_state
    from megatron.core.optimizer import distrib_optimizer

    from megatron_rl import parallel
    from megatron_rl.config import AlgorithmConfig, OptimizerConfig
    from megatron_rl.data.packing import pack_into_grid
    from megatron_rl.models.builder import build_gpt_model
    from megatron_rl.models.sharding import gather_full_parameters, load_full_state_dict
    from megatron_rl.policy.loss import policy_loss_func
    from megatron_rl.trainer.checkpoint import load_checkpoint, save_checkpoint
    from megatron_rl.trainer.optimizer import build_trainable, hybrid_optimizers
    from megatron_rl.trainer.step import train_step
    from tests.support import host_offload
    from tests.support.fused_adam import FusedAdamStandIn
    from tests.support.samples import training_samples

    host_offload.install()
    if device_optimizer == "fused_adam":  # megatron as on a TE machine: FusedAdam on the device side
        megatron_optimizer.Adam = FusedAdamStandIn
        distrib_optimizer.HAVE_APEX_OR_TE = distrib_optimizer.USING_TE_OPTIMIZER = True
    parallel.initialize_model_parallel()
    model = build_gpt_model(arch, dtype="bfloat16")
    load_full_state_dict(model, full)
    config = OptimizerConfig(
        lr=1e-3, warmup_steps=2, lr_decay_style="cosine", cpu_offload=True, offload_fraction=0.5
    )
    trainable = build_trainable(model, config, total_steps=8)
    meta = load_checkpoint(directory, trainable)
    assert (meta is None) == (steps[0] == 0)
    (hybrid,) = hybrid_optimizers(trainable.optimizer)
    placement = _placement(hybrid) if meta is not None else None  # a fresh optimizer has no state yet
    loss_func = policy_loss_func(AlgorithmConfig(type="sao"))
    dp = parallel_state.get_data_parallel_world_size()
    losses = {}
    for step in steps:
        grid = pack_into_grid(training_samples(6, arch.vocab_size, seed=step), 64, dp)
        losses[step] = train_step(trainable, grid[parallel_state.get_data_parallel_rank()], loss_func)["loss"]
        if step == save_at:
            save_checkpoint(directory, step, trainable, extra={}, keep_last=2)
    placement_at_end = _placement(hybrid)
    device = hybrid.gpu_optimizer
    return {
        "losses": losses,
        "weights": gather_full_parameters(model),
        "placement_after_load": placement,
        "placement_at_end": placement_at_end,
        "device_group_steps": [g.get("step") for g in device.param_groups] if device is not None else [],
    }
