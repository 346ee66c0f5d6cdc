"""megatron's hybrid device optimizer (`optimizer.cpu_offload`) on a machine without CUDA, for
tests and the CPU run of tests/gpu.

The hybrid optimizer decides what it offloads by `param.is_cuda` alone
(`HybridDeviceOptimizer._get_sub_optimizer_param_groups`): on CPU no parameter is, so it offloads
nothing and its first step fails (a KeyError in `_set_sub_optimizer_grads`). `install()` makes
that one method see the parameters it is given as device tensors and the copies it makes with
`.cpu()` (and what it computes from them there: `.pin_memory()`, `.float()`) as host tensors.
Everything else of the hybrid optimizer runs as megatron wrote it: the host copies, the fp32
copies of 16-bit parameters, the host and device sub-optimizers, gradient copies to the host,
copy-back hooks, its state and load hooks. Only CUDA's separation of the two memories is missing:
the figures a test reads are which tensors are "host" copies (`is_host_copy`).
"""

from __future__ import annotations

import megatron_rl.compat  # noqa: F401  (megatron-core on CPU needs its patches first)

import torch
from megatron.core.optimizer.cpu_offloading import hybrid_optimizer
from torch.overrides import TorchFunctionMode

_HOST = "_megatron_rl_host_copy"
_installed = False


def is_host_copy(tensor: torch.Tensor) -> bool:
    """Whether the hybrid optimizer made `tensor` as a host copy (under `install()`)."""
    return bool(getattr(tensor, _HOST, False))


class _HostCopies(TorchFunctionMode):
    """`.cpu()` makes a host tensor; anything computed from a host tensor is one too;
    `.pin_memory()` keeps the tensor (no pinned memory without CUDA)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.pin_memory:
            return args[0]
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and (
            func is torch.Tensor.cpu or any(is_host_copy(a) for a in args if isinstance(a, torch.Tensor))
        ):
            setattr(out, _HOST, True)
        return out


def install() -> None:
    """Patches this process's HybridDeviceOptimizer as the module docstring says (CPU only)."""
    global _installed
    if _installed:
        return
    if torch.cuda.is_available():
        raise RuntimeError(
            "host_offload.install() emulates CUDA's devices on CPU; with CUDA use the real thing"
        )
    original = hybrid_optimizer.HybridDeviceOptimizer._get_sub_optimizer_param_groups

    def sort_parameters(self, offload_fraction):
        torch.Tensor.is_cuda = property(lambda tensor: not is_host_copy(tensor))
        try:
            with _HostCopies():
                return original(self, offload_fraction)
        finally:
            del torch.Tensor.is_cuda

    hybrid_optimizer.HybridDeviceOptimizer._get_sub_optimizer_param_groups = sort_parameters
    _installed = True
