"""megatron_rl.compat: the CPU patches, and which patches each kind of machine gets."""

from __future__ import annotations

import itertools

from megatron_rl.compat import patches

import pytest
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


CPU_ONLY = {
    "silence_cpu_warnings",
    "cuda_device_and_streams",
    "rng",
    "device_arguments",
    "all_to_all_split_sizes",
    "uneven_gather_scatter",
}


@pytest.mark.parametrize("cuda,te,apex", list(itertools.product([False, True], repeat=3)))
def test_each_patch_is_installed_under_its_own_condition(cuda, te, apex):
    selected = set(compat.select_patches(compat.Machine(cuda=cuda, transformer_engine=te, apex=apex)))
    expected = {"torch_norm_sequence_parallel"}  # WrappedTorchNorm: the local spec on any machine
    expected.add("latent_attention_shared_rope_grad")  # megatron-core's MLA at TP > 1, on any machine
    if not cuda:
        expected |= CPU_ONLY
    if not te:
        expected.add("te_general_gemm")  # the MoE router's NameError without TE
    if not (te or apex):
        expected.add("distributed_optimizer_torch_adam")  # torch Adam's per-parameter step
    assert selected == expected


def test_a_gpu_without_te_gets_the_no_te_patches_and_no_cpu_patches():
    selected = compat.select_patches(compat.Machine(cuda=True, transformer_engine=False, apex=False))
    assert selected == ["te_general_gemm", "torch_norm_sequence_parallel", "latent_attention_shared_rope_grad",
                        "distributed_optimizer_torch_adam"]


def test_this_machine_installed_what_its_conditions_select():
    assert compat.apply() == compat.select_patches(compat.detect())
    with pytest.raises(ValueError, match=r"unknown compat patches \['no_such_patch'\]"):
        patches.install(["no_such_patch"])


def test_a_transformer_engine_whose_torch_extension_fails_to_import_is_not_used(tmp_path):
    """A TE whose top-level package imports but whose torch extension does not (built against
    another torch, or missing its .so) is reported and not used: the local spec and the patches
    of a machine without TE, not a crash in the first TE layer (second GPU reading, defect 3)."""
    import subprocess
    import sys

    package = tmp_path / "transformer_engine"
    (package / "pytorch").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "pytorch" / "__init__.py").write_text(
        "raise ImportError('transformer_engine_torch.so: undefined symbol: _ZN3c104cuda9SetDevice')\n"
    )
    probe = ("import logging; logging.basicConfig(level=logging.WARNING)\n"
             "from megatron_rl import compat\n"
             "print(compat.MACHINE.transformer_engine, 'te_general_gemm' in compat.select_patches(compat.MACHINE))\n"
             "print(compat.MACHINE.transformer_engine_error)\n"
             "from megatron_rl.models.builder import uses_transformer_engine\n"
             "print(uses_transformer_engine())\n")  # fmt: skip
    env = {**__import__("os").environ, "PYTHONPATH": str(tmp_path)}
    # The defect, reproduced: megatron-core alone does not even import beside such a TE (it
    # guards its TE imports with `except ModuleNotFoundError`).
    bare = subprocess.run([sys.executable, "-c", "import megatron.core"], capture_output=True, text=True,
                          timeout=120, env=env)  # fmt: skip
    assert bare.returncode != 0 and "ImportError: transformer_engine_torch.so" in bare.stderr
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    usable, error, spec = done.stdout.splitlines()[:3]
    assert usable == "False True" and spec == "False"
    assert "transformer_engine.pytorch does not import: ImportError: transformer_engine_torch.so" in error
    assert "using the local layer spec" in done.stderr
