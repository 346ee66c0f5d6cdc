"""What megatron receives for optimizer.cpu_offload: its hybrid device optimizer on the
precision-aware path (as Megatron-LM's argument check requires with CPU offload), with fp32
masters, moments and gradients; nothing of it without offload."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_rl.config import Architecture, OptimizerConfig, load_config
from megatron_rl.models.builder import transformer_config
from megatron_rl.trainer.optimizer import megatron_optimizer_config

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "configs"

ARCH = Architecture(family="qwen3", hidden_size=64, num_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=16, intermediate_size=96, vocab_size=128)  # fmt: skip


@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_cpu_offload_reaches_megatron_on_the_precision_aware_path(fraction):
    config = transformer_config(ARCH, dtype="bfloat16")
    megatron = megatron_optimizer_config(OptimizerConfig(cpu_offload=True, offload_fraction=fraction), config)
    assert megatron.optimizer_cpu_offload and megatron.optimizer_offload_fraction == fraction
    # Before: False, so megatron's distributed optimizer made fp32 masters on the GPU.
    assert megatron.use_precision_aware_optimizer
    assert megatron.use_precision_aware_optimizer_no_fp8_or_ds_fp8  # what megatron's code branches on
    dtypes = (
        megatron.main_params_dtype,
        megatron.main_grads_dtype,
        megatron.exp_avg_dtype,
        megatron.exp_avg_sq_dtype,
    )
    assert dtypes == (torch.float32,) * 4
    assert megatron.use_distributed_optimizer and megatron.bf16


def test_without_offload_megatron_keeps_its_default_path():
    megatron = megatron_optimizer_config(OptimizerConfig(), transformer_config(ARCH, dtype="bfloat16"))
    assert not megatron.optimizer_cpu_offload and megatron.optimizer_offload_fraction == 0.0
    assert (
        not megatron.use_precision_aware_optimizer
        and not megatron.use_precision_aware_optimizer_no_fp8_or_ds_fp8
    )


def test_offload_without_the_distributed_optimizer_is_refused_naming_the_keys():
    with pytest.raises(
        ValueError, match="optimizer.cpu_offload: needs optimizer.distributed_optimizer: true"
    ):
        megatron_optimizer_config(
            OptimizerConfig(cpu_offload=True, distributed_optimizer=False), transformer_config(ARCH)
        )


def test_the_offloaded_step_gets_the_cores_of_its_node_shared_among_training_ranks():
    """torchrun starts every rank with OMP_NUM_THREADS=1, which left the host's Adam step of a
    30B model on one core (second GPU reading, defect 6): the trainer sets torch's threads to the
    rank's share of the node's cores, or to optimizer.cpu_threads."""
    from megatron_rl.trainer.optimizer import offload_threads, training_ranks_per_node

    sao = load_config(EXAMPLES / "qwen3_30b_a3b_sao.yaml")  # a shared critic on the policy's nodes
    assert sao.layout.deployment_style == "shared"
    per_node = training_ranks_per_node(sao, "policy")
    d = sao.deployment
    assert per_node == training_ranks_per_node(sao, "critic") == min(d.policy_gpus, d.gpus_per_node - d.num_value_gpus_per_train_node) + d.num_value_gpus_per_train_node
    assert offload_threads(sao, "policy", sao.optimizer, cores=96) == 96 // per_node
    assert offload_threads(sao, "policy", sao.optimizer.model_copy(update={"cpu_threads": 5}), cores=96) == 5
    assert offload_threads(sao, "policy", sao.optimizer.model_copy(update={"cpu_offload": False}), cores=96) is None
    assert offload_threads(sao, "policy", sao.optimizer, cores=2) == 1  # never 0
    tiny = load_config(EXAMPLES / "tiny_cpu_sao.yaml")  # the CPU device keeps one thread a process
    assert offload_threads(tiny, "policy", tiny.optimizer.model_copy(update={"cpu_offload": True}), cores=96) is None


def test_loaded_optimizer_state_goes_to_the_device_of_the_parameters_its_sub_optimizer_steps():
    """Offload at a fraction below 1 without TE: the device and host sub-optimizers are both
    torch's Adam, and megatron's `_move_new_state_to_right_device` (by `isinstance` of the host
    class) sent the device half's moments to the host on load (second GPU reading, defect 4).
    Two sub-optimizers of one class stand in, one over a host parameter, one over a parameter on
    another device (`meta`): after a load each moment is beside its parameter, scalars stay."""
    import types

    from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

    from megatron_rl.trainer.optimizer import _state_beside_its_parameters

    host, device = torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(4, device="meta"))
    hybrid = types.SimpleNamespace(
        sub_optimizers=[torch.optim.AdamW([host]), torch.optim.AdamW([device])],
        inner_param_to_orig_param={}, defaults={"cpu_optimizer_cls": torch.optim.AdamW}, state={},
    )  # fmt: skip

    def loaded():  # what a load leaves: every tensor on the host, `step` a host scalar
        for optimizer in hybrid.sub_optimizers:
            for param in optimizer.param_groups[0]["params"]:
                optimizer.state[param] = {"step": torch.tensor(3.0), "exp_avg": torch.ones(4), "exp_avg_sq": torch.ones(4)}
                hybrid.state[param] = dict(optimizer.state[param])

    loaded()
    HybridDeviceOptimizer._move_new_state_to_right_device(hybrid)  # megatron's: the defect
    assert hybrid.sub_optimizers[1].state[device]["exp_avg"].device.type == "cpu"
    loaded()
    _state_beside_its_parameters(hybrid)
    for optimizer, param in zip(hybrid.sub_optimizers, (host, device)):
        state = optimizer.state[param]
        assert state["exp_avg"].device == state["exp_avg_sq"].device == param.device
        assert hybrid.state[param]["exp_avg"].device == param.device
        assert state["step"].device.type == "cpu"
