"""The `compile` check (second review, defect 5, suspected: cold-start compile time).

On CUDA the builder turns megatron's `bias_activation_fusion` on, and megatron-core 0.16.1's
fused swiglu (megatron/core/fusions/fused_bias_swiglu.py: `swiglu`, `swiglu_back`, ...) is
decorated with `megatron.core.jit.jit_fuser`, which is `torch.compile` on torch >= 2.2 (else
`torch.jit.script`). Packed micro-batches change length from one to the next, and dynamo guards
on shapes. The check builds the policy model as the trainer does (its dtype, the builder's
defaults), runs SAO train steps over packed micro-batches of many lengths with a fresh inductor
and Triton cache (what a new machine pays), and reports the first step's time, the steady step
time, dynamo's graphs (`torch._dynamo.utils.counters["stats"]["unique_graphs"]`) per step and the
compiled entries of each fused function (dynamo's cache entries of its code).

FAIL when:
- the steady steps, which see micro-batch lengths not seen before, still compile graphs
  (shapes keep recompiling);
- a fused function holds more than `GRAPHS_PER_FUNCTION` compiled entries: one for the first
  length, one more when dynamo's automatic dynamic shapes marks the length dynamic; more means
  a recompile per length (until torch's recompile limit, 8, falls back to eager);
- (CUDA) the first step takes longer than `COLD_START_LIMIT_S`.

On CPU (`--cpu`) the builder leaves the fusion off: no graph, and the bookkeeping (zero graphs,
step times) is what runs. `measure_compile(cpu=True, fusion=True)` forces the fusion on, which
megatron allows on CPU (inductor's C++ backend): tests/distributed/test_multi_gpu_twins.py runs
it and holds the same criteria but the cold-start time. What only the GPU shows: Triton's compile
time (the cold start that the 25 s checks pay) and the CUDA graphs' count with the CUDA build.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

# bf16_policy and bf16_critic (tests/gpu/checks.py) have 25 s limits and each builds a float32 and
# a bfloat16 model: dtype is in dynamo's guards, so each pays the cold compile twice.
COLD_START_LIMIT_S = 12.5
GRAPHS_PER_FUNCTION = 2
FUSION_MODULES = ["megatron.core.fusions.fused_bias_swiglu", "megatron.core.fusions.fused_bias_gelu",
                  "megatron.core.fusions.fused_bias_geglu"]  # fmt: skip


def fused_functions() -> dict[str, object]:
    """megatron's torch.compile'd fusion functions: {module.function: the undecorated function}."""
    import importlib

    found = {}
    for module_name in FUSION_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        for name, value in vars(module).items():
            original = getattr(value, "_torchdynamo_orig_callable", None)
            if original is not None and hasattr(original, "__code__"):
                found[f"{module_name.rsplit('.', 1)[-1]}.{name}"] = original
    return found


def compiled_entries(functions: dict[str, object]) -> dict[str, int]:
    """Dynamo's compiled entries (one per graph it keeps) of each function's code; unused ones left out."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    entries = {name: len(_debug_get_cache_entry_list(fn.__code__)) for name, fn in functions.items()}
    return {name: count for name, count in entries.items() if count}


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def measure_compile(cpu: bool, fusion: bool | None = None, steps: int = 6) -> dict:
    """SAO train steps of the policy model over packed micro-batches of varying length: figures
    (see the module docstring). `fusion` None: the builder's choice (on with CUDA)."""
    import torch
    from megatron.core import jit

    from megatron_rl.config import AlgorithmConfig, OptimizerConfig
    from megatron_rl.data.packing import pack_into_grid
    from megatron_rl.models.builder import build_gpt_model
    from megatron_rl.policy.loss import policy_loss_func
    from megatron_rl.trainer.optimizer import build_trainable
    from megatron_rl.trainer.step import train_step
    from tests.gpu.checks import _arch, _sync
    from tests.support.samples import training_samples

    if steps < 4:
        raise ValueError(f"steps ({steps}) must be >= 4: a first step and steady steps after it")
    arch = _arch(cpu)
    overrides = {} if fusion is None else {"bias_activation_fusion": fusion}
    torch.manual_seed(0)
    model = build_gpt_model(arch, dtype="float32" if cpu else "bfloat16", **overrides)
    trainable = build_trainable(model, OptimizerConfig(lr=1e-4, grad_clip=1.0), total_steps=steps)
    loss_func = policy_loss_func(AlgorithmConfig(type="sao"))
    # samples of 6..39 tokens packed into rows of up to 256 (CPU) or 1024 tokens: every step's
    # micro-batches have lengths of their own
    count, seq_len = (24, 256) if cpu else (96, 1024)
    grids = [
        pack_into_grid(training_samples(count, arch.vocab_size, seed=100 + s), seq_len, 1)[0]
        for s in range(steps)
    ]
    times, graphs, lengths = [], [], []
    previous = os.environ.get("TORCHINDUCTOR_CACHE_DIR"), os.environ.get("TRITON_CACHE_DIR")
    with tempfile.TemporaryDirectory() as cache:  # cold: no kernel compiled by an earlier process
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache, "inductor")
        os.environ["TRITON_CACHE_DIR"] = os.path.join(cache, "triton")
        try:
            start_graphs = _graphs()
            for micro_batches in grids:
                lengths.append([int(mb.input_ids.size) for mb in micro_batches])
                _sync()
                began = time.perf_counter()
                metrics = train_step(trainable, micro_batches, loss_func)
                _sync()
                times.append(time.perf_counter() - began)
                graphs.append(_graphs() - start_graphs)
                if metrics["loss"] is None or metrics["loss"] != metrics["loss"]:
                    raise AssertionError(f"step {len(times)}: loss {metrics['loss']}")
        finally:
            for name, value in zip(("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"), previous):
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
    half = steps // 2
    seen_before = {n for step in lengths[:half] for n in step}
    new_in_steady = sorted({n for step in lengths[half:] for n in step} - seen_before)
    return {
        "jit_fuser": f"{getattr(jit.jit_fuser, '__module__', '')}.{getattr(jit.jit_fuser, '__name__', jit.jit_fuser)}",
        "bias_activation_fusion": bool(model.config.bias_activation_fusion),
        "first_step_s": times[0],
        "steady_step_s": statistics.median(times[half:]),
        "graphs_per_step": graphs,  # cumulative
        "graphs_in_steady_steps": graphs[-1] - graphs[half - 1],
        "compiled_entries": compiled_entries(fused_functions()),
        "micro_batch_lengths": len({n for step in lengths for n in step}),
        "new_lengths_in_steady_steps": len(new_in_steady),
    }


def compile_problems(figures: dict, cold_start_limit_s: float | None) -> list[str]:
    """What is wrong with `measure_compile`'s figures (empty: PASS); no time judged when
    `cold_start_limit_s` is None."""
    problems = []
    if figures["new_lengths_in_steady_steps"] == 0:
        problems.append("the steady steps saw no new micro-batch length: recompiles could not show")
    if figures["graphs_in_steady_steps"]:
        problems.append(
            f"{figures['graphs_in_steady_steps']} graphs compiled in the steady steps (new lengths recompile)"
        )
    many = {name: n for name, n in figures["compiled_entries"].items() if n > GRAPHS_PER_FUNCTION}
    if many:
        problems.append(f"more than {GRAPHS_PER_FUNCTION} compiled entries for {many}")
    if (
        figures["bias_activation_fusion"]
        and "compile" in figures["jit_fuser"]
        and not figures["graphs_per_step"][-1]
    ):
        problems.append("the fusion is on and jit_fuser is torch.compile, yet dynamo counted no graph")
    if not figures["bias_activation_fusion"] and figures["compiled_entries"]:
        problems.append(
            f"the fusion is off, yet fused functions were compiled: {figures['compiled_entries']}"
        )
    if cold_start_limit_s is not None and figures["first_step_s"] > cold_start_limit_s:
        problems.append(f"the first step took {figures['first_step_s']:.1f} s > {cold_start_limit_s:g} s")
    return problems


def check_compile(cpu: bool) -> dict:
    figures = measure_compile(cpu)
    problems = compile_problems(figures, None if cpu else COLD_START_LIMIT_S)
    if not cpu and not figures["bias_activation_fusion"]:
        problems.append(
            "bias_activation_fusion is off on CUDA: the builder no longer fuses (nothing measured)"
        )
    if problems:
        raise AssertionError(f"{'; '.join(problems)}: {figures}")
    return figures
