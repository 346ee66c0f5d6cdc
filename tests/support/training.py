"""One policy training step with a KL reference, for tests that train a model outside the
policy trainer: what `PolicyTrainer`'s update does before each mini-batch (the reference's
log-probabilities into every batch), then `train_on_batches`."""

from __future__ import annotations

from megatron.core import parallel_state

from megatron_rl.policy.loss import set_reference_logprobs
from megatron_rl.trainer.step import train_on_batches


def train_step_with_reference(trainable, micro_batches, loss_func, reference=None, temperature: float = 1.0) -> dict:
    """`train_step` with a policy loss (policy/loss.py `policy_loss_func`), with `reference` (a
    frozen model of the same layout, or None) first setting `batch.ref_logprobs` of
    softmax(logits / temperature) on the last pipeline stage."""
    cp_rank = parallel_state.get_context_parallel_rank()
    cp_size = parallel_state.get_context_parallel_world_size()
    batches = [loss_func.batch(mb, cp_rank, cp_size) for mb in micro_batches]
    if reference is not None:
        set_reference_logprobs(reference, batches, temperature)
    return train_on_batches(trainable, batches, loss_func)
