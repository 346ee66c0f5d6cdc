"""megatron-core 0.16.1 on CPU with the gloo backend, and without TransformerEngine or Apex.

Import this module before megatron-core. `apply()` (run on import) installs the patches in
`patches.py` that this machine needs, each gated on its own condition (`select_patches`):

- no CUDA (CPU + gloo): CUDA devices, streams and RNG, device="cuda" factories, gloo's
  collectives (split sizes as lists, equal-size gathers), the quiet warnings;
- no TransformerEngine: the MoE router's `te_general_gemm` (undefined without TE);
- no TransformerEngine and no Apex: the distributed optimizer's torch-Adam `step` handling;
- always: sequence parallel with megatron's own WrappedTorchNorm, which the local layer spec
  uses on any machine (CPU, CP > 1, or no TE) and which refuses sequence parallel (MoE at TP > 1).

This is the only module in megatron_rl that knows about these differences.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from megatron_rl.compat import patches

import torch


@dataclass(frozen=True)
class Machine:
    """What this process can use."""

    cuda: bool
    transformer_engine: bool
    apex: bool


def detect() -> Machine:
    """This machine (packages by whether they can be found, without importing them)."""
    return Machine(
        cuda=torch.cuda.is_available(),
        transformer_engine=importlib.util.find_spec("transformer_engine") is not None,
        apex=importlib.util.find_spec("apex") is not None,
    )


# patch name -> the condition it is needed under.
PATCH_CONDITIONS = {
    "silence_cpu_warnings": lambda m: not m.cuda,
    "cuda_device_and_streams": lambda m: not m.cuda,
    "rng": lambda m: not m.cuda,
    "device_arguments": lambda m: not m.cuda,
    "te_general_gemm": lambda m: not m.transformer_engine,
    "all_to_all_split_sizes": lambda m: not m.cuda,  # gloo
    "torch_norm_sequence_parallel": lambda m: True,  # the local spec, on any machine
    "uneven_gather_scatter": lambda m: not m.cuda,  # gloo
    "distributed_optimizer_torch_adam": lambda m: not (m.transformer_engine or m.apex),
}
assert list(PATCH_CONDITIONS) == list(patches.PATCHES)

MACHINE: Machine = detect()
CPU_MODE: bool = not MACHINE.cuda


def select_patches(machine: Machine) -> list[str]:
    """The patches `machine` needs, in installation order."""
    return [name for name, needed in PATCH_CONDITIONS.items() if needed(machine)]


def apply() -> list[str]:
    """Installs this machine's patches once; returns their names."""
    patches.install(select_patches(MACHINE))
    return list(patches.installed)


def device() -> torch.device:
    """The device that model tensors live on for this process."""
    return torch.device("cpu") if CPU_MODE else torch.device("cuda", torch.cuda.current_device())


def distributed_backend() -> str:
    return "gloo" if CPU_MODE else "nccl"


apply()
