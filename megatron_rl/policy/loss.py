"""The policy's loss on one rank: its batch (`PolicyBatch`: what only the policy reads, next to
the fields every role shares), the log-probabilities it needs from forward-only passes (the KL
reference's, pi_old's with `old_logprobs: recompute`), and `policy_loss_func`, the
`algorithm.policy_loss` plus the reference KL and the entropy bonus, weighted per token by the
loss aggregation and the rollout correction.

`train_step` (trainer/step.py) builds each micro-batch's `PolicyBatch` with the loss's `batch`
builder; policy/update.py sets pi_old, the correction and aggregation weights on them first.

The KL reference is either a frozen model of its own (full fine-tuning: the initial weights,
policy/trainer.build_reference) or, for a LoRA policy, `AdaptersOff`: the policy's own model run
with every adapter skipped, which is the frozen base the adapters started from (B = 0), with no
second model in memory.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import megatron_rl.compat  # noqa: F401  (megatron-core on CPU needs its patches first)

import torch
from megatron.core import parallel_state
from torch.distributed import ReduceOp

from megatron_rl.algorithms.losses import Sequences, entropy_bonus, reference_kl_loss, top_k_distillation_loss
from megatron_rl.algorithms.registry import policy_loss_for
from megatron_rl.config import AlgorithmConfig
from megatron_rl.data.types import MicroBatch
from megatron_rl.models.logprobs import (
    megatron_vocab_parallel_logprobs,
    megatron_vocab_parallel_logprobs_and_top_k_kl,
)
from megatron_rl.trainer.batches import RankBatch, RowSlice
from megatron_rl.trainer.forward import forward_only
from megatron_rl.trainer.step import RoleLoss


@dataclass(kw_only=True)
class PolicyBatch(RankBatch):
    """A RankBatch with what the policy's loss reads, per next token ([n] this CP rank's slice)."""

    targets: torch.Tensor  # [n] the next token
    advantages: torch.Tensor  # [n] of the next token
    old_logprobs: torch.Tensor  # the ratio's denominator: the sampler's, or recomputed (policy/update.py)
    sampler_logprobs: torch.Tensor  # [n] the sampler's log-prob of the next token
    sequence_of_token: torch.Tensor  # [n] int64: the sequence (of the full row) each position is in
    owned_sequences: torch.Tensor  # [S] bool: the sequence's first token is on this CP rank
    minibatch: int = 0
    ref_logprobs: torch.Tensor | None = None  # the reference policy's, when KL is configured
    teacher_logprobs: torch.Tensor | None = None  # [n] the teacher's (distillation kl_penalty)
    # Distillation top_k_kl: the teacher's K most likely next tokens at each position ([n, K] int64)
    # and their log-probabilities ([n, K] float32); ids 0 and log-probabilities 0 off action tokens.
    teacher_top_ids: torch.Tensor | None = None
    teacher_top_logprobs: torch.Tensor | None = None
    # Per-token factors of the loss (None: 1): the loss aggregation's, and the rollout correction's
    # importance weights (the policy term only).
    aggregation_weights: torch.Tensor | None = None
    correction_weights: torch.Tensor | None = None
    normaliser: int | None = None  # this micro-batch's share of the global normaliser (None: action tokens)

    @property
    def num_sequences(self) -> int:
        return int(self.owned_sequences.shape[0])

    def loss_normaliser(self) -> torch.Tensor:
        """The loss aggregation's share when it set one (`normaliser`), else the action tokens."""
        if self.normaliser is None:
            return super().loss_normaliser()
        return torch.tensor(self.normaliser, dtype=torch.int, device=self.loss_mask.device)


def policy_batch(mb: MicroBatch, cp_rank: int = 0, cp_size: int = 1) -> PolicyBatch:
    """The next-token-aligned slice of `mb` for one CP rank, with the policy's fields; the ratio's
    denominator starts as the sampler's log-probs."""
    row = RowSlice(mb, cp_rank, cp_size)
    sampler_logprobs = row.next_token(mb.inference_logprobs, torch.float32, 0.0)
    top_k = {}
    if mb.teacher_top_ids is not None:
        top_k = dict(teacher_top_ids=row.next_token(mb.teacher_top_ids, torch.long, 0),
                     teacher_top_logprobs=row.next_token(mb.teacher_top_logprobs, torch.float32, 0.0))  # fmt: skip
    return PolicyBatch(
        **row.shared_fields(),
        targets=row.next_token(mb.input_ids, torch.long, 0),
        advantages=row.next_token(mb.advantages, torch.float32, 0.0),
        old_logprobs=sampler_logprobs,
        sampler_logprobs=sampler_logprobs,
        sequence_of_token=row.sequence_of_token(),
        owned_sequences=row.owned_sequences(),
        minibatch=mb.minibatch,
        teacher_logprobs=None if mb.teacher_logprobs is None else row.next_token(mb.teacher_logprobs, torch.float32, 0.0),
        **top_k,
    )


def forward_logprobs(model, batches: list[PolicyBatch], temperature: float = 1.0, hooks=()) -> list | None:
    """Forward-only log-probabilities of every batch's next tokens under `model`'s
    softmax(logits / temperature), detached: a list on the last pipeline stage (where losses are
    computed), None on the others. `hooks` take part in the pass (routing replay's: the policy's
    pi_old; none for a reference, which routes by its own router)."""
    outputs = forward_only(
        model,
        batches,
        lambda logits, batch: megatron_vocab_parallel_logprobs(logits[0], batch.targets, temperature)[0],
        hooks,
    )
    return None if outputs is None else [logprobs.detach() for logprobs in outputs]


@contextmanager
def reference_model(reference) -> Iterator[torch.nn.Module]:
    """The model the reference's log-probabilities come from: a frozen reference model itself, or
    the model a transform's frozen reference (`ModelTransform.frozen_reference`: LoRA's
    `AdaptersOff`) makes active for the block."""
    if isinstance(reference, torch.nn.Module):
        yield reference
    else:
        with reference.active() as model:
            yield model


def set_reference_logprobs(reference, batches: list[PolicyBatch], temperature: float = 1.0) -> None:
    """The frozen `reference`'s log-probabilities (`forward_logprobs`) into every batch's
    `ref_logprobs`: a reference model's, or a LoRA policy's with its adapters off (`AdaptersOff`)."""
    with reference_model(reference) as model:
        for batch, logprobs in zip(batches, forward_logprobs(model, batches, temperature) or []):
            batch.ref_logprobs = logprobs


def cp_reduce(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """`tensor` summed (op "sum") or maximised ("max") in place over this rank's CP group."""
    if parallel_state.get_context_parallel_world_size() == 1:
        return tensor
    reduce_op = ReduceOp.SUM if op == "sum" else ReduceOp.MAX
    torch.distributed.all_reduce(tensor, op=reduce_op, group=parallel_state.get_context_parallel_group())
    return tensor


def batch_sequences(batch: PolicyBatch) -> Sequences:
    """The batch's row of sequences for a policy loss, with sums over the CP group."""
    return Sequences(batch.cu_seqlens, batch.sequence_of_token, batch.num_sequences, cp_reduce)


def policy_loss_func(
    config: AlgorithmConfig, temperature: float = 1.0, teacher_coef: float = 0.0, teacher_top_k_coef: float = 0.0
) -> RoleLoss:
    """`algorithm.policy_loss` (registry.policy_loss_for) on vocab-parallel log-probabilities of
    softmax(logits / temperature) of the next tokens, plus `kl_coef` * KL(policy || reference)
    per action token (`kl_estimator`) when `algorithm.kl_coef` > 0 (the batch then carries
    reference log-probabilities: `set_reference_logprobs`), plus `teacher_coef` * the same
    estimator against the teacher's log-probabilities from the grid (on-policy distillation's
    kl_penalty; metric `teacher_kl`), plus `teacher_top_k_coef` * the forward KL of the teacher's
    top k from the policy's softmax over the whole vocabulary, sum_j p_T(j) (log p_T(j) - log
    pi(j)) per action token (distillation's top_k_kl; metrics `teacher_top_k_kl` and
    `teacher_top_k_mass`, the top k's share of the teacher's probability), minus `entropy_coef` *
    entropy. A batch with the teacher's top k gets its log-probabilities, entropy and top-k KL from
    one kernel (`vocab_parallel_logprobs_and_top_k_kl`: one logits-sized gradient); the others
    from `vocab_parallel_logprobs`.
    Each term is weighted per token by the batch's `aggregation_weights`; the policy term also by
    its `correction_weights` (rollout correction). On `PolicyBatch`es (`policy_batch`). A batch
    with action tokens but without the teacher's arrays a coefficient needs is a ValueError; one
    without action tokens (a dummy) adds 0 to each term and its metrics."""
    objective, kl_coef, entropy_coef = policy_loss_for(config), config.kl_coef, config.entropy_coef

    def loss(logits: torch.Tensor, batch: PolicyBatch):
        check_teacher_arrays(batch, teacher_coef, teacher_top_k_coef)
        # [1, n, V] -> [n, V] as a view whose backward is a view too (logits[0]'s backward writes
        # a second logits-sized gradient: zeros, then the kernel's copied in).
        rows = logits.squeeze(0)
        # With the teacher's top k, one kernel gives the log-probs, entropy and top-k KL, so that
        # the backward pass writes one logits-sized gradient, not one per term.
        top_k = teacher_top_k_coef > 0 and batch.teacher_top_ids is not None and batch.teacher_top_logprobs is not None
        if top_k:
            logprobs, entropy, top_k_kl, top_k_mass = megatron_vocab_parallel_logprobs_and_top_k_kl(
                rows, batch.targets, batch.teacher_top_ids, batch.teacher_top_logprobs, temperature
            )
        else:
            logprobs, entropy = megatron_vocab_parallel_logprobs(rows, batch.targets, temperature)
        aggregation, correction = batch.aggregation_weights, batch.correction_weights
        policy_weights = (
            correction
            if aggregation is None
            else (aggregation if correction is None else aggregation * correction)
        )
        loss_sum, metrics = objective(logprobs, batch.old_logprobs, batch.advantages, batch.loss_mask,
                                      sequences=batch_sequences(batch), weights=policy_weights)  # fmt: skip
        metrics = {k: v for k, v in metrics.items() if k.endswith("_sum")}
        metrics["entropy_sum"] = (entropy.detach() * batch.loss_mask).sum().to(torch.float64)
        if kl_coef > 0:
            if batch.ref_logprobs is None:
                raise ValueError(
                    "policy loss: kl_coef > 0 needs reference log-probabilities (set_reference_logprobs)"
                )
            kl_sum, kl_metrics = reference_kl_loss(logprobs, batch.ref_logprobs, batch.loss_mask,
                                                   config.kl_estimator, aggregation)  # fmt: skip
            loss_sum = loss_sum + kl_coef * kl_sum
            metrics.update(kl_metrics)
        # Every rank reports the teacher's metric sums, zero for a batch without its arrays: the
        # reduction over data ranks needs the same names on each (a rank may hold only dummies).
        zero = torch.zeros((), dtype=torch.float64, device=logprobs.device)
        if teacher_coef > 0:
            metrics["teacher_kl_sum"] = zero
            if batch.teacher_logprobs is not None:
                teacher_sum, teacher_metrics = reference_kl_loss(logprobs, batch.teacher_logprobs, batch.loss_mask,
                                                                 config.kl_estimator, aggregation)  # fmt: skip
                loss_sum = loss_sum + teacher_coef * teacher_sum
                metrics["teacher_kl_sum"] = teacher_metrics["kl_ref_sum"]
        if teacher_top_k_coef > 0:
            metrics.update(teacher_top_k_kl_sum=zero, teacher_top_k_mass_sum=zero)
            if top_k:
                top_k_sum, top_k_metrics = top_k_distillation_loss(top_k_kl, top_k_mass, batch.loss_mask, aggregation)
                loss_sum = loss_sum + teacher_top_k_coef * top_k_sum
                metrics.update(top_k_metrics)
        if entropy_coef > 0:
            loss_sum = loss_sum - entropy_coef * entropy_bonus(entropy, batch.loss_mask, aggregation)
        return loss_sum, metrics

    return RoleLoss(batch=policy_batch, loss=loss)


def check_teacher_arrays(batch: PolicyBatch, teacher_coef: float, teacher_top_k_coef: float) -> None:
    """Raises ValueError naming the distillation mode when the batch has action tokens but not
    the teacher's arrays its coefficient needs (the orchestrator packs them only in that mode)."""
    needs_logprobs = teacher_coef > 0 and batch.teacher_logprobs is None
    needs_top_k = teacher_top_k_coef > 0 and (batch.teacher_top_ids is None or batch.teacher_top_logprobs is None)
    if not (needs_logprobs or needs_top_k) or not bool(batch.loss_mask.any()):
        return
    if needs_logprobs:
        raise ValueError("policy loss: distillation kl_penalty needs the teacher's log-probabilities in the grid")
    if needs_top_k:
        raise ValueError(
            "policy loss: distillation top_k_kl needs the teacher's top-k ids and log-probabilities in the grid "
            "(teacher_top_ids, teacher_top_logprobs); the orchestrator packs them only with distillation.mode "
            "top_k_kl: give both the same resolved config"
        )
