"""LoRA on megatron's tensor-parallel linear layers: y = W x + (alpha / rank) * B A x.

Under the TransformerEngine spec, `linear_qkv` and the dense `linear_fc1` are
LayerNormColumnParallelLinear: they apply the input norm themselves (y = W norm(x); the spec's
norm modules are IdentityOp), so x is the raw residual stream. The adapter then takes norm(x)
too, computed from the wrapped layer's own norm parameters, so that the model is
y = W norm(x) + s B A norm(x) under either spec and `merge_lora` (W + s B A) gives its weights.

Column-parallel layers (linear_qkv, linear_fc1: W is [out / tp, in]) keep A [rank, in]
replicated and shard B [out / tp, rank] like W; the gradient reaching A is summed over TP so
every rank's A stays identical. Row-parallel layers (linear_proj, linear_fc2: W is
[out, in / tp]) shard A [rank, in / tp] like W and all-reduce A x before the replicated
B [out, rank]. B starts at zero, so a fresh adapter leaves the model unchanged.

Multi-latent attention's linears are column-parallel (q_proj or q down/up, kv down/up), except
that TE's spec runs its down-projections duplicated (TELinear, parallel_mode "duplicated": W
whole on every TP rank, its output this rank's tokens under sequence parallelism); megatron's
local spec splits them over TP like any column-parallel linear. A duplicated layer's adapter
(kind "duplicated") keeps A and B whole; under sequence parallelism each rank sees its own
tokens, so both gradients are summed over TP (as megatron marks the duplicated weight
`sequence_parallel` for its gradient all-reduce).

The adapter path does the communication its layer does:
- sequence parallel (an MoE model at TP > 1): a column layer's input is this rank's slice of
  the sequence, so A x is gathered along the sequence (the backward reduce-scatters), and a row
  layer's partial A x is reduce-scattered along it (as the layer's output is) before B. The
  replicated factor (A of a column layer, B of a row layer) then sees only this rank's tokens,
  so its gradient is summed over TP;
- the experts' linears at expert-TP > 1 communicate nothing themselves (megatron's
  `explicit_expert_comm`: the token dispatcher gathers their input and sums their outputs and
  input gradients). The adapter path does the same: no collective on A x, and the replicated
  factor's gradient, which each rank holds a part of, summed over the expert-TP group. `merge_lora`
folds the adapters into W (per shard) for export; `merge_adapter_tensors` does it on a full
(gathered) state dict, where a wrapped layer's own tensors keep the layer's names
(`models/sharding.canonical_name`) and its adapters sit beside them; the model's reshardable
(dist_checkpointing) state asked for with `metadata={MERGED: True}` (the seam's PLAIN_MODEL) has
each adapted weight merged, per shard, and no adapters: what a plain model loads. `adapters_disabled` runs the base model (the adapters
skipped): the frozen reference of a LoRA-adapted model, with no copy.

Checkpoints: a wrapped layer's tensors keep the checkpoint keys of the plain layer, its adapters
sit beside them; a gated linear_fc1's weight and B are stored as megatron's MLP stores a plain
fc1's weight (the swiglu factory: gate and up halves sharded separately), so the global tensor is
[gate; up] at any TP and loads at another TP, or into a plain model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import zlib
from collections.abc import Iterator, Mapping

import megatron_rl.compat  # noqa: F401  (megatron-core on CPU needs its patches first)

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint
from torch import nn

from megatron_rl.models.sharding import global_parameter_names
from megatron_rl.transforms.base import PLAIN_MODEL

# Multi-latent attention's linears (megatron's MLASelfAttention) are column-parallel, except its
# down-projections under TE's spec (TELinear, parallel_mode "duplicated"): `DOWN_PROJECTIONS`.
COLUMN_PARALLEL = ("linear_qkv", "linear_fc1", "linear_q_proj", "linear_q_down_proj", "linear_q_up_proj",
                   "linear_kv_down_proj", "linear_kv_up_proj")  # fmt: skip
ROW_PARALLEL = ("linear_proj", "linear_fc2")
DOWN_PROJECTIONS = ("linear_q_down_proj", "linear_kv_down_proj")
# `sharded_state_dict(metadata={MERGED: True})`: each wrapped layer's weight merged, no adapters
# (the seam's plain-model request, transforms/base.PLAIN_MODEL).
MERGED = PLAIN_MODEL


def fused_norm(base: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The input norm a TE LayerNorm*Linear applies inside (its `layer_norm_weight`,
    `layer_norm_bias`, `eps`, `normalization`, `zero_centered_gamma`), in float32, cast back
    to x's dtype."""
    weight = base.layer_norm_weight.float()
    if getattr(base, "zero_centered_gamma", False):
        weight = weight + 1
    x32 = x.float()
    normalization = getattr(base, "normalization", "RMSNorm")
    if normalization == "RMSNorm":
        out = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + base.eps) * weight
    elif normalization == "LayerNorm":
        bias = getattr(base, "layer_norm_bias", None)
        out = nn.functional.layer_norm(
            x32, (x32.shape[-1],), weight, None if bias is None else bias.float(), base.eps
        )
    else:
        raise ValueError(f"LoRA: fused normalization {normalization!r} is not supported")
    return out.to(x.dtype)


class LoRALinear(nn.Module):
    """Wraps a megatron Column/RowParallelLinear (or TE's, with or without a fused input norm);
    returns (output, bias) like the wrapped layer."""

    def __init__(
        self,
        base: nn.Module,
        parallel_kind: str,
        rank: int,
        alpha: float,
        seed: int = 0,
        gated: bool = False,
        expert: bool = False,
    ):
        super().__init__()

        self.base = base
        self.parallel_kind = parallel_kind
        self.gated = gated  # a gated MLP's linear_fc1: W and B rows are [gate; up] (per TP shard)
        self.scale = alpha / rank
        out_local, in_local = base.weight.shape
        # The layer's TP group and how it communicates, as megatron decides it for its own linears
        # and TE's (TE's expert linears keep neither their group nor `explicit_expert_comm`): an
        # expert's linear (`expert`) is sharded over the expert-TP group and communicates nothing
        # at expert-TP > 1 or EP > 1; the others run sequence parallel where the model does.
        if expert:
            self.tp_group = parallel_state.get_expert_tensor_parallel_group()
            ep = parallel_state.get_expert_model_parallel_world_size()
            self.explicit_expert_comm = self.tp_group.size() > 1 or ep > 1
        else:
            self.tp_group = getattr(base, "tp_group", None) or parallel_state.get_tensor_model_parallel_group()
            self.explicit_expert_comm = False
        tp, tp_rank = self.tp_group.size(), self.tp_group.rank()
        config = getattr(base, "config", None)
        self.sequence_parallel = bool(getattr(config, "sequence_parallel", False)) and tp > 1 and not expert
        generator = torch.Generator().manual_seed(seed)
        if parallel_kind in ("column", "duplicated"):
            # A is replicated: draw it identically on every TP rank.
            a = torch.empty(rank, in_local)
            nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
            b = torch.zeros(out_local, rank)
        else:
            full_a = torch.empty(rank, in_local * tp)
            nn.init.kaiming_uniform_(full_a, a=math.sqrt(5), generator=generator)
            a = full_a.chunk(tp, dim=1)[tp_rank].clone()
            b = torch.zeros(out_local, rank)
        self.lora_a = nn.Parameter(a.to(base.weight.dtype).to(base.weight.device))
        self.lora_b = nn.Parameter(b.to(base.weight.dtype).to(base.weight.device))
        # Expert linears under EP > 1 carry allreduce=False (DDP then reduces them over the
        # expert-data-parallel group only); their adapters are per expert too.
        expert_local = not getattr(base.weight, "allreduce", True)
        for adapter in (self.lora_a, self.lora_b):
            adapter.allreduce = not expert_local
        self.fuses_input_norm = hasattr(base, "layer_norm_weight")
        self.enabled = True  # False: the wrapped layer alone (`adapters_disabled`)
        if parallel_kind == "duplicated":
            pass  # A and B whole on every TP rank, as the weight
        elif parallel_kind == "column":
            self.lora_b.tensor_model_parallel, self.lora_b.partition_dim, self.lora_b.partition_stride = (
                True,
                0,
                1,
            )
        else:
            self.lora_a.tensor_model_parallel, self.lora_a.partition_dim, self.lora_a.partition_stride = (
                True,
                1,
                1,
            )

    def forward(self, x, *args, **kwargs):
        output, bias = self.base(x, *args, **kwargs)
        if not self.enabled:
            return output, bias
        if self.fuses_input_norm:
            x = fused_norm(self.base, x)
        group = self.tp_group
        # The replicated factor's gradient summed over the group where each rank holds a part of it
        # (identity forward): this rank's tokens only (sequence parallel), or its share of dL/dz
        # (experts with explicit communication).
        partial_grad = self.sequence_parallel or self.explicit_expert_comm
        a, b = self.lora_a, self.lora_b
        if self.parallel_kind == "duplicated":
            if self.sequence_parallel:  # this rank's tokens: both factors' gradients summed over TP
                a = tensor_parallel.copy_to_tensor_model_parallel_region(a, group=group)
                b = tensor_parallel.copy_to_tensor_model_parallel_region(b, group=group)
            z = nn.functional.linear(x, a)
        elif self.parallel_kind == "column":
            if partial_grad:
                a = tensor_parallel.copy_to_tensor_model_parallel_region(a, group=group)
            z = nn.functional.linear(x, a)
            if self.sequence_parallel:  # [s / tp, ...] -> [s, ...], the backward sums dL/dz over TP
                z = tensor_parallel.gather_from_sequence_parallel_region(z, True, group=group)
            elif not self.explicit_expert_comm:
                # Each TP rank's B shard sends back part of dL/dz: sum it so A sees the full gradient.
                z = tensor_parallel.copy_to_tensor_model_parallel_region(z, group=group)
        else:
            z = nn.functional.linear(x, a)  # this rank's part of A x (A sharded over the input)
            if self.sequence_parallel:
                z = tensor_parallel.reduce_scatter_to_sequence_parallel_region(z, group=group)
            elif not self.explicit_expert_comm:  # (with it, the dispatcher sums the outputs)
                z = tensor_parallel.reduce_from_tensor_model_parallel_region(z, group=group)
            if partial_grad:
                b = tensor_parallel.copy_to_tensor_model_parallel_region(b, group=group)
        return output + self.scale * nn.functional.linear(z, b), bias

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """The wrapped layer's tensors under the checkpoint keys it has without LoRA (so a
        checkpoint of the plain model loads into the wrapped one and back), plus the adapters,
        TP-sharded like the weight they adapt. A gated fc1's weight and B get megatron's swiglu
        factory, as the plain MLP gives its fc1 (the MLP does not see them under `base.`). With
        `metadata[MERGED]`: the weight is W + scale * B A (this rank's shard) and the adapters
        are left out."""

        metadata = metadata or {}
        merged = bool(metadata.get(MERGED))
        singleton = metadata.get("singleton_local_shards", False)
        base = self.base.sharded_state_dict(prefix, sharded_offsets, metadata)
        state, found = {}, False
        for key, value in base.items():
            is_weight = getattr(value, "data", None) is self.base.weight
            found |= is_weight
            if is_weight and merged:
                value = dataclasses.replace(value, data=self.merged_weight().detach())
            if is_weight and self.gated:
                value = apply_swiglu_sharded_factory(value, sharded_offsets, singleton)
            state[f"{prefix}base.{key[len(prefix) :]}"] = value
        if not found and (merged or self.gated):  # never write an unmerged weight or a mis-sharded fc1
            raise RuntimeError(f"{prefix}: LoRA found no sharded tensor of the wrapped layer's weight")
        if merged:
            return state
        adapters = {"lora_a": self.lora_a, "lora_b": self.lora_b}
        axis = {"column": {"lora_b": 0}, "row": {"lora_a": 1}, "duplicated": {}}[self.parallel_kind]
        dp_cp_group = metadata.get("dp_cp_group") or parallel_state.get_data_parallel_group(
            with_context_parallel=True
        )
        sharded = make_sharded_tensors_for_checkpoint(
            adapters, prefix, axis, sharded_offsets, tp_group=self.tp_group, dp_cp_group=dp_cp_group
        )
        if self.gated:
            key = f"{prefix}lora_b"
            sharded[key] = apply_swiglu_sharded_factory(sharded[key], sharded_offsets, singleton)
        state.update(sharded)
        return state

    def merged_weight(self) -> torch.Tensor:
        """W + scale * B A for this rank's shard, computed in float32 (as `merge_adapter_tensors`),
        in W's dtype."""
        weight = self.base.weight
        return (weight.float() + self.scale * (self.lora_b.float() @ self.lora_a.float())).to(weight.dtype)


def apply_lora(
    model: nn.Module, rank: int, alpha: float, target_modules: tuple[str, ...] | None = None, seed: int = 0
) -> list[str]:
    """Wraps every target linear (`target_modules`, megatron's names; None: every linear of the
    model LoRA can wrap), freezes everything but the adapters (and a value head, if any). Each
    adapter's A is drawn from `seed` and the layer's name in the full model, so it is the same at
    every TP/EP/PP layout. A target that names no linear of the model is an error (ValueError
    naming lora.target_modules), never a silent no-op. Returns the wrapped module names."""
    known = COLUMN_PARALLEL + ROW_PARALLEL
    unknown = set(target_modules or ()) - set(known)
    if unknown:
        raise ValueError(f"lora.target_modules: unknown {sorted(unknown)} (choose from {known})")
    present = {name.split(".")[-1] for name, _ in model.named_modules()} & set(known)
    missing = sorted(set(target_modules or ()) - present)
    if missing:
        raise ValueError(
            f"lora.target_modules: {missing} name no linear of this model (it has {sorted(present)}); "
            "an adapter on nothing would leave what it names unadapted"
        )
    targets = set(target_modules) if target_modules is not None else present
    wrapped = []
    targets = [(name, module) for name, module in model.named_modules() if name.split(".")[-1] in targets]
    grouped = [
        name for name, module in targets if not isinstance(getattr(module, "weight", None), torch.Tensor)
    ]
    if grouped:
        raise ValueError(
            f"lora.target_modules: {grouped[0]} has no single weight (TE grouped-GEMM experts, "
            f"moe_grouped_gemm); LoRA adapts one linear at a time: target attention only "
            f"(linear_qkv, linear_proj) on this MoE model"
        )
    global_names = global_parameter_names(model)
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        kind = _parallel_kind(child, module, model.config)
        layer_seed = seed + zlib.crc32(global_names[f"{name}.weight"].encode())
        gated = child == "linear_fc1" and bool(model.config.gated_linear_unit)
        expert = ".experts." in f".{name}."  # SequentialMLP's local_experts (not shared experts)
        setattr(parent, child, LoRALinear(module, kind, rank, alpha, seed=layer_seed, gated=gated, expert=expert))
        wrapped.append(name)
    for name, param in model.named_parameters():
        param.requires_grad_(".lora_" in name or name.startswith("value_head."))
    return wrapped


def _parallel_kind(child: str, module: nn.Module, config) -> str:
    """"column", "row" or "duplicated" (an MLA down-projection whose weight holds its whole output
    on this rank: TE's duplicated TELinear, or any at TP = 1, where the kinds compute alike)."""
    if child in DOWN_PROJECTIONS:
        whole = config.q_lora_rank if child == "linear_q_down_proj" else config.kv_lora_rank + config.qk_pos_emb_head_dim
        if module.weight.shape[0] == whole:
            return "duplicated"
    return "column" if child in COLUMN_PARALLEL else "row"


@torch.no_grad()
def merge_lora(model: nn.Module) -> None:
    """Folds every adapter into its base weight and unwraps it (export, inference)."""
    for name, module in list(model.named_modules()):
        if isinstance(module, LoRALinear):
            module.base.weight.copy_(module.merged_weight())
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name), child, module.base)


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[int]:
    """Within the block the model is its base (every adapter skipped; yields how many); they are
    back after it, also on an exception. Changes no parameter: a frozen reference without a copy."""
    adapters = [m for m in model.modules() if isinstance(m, LoRALinear)]
    before = [m.enabled for m in adapters]
    for module in adapters:
        module.enabled = False
    try:
        yield len(adapters)
    finally:
        for module, enabled in zip(adapters, before):
            module.enabled = enabled


def merge_adapter_tensors(full: Mapping[str, torch.Tensor], alpha: float) -> dict[str, torch.Tensor]:
    """A full state dict of a LoRA-adapted model (gathered: `layer.weight`, `layer.lora_a`,
    `layer.lora_b`) as the plain model's: each adapted weight W + (alpha / rank) B A, in W's dtype
    (computed in float32), the adapters dropped; every other tensor as it is (not copied)."""
    out = {}
    for name, tensor in full.items():
        if name.endswith((".lora_a", ".lora_b")):
            continue
        layer = name[: -len(".weight")] if name.endswith(".weight") else None
        a, b = (full.get(f"{layer}.lora_a"), full.get(f"{layer}.lora_b")) if layer else (None, None)
        if (a is None) != (b is None):
            raise ValueError(f"{layer}: LoRA adapter lora_a without lora_b, or the reverse, in the state dict")
        if a is None:
            out[name] = tensor
            continue
        if b.shape[1] != a.shape[0] or (b.shape[0], a.shape[1]) != tuple(tensor.shape):
            raise ValueError(
                f"{layer}: adapters B {tuple(b.shape)} A {tuple(a.shape)} do not fit weight {tuple(tensor.shape)}"
            )
        delta = (alpha / a.shape[0]) * (b.float() @ a.float())
        out[name] = (tensor.float() + delta).to(tensor.dtype)
    orphans = [n for n in full if n.endswith((".lora_a", ".lora_b")) and n.rsplit(".", 1)[0] + ".weight" not in full]
    if orphans:
        raise ValueError(f"LoRA adapters without their layer's weight in the state dict: {orphans[:3]}")
    return out
