"""megatron-core 0.16.1 on CPU with the gloo backend.

Import this module before megatron-core. With CUDA present it does nothing. Without CUDA,
`apply()` (run on import) installs the patches below, each with the reason it is needed. This
is the only module in megatron_rl that knows about the CPU/GPU difference.
"""

from __future__ import annotations

from megatron_rl.compat import patches

import torch

CPU_MODE: bool = not torch.cuda.is_available()


def apply() -> bool:
    """Installs the CPU patches once; returns True when running in CPU mode."""
    if CPU_MODE:
        patches.install()
    return CPU_MODE


def device() -> torch.device:
    """The device that model tensors live on for this process."""
    return torch.device("cpu") if CPU_MODE else torch.device("cuda", torch.cuda.current_device())


def distributed_backend() -> str:
    return "gloo" if CPU_MODE else "nccl"


apply()
