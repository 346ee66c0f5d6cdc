"""megatron-core 0.16.1 on CPU with the gloo backend, and without TransformerEngine or Apex.

Import this module before megatron-core. `apply()` (run on import) installs the patches in
`patches.py` that this machine needs, each gated on its own condition (`select_patches`):

- no CUDA (CPU + gloo): CUDA devices, streams and RNG, device="cuda" factories, gloo's
  collectives (split sizes as lists, equal-size gathers), the quiet warnings;
- no TransformerEngine (not installed, or its torch extension does not import: then it is not
  used, and why is logged): the MoE router's `te_general_gemm` (undefined without TE);
- no TransformerEngine and no Apex: the distributed optimizer's torch-Adam `step` handling;
- always: sequence parallel with megatron's own WrappedTorchNorm, which the local layer spec
  uses on any machine (CPU, CP > 1, or no TE) and which refuses sequence parallel (MoE at TP > 1);
  and a megatron-core bug, not a CPU difference: multi-latent attention at TP > 1 (the local spec,
  or TE's without sequence parallel) does not sum its shared RoPE key's gradient over TP
  (NVIDIA/Megatron-LM issue #1699, unfixed in core 0.19).

This is the only module in megatron_rl that knows about these differences.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
from dataclasses import dataclass


def _transformer_engine() -> tuple[bool, str]:
    """(usable, why not): TE counts only when `transformer_engine.pytorch` imports, which loads
    its compiled torch extension. A TE built against another torch, or whose extension is missing,
    imports at the top level but fails there; the local layer spec and the patches for a machine
    without TE are then used, and the reason is kept (MACHINE.transformer_engine_error) and logged."""
    if importlib.util.find_spec("transformer_engine") is None:
        return False, ""
    try:
        importlib.import_module("transformer_engine.pytorch")
    except Exception as exc:  # ImportError, OSError (a .so), RuntimeError (a CUDA mismatch)
        # megatron-core guards its TE imports with `except ModuleNotFoundError` only: another
        # ImportError would stop `import megatron.core` itself. Hide the broken package so that
        # every later import of it is a ModuleNotFoundError, as on a machine without TE.
        for name in [n for n in sys.modules if n == "transformer_engine" or n.startswith("transformer_engine.")]:
            del sys.modules[name]
        sys.modules["transformer_engine"] = None
        return False, f"transformer_engine is installed but transformer_engine.pytorch does not import: {type(exc).__name__}: {exc}"
    return True, ""


# Before megatron-core is imported (by the patches below): it must not see a broken TE.
_TE_USABLE, _TE_ERROR = _transformer_engine()

from megatron_rl.compat import patches  # noqa: E402  (after the TE probe)

import torch  # noqa: E402


@dataclass(frozen=True)
class Machine:
    """What this process can use."""

    cuda: bool
    transformer_engine: bool
    apex: bool
    # Why an installed TransformerEngine is not used (its torch extension did not import), or "".
    transformer_engine_error: str = ""


def detect() -> Machine:
    """This machine: CUDA, TransformerEngine when its torch extension imports, Apex when found."""
    return Machine(
        cuda=torch.cuda.is_available(),
        transformer_engine=_TE_USABLE,
        apex=importlib.util.find_spec("apex") is not None,
        transformer_engine_error=_TE_ERROR,
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
    "latent_attention_shared_rope_grad": lambda m: True,  # megatron-core's MLA at TP > 1, any machine
    "uneven_gather_scatter": lambda m: not m.cuda,  # gloo
    "distributed_optimizer_torch_adam": lambda m: not (m.transformer_engine or m.apex),
}
assert list(PATCH_CONDITIONS) == list(patches.PATCHES)

MACHINE: Machine = detect()
CPU_MODE: bool = not MACHINE.cuda
if MACHINE.transformer_engine_error:
    logging.getLogger(__name__).warning("%s; using the local layer spec", MACHINE.transformer_engine_error)


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
