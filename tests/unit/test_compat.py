"""megatron_rl.compat on a machine without CUDA."""

from __future__ import annotations

import torch

from megatron_rl import compat


def test_cpu_mode_patches_cuda_entry_points():
    assert compat.CPU_MODE == (not torch.cuda.is_available())
    if not compat.CPU_MODE:
        return  # on a GPU machine compat changes nothing; tests/gpu covers that path
    assert compat.device() == torch.device("cpu") and compat.distributed_backend() == "gloo"
    assert torch.cuda.current_device() == torch.device("cpu")
    # device="cuda" in a factory lands on the CPU; pin_memory is dropped.
    x = torch.zeros(3, device="cuda", pin_memory=True)
    assert x.device.type == "cpu"
    assert x.cuda() is x
    # Type strings match megatron's comparisons with torch.cuda.FloatTensor.
    assert x.type() == "torch.cuda.FloatTensor" and x.bfloat16().type() == "torch.cuda.BFloat16Tensor"
    # The CUDA RNG API drives the CPU generator, so megatron's RNG tracker forks work.
    torch.cuda.manual_seed(5)
    state = torch.cuda.get_rng_state()
    first = torch.rand(4)
    torch.cuda.set_rng_state(state)
    torch.testing.assert_close(torch.rand(4), first)
    compat.apply()  # idempotent
    assert torch.cuda.current_device() == torch.device("cpu")
