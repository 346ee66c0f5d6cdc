"""What megatron receives for optimizer.cpu_offload: its hybrid device optimizer on the
precision-aware path (as Megatron-LM's argument check requires with CPU offload), with fp32
masters, moments and gradients; nothing of it without offload."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.config import Architecture, OptimizerConfig
from megatron_rl.models.builder import transformer_config
from megatron_rl.trainer.optimizer import megatron_optimizer_config

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
