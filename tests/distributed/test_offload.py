"""CPU offload (megatron's hybrid device optimizer on the precision-aware path) on gloo ranks,
with the hybrid optimizer's host copies emulated (tests/support/host_offload.py): no fp32
master of a 16-bit parameter is left on the model's device, every offloaded parameter's master
is a host copy that the host optimizer steps, and the weights after two steps are those of the same run
without offload, at offload fractions 1 and 0.5, for bf16 and float32 models."""

from __future__ import annotations

import pytest
import torch

from tests.support.ranks import DENSE
from tests.support.spawn import run_ranks

ARCH = DENSE.model_copy(update=dict(num_layers=2))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_offloaded_training_matches_no_offload_with_no_fp32_masters_on_the_device(dtype):
    runs = {
        fraction: run_ranks(offload_training, 2, ARCH, dtype, fraction)[0] for fraction in (None, 0.5, 1.0)
    }
    reference = runs[None]
    # Without offload the distributed optimizer keeps an fp32 master of each bf16 parameter
    # shard on the model's device (that is right there: the GPU holds the optimizer).
    assert reference["device_fp32_master_elements"] == reference["shard_16bit_elements"]
    assert (reference["shard_16bit_elements"] > 0) == (dtype == "bfloat16")
    for fraction in (0.5, 1.0):
        run = runs[fraction]
        # Before: megatron made these masters on the device under offload too (4 B per
        # parameter the plan did not count). (And building failed first: "can't optimize a
        # non-leaf Tensor" for the fp32 norm weights.)
        assert run["device_fp32_master_elements"] == 0
        # whole parameters, in order, until the fraction is reached
        assert fraction * run["shard_elements"] <= run["host_state_elements"] <= run["shard_elements"]
        assert (run["host_state_elements"] == run["shard_elements"]) == (fraction == 1.0)
        for name, value in reference["weights"].items():
            # float32: the host's fused AdamW rounds differently from the foreach one in the last bits
            tolerance = 0 if dtype == "bfloat16" else 1e-6
            torch.testing.assert_close(run["weights"][name], value, rtol=0, atol=tolerance, msg=name)
        assert run["losses"] == pytest.approx(reference["losses"], rel=1e-5)
        assert run["losses"][1] != run["losses"][0]


# Rank functions: module-level, so that the spawned ranks can import them.


def offload_training(rank, world_size, arch, dtype, fraction):
    """Two SAO steps at DP = world_size with optimizer.cpu_offload at `fraction` (None: off).
    Returns the losses, the full weights and where the optimizer's state lives."""
    from megatron.core import parallel_state

    from megatron_rl import parallel
    from megatron_rl.config import AlgorithmConfig, OptimizerConfig
    from megatron_rl.data.packing import pack_into_grid
    from megatron_rl.models.builder import build_gpt_model
    from megatron_rl.models.sharding import gather_full_parameters, load_full_state_dict
    from megatron_rl.policy.loss import policy_loss_func
    from megatron_rl.trainer.optimizer import build_trainable, hybrid_optimizers
    from megatron_rl.trainer.step import train_step
    from tests.support import host_offload
    from tests.support.ranks import reference_weights
    from tests.support.samples import training_samples

    host_offload.install()
    full = reference_weights(rank, world_size, arch, 5)
    parallel.initialize_model_parallel()
    model = build_gpt_model(arch, dtype=dtype)
    load_full_state_dict(model, full)
    config = OptimizerConfig(lr=1e-3, cpu_offload=fraction is not None, offload_fraction=fraction or 1.0)
    trainable = build_trainable(model, config, total_steps=4)
    loss_func = policy_loss_func(AlgorithmConfig(type="sao"))
    dp, data_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    losses = []
    for step in range(2):
        grid = pack_into_grid(training_samples(6, arch.vocab_size, seed=step), 64, dp)
        losses.append(train_step(trainable, grid[data_rank], loss_func)["loss"])
    distributed = getattr(trainable.optimizer, "chained_optimizers", None) or [trainable.optimizer]
    masters = sum(
        t.numel() for o in distributed for g in o.shard_fp32_from_float16_groups for t in g if t is not None
    )
    shards = sum(
        p.numel() for o in distributed for g in o.shard_float16_groups + o.shard_fp32_groups for p in g
    )
    shards_16bit = sum(p.numel() for o in distributed for g in o.shard_float16_groups for p in g)
    host = 0
    for hybrid in hybrid_optimizers(trainable.optimizer):
        for param, copy in hybrid.gpu_params_map_cpu_copy.items():
            # the host optimizer steps the host copy (its moments are made beside it, by torch)
            assert host_offload.is_host_copy(copy) and hybrid.state[param]["master_param"] is copy
            host += copy.numel()
    return {"losses": losses, "weights": gather_full_parameters(model), "device_fp32_master_elements": masters,
            "shard_elements": shards, "shard_16bit_elements": shards_16bit, "host_state_elements": host}  # fmt: skip
