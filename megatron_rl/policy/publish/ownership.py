"""Which rank publishes which of the policy's HF tensors, the same for both publishing paths:
TP shards are gathered; then one rank per pipeline stage owns that stage's non-expert tensors and
one rank per (stage, expert-parallel rank) its experts, so nothing else crosses processes.

A policy with model transforms publishes merged weights: the inference servers serve a plain
model, so each owner folds the transforms' tensors of its gathered layers into their weights with
the transforms' `merge` (transforms/base.merged; LoRA's W + (alpha / rank) B A) and publishes them
under the plain HF names; no adapter tensor is ever published this way."""

from __future__ import annotations

from collections.abc import Callable

import megatron_rl.compat  # noqa: F401  (megatron-core on CPU needs its patches first)

from megatron.core import parallel_state as ps

from megatron_rl.config import Architecture
from megatron_rl.conversion.hf_mapping import megatron_to_hf
from megatron_rl.models.sharding import gather_full_parameters
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


def owned_hf_tensors(model, arch: Architecture, merge: Callable[[dict], dict] | None = None) -> dict:
    """Collective: the HF-named tensors this rank is responsible for publishing (TP shards
    gathered; one rank per pipeline stage owns its non-expert tensors, one rank per (stage,
    expert-parallel rank) its experts); empty on other ranks. A transformed model's weights are
    merged with `merge` (the model's transforms', transforms/base.merged; a ValueError when
    adapters are left)."""
    # The live parameters where nothing is gathered: publishing reads them before the next
    # optimizer step changes them, so a clone of every parameter would only cost memory.
    full = gather_full_parameters(model, copy=False)
    writes_dense, writes_experts, _ = writer_roles()
    mine = {
        k: v
        for k, v in full.items()
        if (".experts." in k and writes_experts) or (".experts." not in k and writes_dense)
    }
    if merge is not None:
        mine = merge(mine)
    if left := [k for k in mine if is_adapter(k)]:
        raise ValueError(
            f"publishing the policy's weights: adapter tensors ({left[0]}, ...) were not merged into them; "
            "publish with the model's transforms' merge (make_publisher passes it)"
        )
    return megatron_to_hf(mine, arch, partial=True)
