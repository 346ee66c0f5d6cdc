"""One optimizer step over this rank's micro-batches, through megatron's forward-backward
schedule (any PP size), with the loss normalised by a global count: what both roles' training
shares. The losses themselves are the roles' (policy/loss.py, critic/loss.py).

A role's loss is a `RoleLoss`: `batch(mb, cp_rank, cp_size)` builds this rank's batch of the
kind the loss reads (a RankBatch extended with the role's fields), and calling it on (model
output, batch) returns the *sum* of per-token losses over the micro-batch's loss tokens and its
metrics. With `calculate_per_token_loss` megatron all-reduces the normaliser (each batch's
`loss_normaliser()`: the action-token count, or what a loss aggregation sets) over DP x CP and
divides every gradient by it, and DDP sums instead of averaging. Dummy micro-batches have no loss
tokens and contribute exactly zero.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import megatron_rl.compat  # noqa: F401  (megatron-core on CPU needs its patches first)

import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func
from torch.distributed import ReduceOp

from megatron_rl.data.types import MicroBatch
from megatron_rl.faults import kill_point
from megatron_rl.parallel import any_rank, collective_device
from megatron_rl.trainer.batches import RankBatch
from megatron_rl.trainer.forward import passes, run_batch
from megatron_rl.trainer.optimizer import Trainable, freeze_non_head_groups
from megatron_rl.transport.broadcast import broadcast_bytes

LossFunc = Callable[[torch.Tensor, RankBatch], tuple[torch.Tensor, dict]]


@dataclass(frozen=True)
class RoleLoss:
    """A role's loss: `batch` builds one rank's batch of a MicroBatch (the kind `loss` reads),
    `loss(output, batch)` -> (loss_sum, metrics); calling the RoleLoss calls `loss`."""

    batch: Callable[[MicroBatch, int, int], RankBatch]
    loss: LossFunc

    def __call__(self, output: torch.Tensor, batch: RankBatch) -> tuple[torch.Tensor, dict]:
        return self.loss(output, batch)


def train_step(trainable: Trainable, micro_batches: list[MicroBatch], loss_func: RoleLoss) -> dict:
    """Forward/backward over every micro-batch, one optimizer and scheduler step: this rank's
    part of each micro-batch (its CP slice, built by `loss_func.batch`) through
    `train_on_batches`, which says what it returns."""
    cp_rank = parallel_state.get_context_parallel_rank()
    cp_size = parallel_state.get_context_parallel_world_size()
    return train_on_batches(
        trainable, [loss_func.batch(mb, cp_rank, cp_size) for mb in micro_batches], loss_func
    )


def train_on_batches(trainable: Trainable, batches: list[RankBatch], loss_func: LossFunc) -> dict:
    """One optimizer and scheduler step over this rank's prepared batches.

    Every micro-batch's forward takes part in `trainable.hooks` (trainer/forward.py `passes`).
    Returns {"loss": global loss (sum / global normaliser), "num_tokens": global action-token
    count, "grad_norm", "update_successful", plus the loss functions' summed metrics}, identical
    on every rank. The optimizer step's seconds add up in `trainable.optimizer_step_s` (this
    rank's; the roles report them per training step, trainer/role.py).
    """
    for chunk in trainable.model:
        if not chunk.config.calculate_per_token_loss:
            raise ValueError("train_step needs a model built by build_trainable (calculate_per_token_loss)")
        chunk.zero_grad_buffer()
    trainable.optimizer.zero_grad()
    if trainable.gradients is not None:
        trainable.gradients.reset()

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        output = run_batch(model, batch, trainable.hooks)

        def loss(output_tensor):
            loss_sum, metrics = loss_func(output_tensor, batch)
            normaliser = batch.loss_normaliser()
            reported = {
                "loss_sum": loss_sum.detach().clone(),
                "normaliser_sum": normaliser.double(),
                **metrics,
            }
            return loss_sum, normaliser, reported

        return output, loss

    with passes(trainable.hooks, training=True):
        reported = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(batches),
            model=trainable.model,
            num_microbatches=len(batches),
            seq_length=max(b.input_ids.shape[1] for b in batches),
            micro_batch_size=1,
            forward_only=False,
        )
    kill_point("train.backward")
    if trainable.gradients is not None:  # a parameter that trains and got no gradient: an error, not a no-op
        trainable.gradients.check()
    if trainable.head_only:
        freeze_non_head_groups(trainable)
    lr = trainable.optimizer.param_groups[0]["lr"]
    if all_finite(trainable, reported):
        started = time.perf_counter()
        update_successful, grad_norm, _ = trainable.optimizer.step()
        trainable.optimizer_step_s += time.perf_counter() - started
        trainable.scheduler.step(1)
    else:  # never write NaN/inf into the weights: drop this step's gradients, keep the weights
        trainable.optimizer.zero_grad()
        for chunk in trainable.model:
            chunk.zero_grad_buffer()
        trainable.skipped_steps += 1
        update_successful, grad_norm = False, None
    metrics = _reduce_metrics(reported, batches)
    metrics.update(
        grad_norm=float(grad_norm) if grad_norm is not None else None,
        update_successful=bool(update_successful),
        skipped_steps=trainable.skipped_steps,
        lr=lr,
    )
    return metrics


def gradients_finite(grads) -> bool:
    """Whether every element of `grads` is finite, without a tensor of the gradients' size (a
    bool mask of a 30B model's gradient buffer is gigabytes): NaN and inf propagate into the
    sum. A sum that overflows float32 also reads as non-finite; those gradients (|g| ~ 1e29 and
    more) would make the gradient norm infinite anyway."""
    return all(bool(torch.isfinite(g.sum())) for g in grads if g is not None)


def all_finite(trainable: Trainable, reported: list[dict]) -> bool:
    """Whether this step's loss and every gradient are finite on every rank of the role (one
    all-reduce of a flag). Checks megatron's contiguous gradient buffers, so it costs one pass
    over the gradients; a non-finite gradient anywhere makes the reduced gradients non-finite."""
    finite = all(
        bool(torch.isfinite(torch.as_tensor(r["loss_sum"])).all()) for r in reported if "loss_sum" in r
    )
    for chunk in trainable.model:
        buffers = [*getattr(chunk, "buffers", []), *getattr(chunk, "expert_parallel_buffers", [])]
        grads = [b.grad_data for b in buffers] if buffers else [
            getattr(p, "main_grad", p.grad) for p in chunk.parameters() if p.requires_grad
        ]  # fmt: skip
        finite = finite and gradients_finite(grads)
    return not any_rank(not finite)  # on the collective device: a CPU tensor fails under NCCL


def _reduce_metrics(reported: list[dict], batches: list[RankBatch]) -> dict:
    """Sums the per-micro-batch statistics over this rank, then over DP x CP (the last PP stage's
    values are broadcast), so every rank returns the same numbers."""
    keys = {k for r in reported for k in r if k.endswith("_sum") or k == "num_tokens"}
    local = {k: sum(float(r[k]) for r in reported if k in r) for k in keys}
    local["num_tokens"] = float(sum(int(b.loss_mask.sum()) for b in batches))
    metrics = reduce_statistics(local)
    metrics["loss"] = metrics.pop("loss_sum") / max(metrics.pop("normaliser_sum"), 1.0)
    return metrics


def reduce_statistics(local: dict[str, float]) -> dict[str, float]:
    """Per-rank statistics reduced over the role's DP x CP ranks: sums, except keys ending in
    `_max` (maxima) and `_min` (minima). Only the last pipeline stage's statistics count (it
    computed the losses): it sends the names and values to the other stages, so every rank
    returns the same numbers."""
    keys = sorted(local)
    pipelined = parallel_state.get_pipeline_model_parallel_world_size() > 1
    if pipelined:
        last = parallel_state.get_pipeline_model_parallel_last_rank()
        group = parallel_state.get_pipeline_model_parallel_group()
        sent = "\n".join(keys).encode() if torch.distributed.get_rank() == last else None
        keys = [k for k in broadcast_bytes(sent, last, group, collective_device()).decode().split("\n") if k]
    values = torch.tensor(
        [float(local.get(k, 0.0)) for k in keys], dtype=torch.float64, device=collective_device()
    )
    if pipelined:
        torch.distributed.broadcast(values, src=last, group=group)
    dp_cp = parallel_state.get_data_parallel_group(with_context_parallel=True)
    for op in (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.MIN):
        indices = [i for i, key in enumerate(keys) if _reduce_op(key) == op]
        if indices:
            part = values[indices]  # a copy (advanced indexing)
            torch.distributed.all_reduce(part, op=op, group=dp_cp)
            values[indices] = part
    return dict(zip(keys, values.tolist()))


def _reduce_op(key: str):
    return ReduceOp.MAX if key.endswith("_max") else ReduceOp.MIN if key.endswith("_min") else ReduceOp.SUM
