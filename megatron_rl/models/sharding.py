"""Move full (unsharded, TP=EP=PP=1) megatron state dicts onto a parallel layout and back.

Megatron tags tensor-parallel parameters with `tensor_model_parallel`; the axis each is split on
follows from the kind of module that owns it (`partition_axis`), never from `partition_dim`:
TransformerEngine reports `partition_dim = 0` for every expert linear that megatron builds with
explicit communication (`parallel_mode=None`), although the row-parallel `linear_fc2` is split on
axis 1. Gated MLP `linear_fc1` weights hold [gate; up] and each TP rank holds
[gate_shard; up_shard]. Expert weights are numbered locally per EP rank, layers locally per
pipeline stage. Full state dicts may be any `Mapping` (a lazy one computes each tensor when asked,
so a rank touches only the tensors it holds).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import megatron_rl.compat  # noqa: F401  (megatron-core on CPU needs its patches first)

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

_LAYER = re.compile(r"^(.*?decoder\.layers\.)(\d+)(\..*)$")
# The TransformerEngine spec fuses the pre-attention / pre-MLP norms into the next linear layer.
_TE_FUSED_NORMS = {
    ".self_attention.linear_qkv.layer_norm_weight": ".input_layernorm.weight",
    ".mlp.linear_fc1.layer_norm_weight": ".pre_mlp_layernorm.weight",
    # multi-latent attention: the q and kv latents' norms, fused into their up-projections
    ".self_attention.linear_q_up_proj.layer_norm_weight": ".self_attention.q_layernorm.weight",
    ".self_attention.linear_kv_up_proj.layer_norm_weight": ".self_attention.kv_layernorm.weight",
}
# TE's grouped experts (moe_grouped_gemm) hold expert e's weight as `experts.linear_fc1.weight{e}`.
# A layer wrapped by LoRA (transforms/lora.py) holds its own tensors under `base.`, beside its adapters.
_LORA_BASE = re.compile(r"\.base\.(weight|bias|layer_norm_weight|layer_norm_bias)$")
_GROUPED_EXPERT = re.compile(r"^(.*\.experts\.)(linear_fc[12])\.(weight|bias)(\d+)$")
_EXPERT = re.compile(r"^(.*\.experts\.local_experts\.)(\d+)(\..*)$")

# Tensor-parallel module kinds: column-parallel ones split their output rows (axis 0),
# row-parallel ones their input columns (axis 1). LoRA adapters follow the layer they adapt
# (a column layer's B [out / tp, rank], a row layer's A [rank, in / tp]).
COLUMN_PARALLEL_KINDS = ("linear_qkv", "linear_fc1", "word_embeddings", "output_layer",
                         # multi-latent attention's (the local spec splits the down-projections too)
                         "linear_q_proj", "linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj",
                         "linear_kv_up_proj")  # fmt: skip
ROW_PARALLEL_KINDS = ("linear_proj", "linear_fc2")


# Buffers that are weights: a sigmoid router's per-expert bias (HF `e_score_correction_bias`),
# which chooses experts, is converted, loaded and published like a parameter but never trained.
WEIGHT_BUFFERS = (".router.expert_bias",)


def named_weights(model):
    """(name, tensor) of the model's parameters, then of its buffers that are weights
    (WEIGHT_BUFFERS): what a checkpoint conversion, a load or a publish must move."""
    yield from model.named_parameters()
    for name, buffer in model.named_buffers():
        if name.endswith(WEIGHT_BUFFERS):
            yield name, buffer


def canonical_name(name: str) -> str:
    """The local-spec name of a parameter: a LoRA-wrapped layer's own tensors under the layer's
    name (its adapters `lora_a`, `lora_b` beside them), TE's fused-norm names map to separate
    norms, TE's grouped expert weights to per-expert names."""
    name = _LORA_BASE.sub(r".\1", name)
    for te_suffix, local_suffix in _TE_FUSED_NORMS.items():
        if name.endswith(te_suffix):
            return name[: -len(te_suffix)] + local_suffix
    match = _GROUPED_EXPERT.match(name)
    if match:
        return f"{match[1]}local_experts.{match[4]}.{match[2]}.{match[3]}"
    return name


def partition_axis(name: str) -> int:
    """The axis a tensor-parallel parameter `name` is split on, from its module kind."""
    kinds = [
        part for part in canonical_name(name).split(".") if part in COLUMN_PARALLEL_KINDS + ROW_PARALLEL_KINDS
    ]
    if not kinds:
        raise ValueError(
            f"{name}: a tensor-parallel parameter of no known module kind "
            f"(expected one of {COLUMN_PARALLEL_KINDS + ROW_PARALLEL_KINDS} in its name)"
        )
    return 0 if kinds[-1] in COLUMN_PARALLEL_KINDS else 1


def _is_gated_fc1(name: str, gated: bool) -> bool:
    """A gated linear_fc1's weight holds [gate; up], and each TP rank [gate_shard; up_shard]; so
    does a LoRA adapter's B of that layer (its rows are the weight's)."""
    return gated and canonical_name(name).endswith(("linear_fc1.weight", "linear_fc1.lora_b"))


def local_to_global_name(name: str, layer_offset: int, expert_offset: int) -> str:
    """Renames a rank-local parameter name to its (local-spec) name in the full model."""
    name = canonical_name(name)
    match = _LAYER.match(name)
    if match:
        name = f"{match[1]}{int(match[2]) + layer_offset}{match[3]}"
    match = _EXPERT.match(name)
    if match:
        name = f"{match[1]}{int(match[2]) + expert_offset}{match[3]}"
    return name


def _offsets(model) -> tuple[int, int]:
    config = model.config
    layer_offset = get_transformer_layer_offset(config)
    expert_offset = 0
    if config.num_moe_experts:
        local_experts = config.num_moe_experts // parallel_state.get_expert_model_parallel_world_size()
        expert_offset = parallel_state.get_expert_model_parallel_rank() * local_experts
    return layer_offset, expert_offset


def global_parameter_names(model) -> dict[str, str]:
    """Each of this rank's parameter names -> its (local-spec) name in the full model."""
    layer_offset, expert_offset = _offsets(model)
    return {name: local_to_global_name(name, layer_offset, expert_offset) for name, _ in named_weights(model)}


def _tp_rank_and_size(name: str) -> tuple[int, int]:
    if ".experts." in name:
        return (
            parallel_state.get_expert_tensor_parallel_rank(),
            parallel_state.get_expert_tensor_parallel_world_size(),
        )
    return (
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_world_size(),
    )


def _shard(name: str, param: torch.Tensor, tensor: torch.Tensor, gated: bool) -> torch.Tensor:
    """This rank's slice of the full `tensor` for local parameter `name`: a view, except a
    gated fc1 split over TP (its gate and up shards are joined)."""
    if not getattr(param, "tensor_model_parallel", False):
        return tensor
    rank, size = _tp_rank_and_size(name)
    if size == 1:
        return tensor
    if _is_gated_fc1(name, gated):
        gate, up = tensor.chunk(2, dim=0)
        return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]], dim=0)
    return tensor.chunk(size, dim=partition_axis(name))[rank]


def shard_full_state_dict(model, full: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This rank's slice of each of the model's parameters, taken from a full state dict (views
    of `full`'s tensors where the slice is contiguous in them; no copies)."""
    layer_offset, expert_offset = _offsets(model)
    gated = model.config.gated_linear_unit
    local: dict[str, torch.Tensor] = {}
    for name, param in named_weights(model):
        local[name] = _checked_shard(name, param, full, layer_offset, expert_offset, gated)
    return local


def _checked_shard(name, param, full, layer_offset, expert_offset, gated) -> torch.Tensor:
    global_name = local_to_global_name(name, layer_offset, expert_offset)
    if global_name not in full:
        raise KeyError(f"full state dict has no tensor {global_name!r} (for local parameter {name!r})")
    tensor = _shard(name, param, full[global_name], gated)
    if tensor.shape != param.shape:
        raise ValueError(
            f"{global_name}: shard shape {tuple(tensor.shape)} != parameter shape {tuple(param.shape)}"
        )
    return tensor


def load_full_state_dict(model, full: Mapping[str, torch.Tensor], keep: frozenset[str] = frozenset()) -> None:
    """Copies this rank's slices of `full` into the model's parameters (and weight buffers: a
    router's expert bias), one at a time (no full-model copy); those whose global name is in
    `keep` (a value head that an HF checkpoint does not hold) keep their values."""
    layer_offset, expert_offset = _offsets(model)
    gated = model.config.gated_linear_unit
    with torch.no_grad():
        for name, param in named_weights(model):
            if local_to_global_name(name, layer_offset, expert_offset) in keep:
                continue
            param.copy_(_checked_shard(name, param, full, layer_offset, expert_offset, gated))


def full_parameters(model) -> dict[str, torch.Tensor]:
    """Parameters (and weight buffers) of a model built at TP=EP=PP=1, by name (detached clones)."""
    return {canonical_name(name): p.detach().clone() for name, p in named_weights(model)}


def gather_full_parameters(model, copy: bool = True, select=None) -> dict[str, torch.Tensor]:
    """Full (unsharded) parameters on every rank, named as in the full model: TP shards are
    all-gathered (gated linear_fc1 re-joined as [gate; up]), experts and pipeline layers keep
    their global names. Each rank returns the tensors it can see: its own pipeline stage and
    experts (experts are not gathered over EP). With `copy=False` a tensor that needs no gather
    is the detached parameter itself (no copy: read it before the next optimizer step); gathered
    tensors are always new. `select(name)`: only the parameters it accepts (by local name; the
    same on every rank of a TP group), e.g. a LoRA model's adapters alone. Weight buffers (a
    router's expert bias) come with the parameters (never gathered: they are replicated)."""
    named = [(n, p) for n, p in named_weights(model) if select is None or select(n)]
    return _gather_full(model, lambda param: param.detach(), copy, named)


def gather_full_gradients(model) -> dict[str, torch.Tensor]:
    """Like `gather_full_parameters`, for the gradients (megatron DDP's `main_grad` where there
    is one, else `grad`) of the parameters that have one; always copies."""
    params = [(n, p) for n, p in model.named_parameters() if getattr(p, "main_grad", p.grad) is not None]

    def grad(param):
        return getattr(param, "main_grad", param.grad).detach()

    return _gather_full(model, grad, True, params)


def _gather_full(model, value_of, copy: bool, named=None) -> dict[str, torch.Tensor]:
    layer_offset, expert_offset = _offsets(model)
    gated = model.config.gated_linear_unit
    out = {}
    for name, param in named if named is not None else model.named_parameters():
        tensor = value_of(param)
        gathered = False
        if getattr(param, "tensor_model_parallel", False):
            _, size = _tp_rank_and_size(name)
            group = (
                parallel_state.get_expert_tensor_parallel_group()
                if ".experts." in name
                else parallel_state.get_tensor_model_parallel_group()
            )
            if size > 1:
                parts = [torch.empty_like(tensor) for _ in range(size)]
                dist.all_gather(parts, tensor.contiguous(), group=group)
                if _is_gated_fc1(name, gated):
                    halves = [p.chunk(2, dim=0) for p in parts]
                    tensor = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
                else:
                    tensor = torch.cat(parts, dim=partition_axis(name))
                gathered = True
        if copy and not gathered:
            tensor = tensor.clone()
        out[local_to_global_name(name, layer_offset, expert_offset)] = tensor
    return out
