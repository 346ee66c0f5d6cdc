"""The patches for megatron-core 0.16.1. Each `_patch_*` says why it exists.

`megatron_rl.compat.select_patches` decides which to install from what the machine lacks
(CUDA, TransformerEngine, Apex): most stand in for CUDA on a CPU, but some are about running
without TE or with the local layer spec, which a GPU machine does too (CP > 1, no TE).
tests/distributed/test_megatron_cpu.py covers every capability these make work.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import warnings

import torch
from torch.overrides import TorchFunctionMode

_CPU = torch.device("cpu")


class _NoOpStream:
    """Stands in for torch.cuda.Stream/Event: CPU work is already ordered."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, *args, **kwargs):
        return _NoOpStream()

    def record(self, *args, **kwargs):
        pass

    def wait(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other) -> float:
        return 0.0


def _patch_cuda_device_and_streams() -> None:
    # ~175 call sites allocate on torch.cuda.current_device(); the schedules, the alltoall
    # dispatcher and checkpoint saving create streams/events and synchronize.
    cuda = torch.cuda
    cuda.current_device = lambda: _CPU
    cuda.Stream = _NoOpStream
    cuda.Event = _NoOpStream
    cuda.current_stream = lambda *a, **k: _NoOpStream()
    cuda.default_stream = lambda *a, **k: _NoOpStream()
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    cuda.device = lambda *a, **k: contextlib.nullcontext()
    cuda.synchronize = lambda *a, **k: None
    cuda.set_device = lambda *a, **k: None
    cuda.empty_cache = lambda: None
    torch.Tensor.cuda = lambda self, *a, **k: self


def _patch_rng() -> None:
    # megatron's RNG tracker (dropout forks, TP-aware init) saves/restores the CUDA generator.
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
    # Seed the CPU generator directly: torch.manual_seed itself calls torch.cuda.manual_seed_all.
    torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    random = importlib.import_module("megatron.core.tensor_parallel.random")
    random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    random._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)


_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
}
_original_tensor_type = torch.Tensor.type


def _tensor_type(self, dtype=None, non_blocking=False, **kwargs):
    # The optimizer and clip_grads group parameters by comparing type strings with
    # 'torch.cuda.FloatTensor'; report CUDA names so CPU tensors land in the right group.
    if dtype is None:
        return _CUDA_TYPE_NAMES.get(self.dtype, _original_tensor_type(self))
    if isinstance(dtype, str) and dtype.startswith("torch.cuda."):
        dtype = dtype.replace("torch.cuda.", "torch.")
    return _original_tensor_type(self, dtype, non_blocking, **kwargs)


class _CudaToCpuMode(TorchFunctionMode):
    """Maps device='cuda' to CPU and drops pin_memory in tensor factories megatron calls."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs["device"] = _CPU
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func in (torch.Tensor.to,) and args:
            args = tuple(_CPU if _is_cuda(a) else a for a in args)
        return func(*args, **kwargs)


def _is_cuda(value) -> bool:
    if isinstance(value, torch.device):
        return value.type == "cuda"
    if isinstance(value, str):
        return value.startswith("cuda")
    return False


_mode: _CudaToCpuMode | None = None


def _patch_device_arguments() -> None:
    global _mode
    torch.Tensor.type = _tensor_type
    _mode = _CudaToCpuMode()
    _mode.__enter__()


def _patch_te_general_gemm() -> None:
    # moe_utils references te_general_gemm, which is undefined when TransformerEngine is absent.
    moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    # Multi-latent attention asks isinstance(linear_proj, TELinear) when its HAVE_TE is set, and
    # without TE megatron's extensions module leaves TELinear a MagicMock (not a type): say no TE.
    multi_latent_attention = importlib.import_module("megatron.core.transformer.multi_latent_attention")
    multi_latent_attention.HAVE_TE = False


def _split_sizes_as_list(sizes):
    return sizes.tolist() if isinstance(sizes, torch.Tensor) else sizes


def _patch_all_to_all_split_sizes() -> None:
    # The alltoall MoE dispatcher passes split sizes as tensors; gloo's all_to_all_single only
    # takes Python sequences.
    mappings = importlib.import_module("megatron.core.tensor_parallel.mappings")
    original = mappings.all_to_all

    def all_to_all(group, input_, output_split_sizes_=None, input_split_sizes=None):
        return original(
            group, input_, _split_sizes_as_list(output_split_sizes_), _split_sizes_as_list(input_split_sizes)
        )

    _replace_everywhere(
        original,
        all_to_all,
        [
            "megatron.core.tensor_parallel",
            mappings.__name__,
            "megatron.core.transformer.moe.token_dispatcher",
        ],
    )


def _replace_everywhere(original, replacement, module_names: list[str]) -> None:
    """Rebinds `original` to `replacement` in each module that imported it by name."""
    for module_name in module_names:
        module = importlib.import_module(module_name)
        for attr, value in list(vars(module).items()):
            if value is original:
                setattr(module, attr, replacement)


def _patch_torch_norm_sequence_parallel() -> None:
    # Without TE or Apex, norms are WrappedTorchNorm, which refuses sequence parallel; MoE with
    # TP>1 requires sequence parallel. A norm over the hidden dimension is correct on sequence
    # shards; tag its weights so finalize_model_grads all-reduces their grads over TP (without
    # the tag each TP rank's copy drifts and the loss drifts from TP=1).
    torch_norm = importlib.import_module("megatron.core.transformer.torch_norm")
    original_new = torch_norm.WrappedTorchNorm.__new__

    def __new__(cls, config, hidden_size, eps=1e-5, **kwargs):
        if not config.sequence_parallel:
            return original_new(cls, config, hidden_size, eps, **kwargs)
        unsharded = copy.copy(config)
        object.__setattr__(unsharded, "sequence_parallel", False)
        norm = original_new(cls, unsharded, hidden_size, eps, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    torch_norm.WrappedTorchNorm.__new__ = staticmethod(__new__)


def _patch_uneven_gather_scatter() -> None:
    # MoE with expert-TP > 1 all-gathers / reduce-scatters token slices of different lengths.
    # gloo's all_gather and reduce_scatter need equal sizes: pad to the longest slice and cut,
    # and reduce-scatter as an all-reduce followed by taking this rank's slice.
    mappings = importlib.import_module("megatron.core.tensor_parallel.mappings")
    original_gather = mappings._gather_along_first_dim
    original_scatter = mappings._reduce_scatter_along_first_dim

    def gather(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return original_gather(input_, group, output_split_sizes, use_global_buffer)
        sizes = _split_sizes_as_list(output_split_sizes)
        longest = max(sizes)
        padded = input_.new_zeros((longest, *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        gathered = [torch.empty_like(padded) for _ in sizes]
        torch.distributed.all_gather(gathered, padded.contiguous(), group=group)
        return torch.cat([g[:n] for g, n in zip(gathered, sizes)], dim=0)

    def reduce_scatter(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return original_scatter(input_, group, input_split_sizes, use_global_buffer)
        sizes = _split_sizes_as_list(input_split_sizes)
        summed = input_.contiguous().clone()
        torch.distributed.all_reduce(summed, group=group)
        start = sum(sizes[: group.rank()])
        return summed[start : start + sizes[group.rank()]].contiguous()

    mappings._gather_along_first_dim = gather
    mappings._reduce_scatter_along_first_dim = reduce_scatter


def _patch_distributed_optimizer_torch_adam() -> None:
    # Without TE/Apex the distributed optimizer wraps torch Adam, whose per-parameter state
    # (including `step`) exists only after a first step; building the loading template of a
    # fresh optimizer then fails ("assert len(steps) == 1"). Fill zero state first.
    distrib = importlib.import_module("megatron.core.optimizer.distrib_optimizer")
    if getattr(distrib, "HAVE_APEX_OR_TE", True):
        return
    original = distrib.DistributedOptimizer.sharded_state_dict

    def sharded_state_dict(self, model_sharded_state_dict=None, is_loading=False, *args, **kwargs):
        # megatron's hybrid device optimizer (cpu_offload) makes its own state with dummy_step;
        # torch-Adam-shaped state here would lack its `master_param` (a KeyError at load).
        if is_loading and type(self.optimizer).__name__ != "HybridDeviceOptimizer":
            with torch.no_grad():
                for group in self.optimizer.param_groups:
                    for param in group["params"]:
                        state = self.optimizer.state[param]
                        if not state:
                            state["step"] = torch.zeros((), dtype=torch.float32)
                            state["exp_avg"] = torch.zeros_like(param)
                            state["exp_avg_sq"] = torch.zeros_like(param)
        if model_sharded_state_dict is None:
            model_sharded_state_dict = {}
        return original(self, model_sharded_state_dict, is_loading, *args, **kwargs)

    distrib.DistributedOptimizer.sharded_state_dict = sharded_state_dict

    # torch Adam keeps `step` per parameter, but checkpoints carry it per param group (restored
    # by load_state_dict); copying per-parameter tensors back must leave `step` alone.
    original_set = distrib.DistributedOptimizer._set_main_param_and_optimizer_states

    def set_states(self, model_param, tensors):
        if "step" not in tensors:
            current = self._get_main_param_and_optimizer_states(model_param)
            if "step" in current:
                tensors = {**tensors, "step": current["step"]}
        with torch.no_grad():
            return original_set(self, model_param, tensors)

    distrib.DistributedOptimizer._set_main_param_and_optimizer_states = set_states

    # load_state_dict hands every parameter the same `step` tensor; torch Adam then increments
    # it once per parameter per step and the bias correction goes wrong after a resume.
    original_load = distrib.DistributedOptimizer.load_state_dict

    def load_state_dict(self, state_dict):
        result = original_load(self, state_dict)
        for state in self.optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].detach().clone()
        return result

    distrib.DistributedOptimizer.load_state_dict = load_state_dict


class _SumSharedRopeKeyGrad(torch.autograd.Function):
    """Identity forward on MLA's [..., kv_lora_rank + qk_pos_emb_head_dim] down-projection output;
    the backward sums the gradient of its last `rope` channels (the shared RoPE key) over `group`."""

    @staticmethod
    def forward(ctx, kv_combined, rope: int, group):
        ctx.rope, ctx.group = rope, group
        return kv_combined.view_as(kv_combined)

    @staticmethod
    def backward(ctx, grad):
        key = grad[..., -ctx.rope :].contiguous()
        torch.distributed.all_reduce(key, group=ctx.group)
        return torch.cat([grad[..., : -ctx.rope], key], dim=-1), None, None


def _patch_latent_attention_shared_rope_grad() -> None:
    """megatron-core 0.16.1's MLASelfAttention takes too little gradient for the shared RoPE key
    at TP > 1 (the last qk_pos_emb_head_dim outputs of linear_kv_down_proj, HF kv_a_proj_with_mqa's
    rows after the kv latent). Every TP rank uses that key, whole, for its own heads, so the key's
    true gradient is the sum over TP of what each rank's heads send back; megatron sums it nowhere:

    - the local spec (ColumnParallelLinear: the output split over TP, then
      `gather_from_tensor_model_parallel_region`, whose backward only takes this rank's slice):
      the rank that holds the key's columns keeps its own heads' part, with or without sequence
      parallel (the layer gathers the sequence first, so the key is the whole sequence's);
    - TE's spec (the down-projection duplicated on every rank) without sequence parallel: each
      rank's duplicated weight gets its own heads' part, and nothing reduces it (megatron marks the
      weight for the TP all-reduce only under sequence parallel).

    TE's spec with sequence parallel is right: there the key is gathered along the sequence
    (`gather_from_sequence_parallel_region`), whose backward reduce-scatters, summing it over TP;
    this patch leaves that path alone (no second sum). The latent's own gradient is right
    everywhere (linear_kv_up_proj sums its input gradient over TP).

    The fix: the backward of the down-projection's full-width output (the gathered one on the local
    spec, the duplicated layer's own on TE's without sequence parallel) all-reduces the key's
    channels over the TP group before megatron splits them; the forward is unchanged. This is what
    `copy_to_tensor_model_parallel_region` on k_pos_emb does (identity forward, all-reduce
    backward). No megatron-core release fixes it (core_v0.17.1 to core_v0.19.0, and main at
    d98e8a64dd, 2026-08-22, have 0.16's code): the bug is NVIDIA/Megatron-LM issue #1699 (open
    since 2025-07); pull request #6839 (dev branch, open in 2026-08) proposes that reduction on
    k_pos_emb after its RoPE, and its review found it summed twice under sequence parallel with
    TE's duplicated linear: the case left alone here. MLA is found by wrapping
    `MLASelfAttention.get_query_key_value_tensors`: for the call it hooks the kv down-projection
    module it holds then (a LoRA wrapper included) to know its output, and the module's gather
    recognises that tensor; the q latent's gather (complete already: linear_q_up_proj sums its
    input gradient) is left alone. tests/distributed/test_mla_tp.py: a training step at TP = 2
    on both specs (full and LoRA) equals one process's."""
    import contextvars

    mla = importlib.import_module("megatron.core.transformer.multi_latent_attention")
    original_qkv = mla.MLASelfAttention.get_query_key_value_tensors
    original_gather = mla.gather_from_tensor_model_parallel_region
    # (the kv down-projection's output in this call, or None; rope channels; TP group)
    current: contextvars.ContextVar = contextvars.ContextVar("megatron_rl_mla_kv_down", default=None)

    def get_query_key_value_tensors(self, hidden_states, *args, **kwargs):
        group = self.tp_group
        if group is None or group.size() == 1 or not torch.is_grad_enabled():
            return original_qkv(self, hidden_states, *args, **kwargs)
        config = self.config
        rope, whole = config.qk_pos_emb_head_dim, config.kv_lora_rank + config.qk_pos_emb_head_dim
        state = {"output": None}

        def hook(module, inputs, result):
            output, bias = result if isinstance(result, tuple) else (result, None)
            if output.size(-1) == whole and not config.sequence_parallel:  # TE's duplicated linear
                output = _SumSharedRopeKeyGrad.apply(output, rope, group)
                result = (output, bias) if isinstance(result, tuple) else output
            state["output"] = output
            return result

        handle = self.linear_kv_down_proj.register_forward_hook(hook)
        token = current.set((state, rope, group))
        try:
            return original_qkv(self, hidden_states, *args, **kwargs)
        finally:
            current.reset(token)
            handle.remove()

    def gather_from_tensor_model_parallel_region(input_, *args, **kwargs):
        output = original_gather(input_, *args, **kwargs)
        context = current.get()
        if context is not None and input_ is context[0]["output"]:  # the split kv down-projection
            output = _SumSharedRopeKeyGrad.apply(output, context[1], context[2])
        return output

    mla.MLASelfAttention.get_query_key_value_tensors = get_query_key_value_tensors
    mla.gather_from_tensor_model_parallel_region = gather_from_tensor_model_parallel_region


def _silence_cpu_warnings() -> None:
    # Emitted on every import/forward without TE, Apex or CUDA; they say nothing actionable here.
    for message in (
        "Apex is not installed",
        "Transformer Engine and Apex are not installed",
        "full scope is deprecated",
        ".*CUDA_DEVICE_MAX_CONNECTIONS",
        "`torch.distributed.all_gather_into_tensor` is deprecated",
        "`torch.distributed.reduce_scatter_tensor` is deprecated",
    ):
        warnings.filterwarnings("ignore", message=message)


# name -> patch, in installation order.
PATCHES = {
    "silence_cpu_warnings": _silence_cpu_warnings,
    "cuda_device_and_streams": _patch_cuda_device_and_streams,
    "rng": _patch_rng,
    "device_arguments": _patch_device_arguments,
    "te_general_gemm": _patch_te_general_gemm,
    "all_to_all_split_sizes": _patch_all_to_all_split_sizes,
    "torch_norm_sequence_parallel": _patch_torch_norm_sequence_parallel,
    "latent_attention_shared_rope_grad": _patch_latent_attention_shared_rope_grad,
    "uneven_gather_scatter": _patch_uneven_gather_scatter,
    "distributed_optimizer_torch_adam": _patch_distributed_optimizer_torch_adam,
}
installed: list[str] = []


def install(names) -> None:
    """Installs the named patches (each once), in PATCHES order."""
    unknown = set(names) - set(PATCHES)
    if unknown:
        raise ValueError(f"unknown compat patches {sorted(unknown)} (known: {list(PATCHES)})")
    for name, patch in PATCHES.items():
        if name in names and name not in installed:
            patch()
            installed.append(name)
