"""Forward-only passes over a rank's batches, any pipeline size (no gradients, no optimizer).

`forward_only(model, batches, output_fn)` runs `model` on every RankBatch (megatron's forward-
only schedule when PP > 1) and returns `[output_fn(output, batch), ...]` on the last pipeline
stage, None on other stages. Used for critic scoring and reference-policy log-probabilities.
A model with routing replay (transforms/routing.py) replays each batch's routes.
"""

from __future__ import annotations

from collections.abc import Callable

import megatron_rl.compat  # noqa: F401  (megatron-core on CPU needs its patches first)

import torch
from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_rl.models.attention import packed_seq_params
from megatron_rl.trainer.batches import RankBatch
from megatron_rl.transforms.routing import routing_pass, set_batch_routes


def _run(model, batch: RankBatch):
    set_batch_routes(model, batch)
    return model(
        batch.input_ids,
        batch.position_ids,
        attention_mask=None,
        packed_seq_params=packed_seq_params(batch.cu_seqlens, batch.total_tokens),
    )


@torch.no_grad()
def forward_only(model, batches: list[RankBatch], output_fn: Callable) -> list | None:
    with routing_pass(model, training=False):
        return _forward_only(model, batches, output_fn)


def _forward_only(model, batches: list[RankBatch], output_fn: Callable) -> list | None:
    if ps.get_pipeline_model_parallel_world_size() == 1:
        return [output_fn(_run(model, batch), batch) for batch in batches]

    def forward_step(data_iterator, chunk):
        batch = next(data_iterator)
        return _run(chunk, batch), lambda out, non_loss_data=True: output_fn(out, batch)

    outputs = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(batches),
        model=[model],
        num_microbatches=len(batches),
        seq_length=max(b.input_ids.shape[1] for b in batches),
        micro_batch_size=1,
        forward_only=True,
        collect_non_loss_data=True,
    )
    return outputs if ps.is_pipeline_last_stage() else None
