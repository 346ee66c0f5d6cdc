"""Forward-only passes over a rank's batches, any pipeline size (no gradients, no optimizer).

`forward_only(model, batches, output_fn, hooks)` runs `model` on every RankBatch (megatron's
forward-only schedule when PP > 1) and returns `[output_fn(output, batch), ...]` on the last
pipeline stage, None on other stages. Used for critic scoring and reference-policy log-probabilities.

`hooks` take part in a pass explicitly (a model transform's `pass_hook`: routing replay's
ModelRouting, which then replays each batch's routes): `passes(hooks, training)` is around the
whole pass, each hook's `set_batch(batch)` before each micro-batch (`run_batch`); the training
step does the same with `Trainable.hooks`. A pass given no hook runs the model as it is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager

import megatron_rl.compat  # noqa: F401  (megatron-core on CPU needs its patches first)

import torch
from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_rl.models.attention import packed_seq_params
from megatron_rl.trainer.batches import RankBatch


@contextmanager
def passes(hooks: Sequence, training: bool) -> Iterator[None]:
    """Every hook's `forward_pass(training)` around one pass over a list of micro-batches."""
    with ExitStack() as stack:
        for hook in hooks:
            stack.enter_context(hook.forward_pass(training))
        yield


def run_batch(model, batch: RankBatch, hooks: Sequence = ()):
    """The model's output on one batch, each hook given the batch first."""
    for hook in hooks:
        hook.set_batch(batch)
    return model(
        batch.input_ids,
        batch.position_ids,
        attention_mask=None,
        packed_seq_params=packed_seq_params(batch.cu_seqlens, batch.total_tokens),
    )


@torch.no_grad()
def forward_only(model, batches: list[RankBatch], output_fn: Callable, hooks: Sequence = ()) -> list | None:
    with passes(hooks, training=False):
        return _forward_only(model, batches, output_fn, hooks)


def _forward_only(model, batches: list[RankBatch], output_fn: Callable, hooks: Sequence) -> list | None:
    if ps.get_pipeline_model_parallel_world_size() == 1:
        return [output_fn(run_batch(model, batch, hooks), batch) for batch in batches]

    def forward_step(data_iterator, chunk):
        batch = next(data_iterator)
        return run_batch(chunk, batch, hooks), lambda out, non_loss_data=True: output_fn(out, batch)

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
