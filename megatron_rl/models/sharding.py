"""Move full (unsharded, TP=EP=PP=1) megatron state dicts onto a parallel layout and back.

Megatron tags tensor-parallel parameters with `tensor_model_parallel` and `partition_dim`; gated
MLP `linear_fc1` weights hold [gate; up] and each TP rank holds [gate_shard; up_shard]. Expert
weights are numbered locally per EP rank, layers locally per pipeline stage.
"""

from __future__ import annotations

import re

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
}


def canonical_name(name: str) -> str:
    """The local-spec name of a parameter (TE's fused-norm names map to separate norms)."""
    for te_suffix, local_suffix in _TE_FUSED_NORMS.items():
        if name.endswith(te_suffix):
            return name[: -len(te_suffix)] + local_suffix
    return name


_EXPERT = re.compile(r"^(.*\.experts\.local_experts\.)(\d+)(\..*)$")


def _is_gated_fc1(name: str, param: torch.nn.Parameter, gated: bool) -> bool:
    return gated and name.endswith("linear_fc1.weight")


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


def shard_full_state_dict(model, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This rank's slice of each of the model's parameters, taken from a full state dict."""
    layer_offset, expert_offset = _offsets(model)
    gated = model.config.gated_linear_unit
    local: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        global_name = local_to_global_name(name, layer_offset, expert_offset)
        if global_name not in full:
            raise KeyError(f"full state dict has no tensor {global_name!r} (for local parameter {name!r})")
        tensor = full[global_name]
        if getattr(param, "tensor_model_parallel", False):
            rank, size = _tp_rank_and_size(name)
            dim = param.partition_dim
            if _is_gated_fc1(name, param, gated):
                gate, up = tensor.chunk(2, dim=0)
                tensor = torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]], dim=0)
            else:
                tensor = tensor.chunk(size, dim=dim)[rank]
        if tensor.shape != param.shape:
            raise ValueError(
                f"{global_name}: shard shape {tuple(tensor.shape)} != parameter shape {tuple(param.shape)}"
            )
        local[name] = tensor.clone()
    return local


def load_full_state_dict(model, full: dict[str, torch.Tensor]) -> None:
    """Copies this rank's slices of `full` into the model's parameters."""
    local = shard_full_state_dict(model, full)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(local[name].to(param.dtype))


def full_parameters(model) -> dict[str, torch.Tensor]:
    """Parameters of a model built at TP=EP=PP=1, by name (detached clones)."""
    return {canonical_name(name): p.detach().clone() for name, p in model.named_parameters()}


def gather_full_parameters(model) -> dict[str, torch.Tensor]:
    """Full (unsharded) parameters on every rank, named as in the full model: TP shards are
    all-gathered (gated linear_fc1 re-joined as [gate; up]), experts and pipeline layers keep
    their global names. Each rank returns the tensors it can see: its own pipeline stage and
    experts (experts are not gathered over EP)."""

    layer_offset, expert_offset = _offsets(model)
    gated = model.config.gated_linear_unit
    out = {}
    for name, param in model.named_parameters():
        tensor = param.detach()
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
                if _is_gated_fc1(name, param, gated):
                    halves = [p.chunk(2, dim=0) for p in parts]
                    tensor = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
                else:
                    tensor = torch.cat(parts, dim=param.partition_dim)
        out[local_to_global_name(name, layer_offset, expert_offset)] = tensor.clone()
    return out
