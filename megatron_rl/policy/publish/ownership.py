"""Which rank publishes which of the policy's HF tensors, the same for both publishing paths:
TP shards are gathered; then one rank per pipeline stage owns that stage's non-expert tensors and
one rank per (stage, expert-parallel rank) its experts, so nothing else crosses processes.

A LoRA policy (`lora`) publishes merged weights: the inference servers serve a plain model, so
each owner folds the adapters of its gathered layers into their weights, W + (alpha / rank) B A
(transforms/lora.merge_adapter_tensors), and publishes them under the plain HF names; no adapter
tensor is ever published."""

from __future__ import annotations

import megatron_rl.compat  # noqa: F401  (megatron-core on CPU needs its patches first)

from megatron.core import parallel_state as ps

from megatron_rl.config import Architecture
from megatron_rl.conversion.hf_mapping import megatron_to_hf
from megatron_rl.models.sharding import gather_full_parameters
from megatron_rl.transforms.lora import merge_adapter_tensors
from megatron_rl.transforms.peft import is_adapter


def writer_roles() -> tuple[bool, bool, str]:
    """(writes non-expert tensors, writes expert tensors, file tag) for this rank."""

    stage = ps.get_pipeline_model_parallel_rank()
    dense = (
        ps.get_tensor_model_parallel_rank() == 0
        and ps.get_data_parallel_rank(with_context_parallel=True) == 0
    )
    experts = ps.get_expert_tensor_parallel_rank() == 0 and ps.get_expert_data_parallel_rank() == 0
    return dense, experts, f"pp{stage:03d}-ep{ps.get_expert_model_parallel_rank():03d}"


def owned_hf_tensors(model, arch: Architecture, lora_alpha: float | None = None) -> dict:
    """Collective: the HF-named tensors this rank is responsible for publishing (TP shards
    gathered; one rank per pipeline stage owns its non-expert tensors, one rank per (stage,
    expert-parallel rank) its experts); empty on other ranks. A LoRA-adapted model's weights
    are merged with `lora_alpha` (the config's `lora.alpha`; a ValueError without it)."""
    # The live parameters where nothing is gathered: publishing reads them before the next
    # optimizer step changes them, so a clone of every parameter would only cost memory.
    full = gather_full_parameters(model, copy=False)
    writes_dense, writes_experts, _ = writer_roles()
    mine = {
        k: v
        for k, v in full.items()
        if (".experts." in k and writes_experts) or (".experts." not in k and writes_dense)
    }
    if any(is_adapter(k) for k in mine):
        if lora_alpha is None:
            raise ValueError(
                "publishing a LoRA-adapted policy needs lora.alpha to merge its adapters into the weights "
                "(make_publisher passes the config's); none was given"
            )
        mine = merge_adapter_tensors(mine, lora_alpha)
    return megatron_to_hf(mine, arch, partial=True)
