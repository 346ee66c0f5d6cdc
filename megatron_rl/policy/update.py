"""One RL step of the policy: `policy_minibatches` x `policy_epochs` optimizer steps over the step's
mini-batches, before the new version is published.

Order, on this rank's grid item (the micro-batches of every mini-batch, `MicroBatch.minibatch`):

0. the grid item is checked to be cut into the configured mini-batches (`check_minibatches`):
   a grid cut otherwise is an error before anything of the step runs;
1. the KL reference's log-probabilities (`algorithm.kl_coef` > 0), once for all mini-batches;
2. `old_logprobs: recompute`: one forward-only pass of the policy over every micro-batch before the
   first update gives pi_old (the ratio's denominator); the sampler's log-probs stay for the
   mismatch metrics and the rollout correction (algorithms/rollout_correction.py), whose weights
   and rejections are set here, once;
3. the loss aggregation's per-token weights and normalisers (algorithms/aggregation.py), over the
   token masks left after rejection;
4. for each epoch, for each mini-batch in order: one `train_on_batches` (each normalised by its
   own global count).

With `algorithm.routing_replay` on, every policy forward of the step (pi_old, each training
forward and its recomputation in the backward) replays the sampler's routes (transforms/routing.py),
and the step's metrics carry the router's agreement with the sampler's, measured on the weights
that sampled (`measured`). The KL reference routes by its own router.

Every log-prob is of softmax(logits / T), T = `orchestrator.temperature`, the distribution the
samples were drawn from. `policy_minibatches = policy_epochs = 1` with `sampler` is one
train_step on the grid item.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass

import megatron_rl.compat  # noqa: F401  (megatron-core on CPU needs its patches first)

import numpy as np
import torch
from megatron.core import parallel_state

from megatron_rl.algorithms import aggregation, rollout_correction
from megatron_rl.config import AlgorithmConfig, ResolvedConfig
from megatron_rl.data.types import MicroBatch
from megatron_rl.faults import kill_point
from megatron_rl.parallel import collective_device
from megatron_rl.policy.loss import (
    PolicyBatch,
    cp_reduce,
    forward_logprobs,
    policy_batch,
    policy_loss_func,
    set_reference_logprobs,
)
from megatron_rl.trainer.optimizer import Trainable
from megatron_rl.trainer.step import reduce_statistics, train_on_batches
from megatron_rl.transforms.routing import ModelRouting


@dataclass(frozen=True)
class UpdateSettings:
    algorithm: AlgorithmConfig
    temperature: float = 1.0  # orchestrator.temperature: the training samples' sampling temperature
    loss_scale_factor: int | None = None  # seq-mean-token-sum-norm's divisor (resolved default)
    teacher_coef: float = 0.0  # distillation kl_penalty's coef: the teacher's term of the loss
    teacher_top_k_coef: float = 0.0  # distillation top_k_kl's coef: the teacher's top-k KL term

    @classmethod
    def from_config(cls, resolved: ResolvedConfig) -> UpdateSettings:
        algorithm, distillation = resolved.algorithm, resolved.distillation
        scale = algorithm.loss_scale_factor or resolved.orchestrator.max_completion_tokens
        mode = distillation.mode if distillation is not None else None
        teacher = distillation.coef if mode == "kl_penalty" else 0.0
        top_k = distillation.coef if mode == "top_k_kl" else 0.0
        return cls(algorithm, resolved.orchestrator.temperature, scale, teacher, top_k)


def is_last_stage() -> bool:
    return parallel_state.is_pipeline_last_stage()


def token_views(batches: list[PolicyBatch]) -> list[rollout_correction.TokenView]:
    return [
        rollout_correction.TokenView(
            log_ratio=torch.where(b.loss_mask, b.old_logprobs.double() - b.sampler_logprobs.double(), 0.0),
            mask=b.loss_mask,
            sequence_of_token=b.sequence_of_token,
            num_sequences=b.num_sequences,
            owned=b.owned_sequences,
        )
        for b in batches
    ]


def recompute_old_logprobs(model, batches: list[PolicyBatch], temperature: float, hooks=()) -> None:
    """pi_old: the policy's own log-probabilities before the step's first update, into every
    batch's `old_logprobs` (last pipeline stage); `hooks` as in training (`Trainable.hooks`)."""
    for batch, logprobs in zip(batches, forward_logprobs(model, batches, temperature, hooks) or []):
        batch.old_logprobs = logprobs


def correct_rollouts(settings: UpdateSettings, batches: list[PolicyBatch]) -> dict:
    """Sets rollout-correction weights and rejections on `batches` (last stage) and returns the
    mismatch and correction statistics reduced over the role (every rank)."""
    config = settings.algorithm.rollout_correction
    local: dict[str, float] = {}
    if is_last_stage():
        views = token_views(batches)
        corrections, sums = rollout_correction.apply(config, views, cp_reduce)
        for batch, correction in zip(batches, corrections):
            batch.correction_weights = correction.weights
            batch.loss_mask = correction.keep
        if config is not None and config.rollout_is is not None and config.rollout_is_batch_normalize:
            weights = [b.correction_weights for b in batches]
            terms = rollout_correction.batch_mean_terms(config, views, weights, cp_reduce)
            mean = reduce_statistics({"weight_sum": float(terms[0]), "count_sum": float(terms[1])})
            factor = mean["weight_sum"] / mean["count_sum"] if mean["count_sum"] else 1.0
            factor = factor if factor > 1e-8 else 1.0
            for batch in batches:
                batch.correction_weights = batch.correction_weights / factor
            sums["rollout_is_batch_norm_factor_max"] = torch.tensor(factor, dtype=torch.float64)
        local = {key: float(value) for key, value in sums.items()}
    elif config is not None and config.rollout_is is not None and config.rollout_is_batch_normalize:
        reduce_statistics({})  # matches the last stage's batch-mean reduction
    reduced = reduce_statistics(local)
    summary = rollout_correction.summarise(reduced)
    if "rollout_is_batch_norm_factor_max" in reduced:
        summary["rollout_is_batch_norm_factor"] = reduced["rollout_is_batch_norm_factor_max"]
    return summary


def set_aggregation(settings: UpdateSettings, batches: list[PolicyBatch]) -> None:
    """The loss aggregation's per-token weights and normalisers (last stage; token-mean needs
    neither: the normaliser is the action-token count)."""
    mode = settings.algorithm.loss_aggregation
    if mode == "token-mean" or not is_last_stage():
        return
    # Action tokens of each whole sequence (all CP ranks), after rejection.
    counts = [torch.zeros(b.num_sequences, dtype=torch.float64, device=b.loss_mask.device).index_add_(
        0, b.sequence_of_token, b.loss_mask.double()) for b in batches]  # fmt: skip
    if counts:
        reduced = torch.split(cp_reduce(torch.cat(counts), "sum"), [b.num_sequences for b in batches])
    else:
        reduced = []
    for batch, sequence_tokens in zip(batches, reduced):
        batch.aggregation_weights = aggregation.token_weights(
            mode, batch.loss_mask, batch.sequence_of_token, sequence_tokens
        )
        owned = int((batch.owned_sequences & (sequence_tokens > 0)).sum())
        batch.normaliser = aggregation.normaliser(mode, batch.loss_mask, owned, settings.loss_scale_factor)


def minibatch_groups(batches: list[PolicyBatch]) -> list[list[PolicyBatch]]:
    """This rank's batches grouped by mini-batch, in order (the packer gives every data rank the
    same number of micro-steps per mini-batch)."""
    groups: dict[int, list[PolicyBatch]] = {}
    for batch in batches:
        groups.setdefault(batch.minibatch, []).append(batch)
    return [groups[k] for k in sorted(groups)]


def step_samples(micro_batches: list[MicroBatch]) -> int:
    """The step's number of samples: those in this rank's grid item, summed over the data-parallel
    group (each sample goes to one data rank; its CP and TP ranks receive the same item)."""
    local = len({int(i) for mb in micro_batches for i in np.unique(mb.sample_index) if i >= 0})
    if not torch.distributed.is_initialized():
        return local
    count = torch.tensor([local], dtype=torch.int64, device=collective_device())
    torch.distributed.all_reduce(count, group=parallel_state.get_data_parallel_group())
    return int(count.item())


def check_minibatches(micro_batches: list[MicroBatch], configured: int) -> None:
    """Raises ValueError naming `algorithm.policy_minibatches` and both counts unless this rank's
    grid item is cut into mini-batches 0..N-1, N = `configured`, or, for a step with fewer samples
    than N, into one per sample (the orchestrator cuts min(N, samples) parts, at least one). Every
    data rank receives the same cut, so all of them take the same branch (the sample count is one
    all-reduce, made only when the cut has fewer than N parts)."""
    found = sorted({mb.minibatch for mb in micro_batches})
    if found == list(range(configured)):
        return
    samples = None
    if found == list(range(len(found))) and len(found) < configured:
        samples = step_samples(micro_batches)
        if len(found) == max(samples, 1):
            return
    counted = f" from {samples} samples" if samples is not None else ""
    raise ValueError(
        f"algorithm.policy_minibatches is {configured}, but the policy grid of this step is cut into "
        f"{len(found)} mini-batches{counted} (indices {found}); the orchestrator cuts min(policy_minibatches, "
        "samples), so it and the policy trainer run with different configs: give both the same resolved config"
    )


def policy_update(
    trainable: Trainable, micro_batches: list[MicroBatch], settings: UpdateSettings, reference=None
) -> dict:
    """Every optimizer step of one RL step; returns the step's metrics (identical on every rank):
    `optimizer_steps`, the loss and ratio statistics over all updates and of the first and the
    last, the mismatch between the trainer's pre-update log-probs and the sampler's, the
    rollout-correction statistics, and the time split (`time`: reference, recompute (the forward
    pass), correction (the mismatch metrics and rollout correction), train). A grid item cut into
    other mini-batches than `algorithm.policy_minibatches` makes is a ValueError
    (`check_minibatches`) before any forward pass or update of the step."""
    algorithm, times = settings.algorithm, {}
    check_minibatches(micro_batches, algorithm.policy_minibatches)
    routing = next((hook for hook in trainable.hooks if isinstance(hook, ModelRouting)), None)
    if routing is not None:
        check_routes(micro_batches, routing.mode)
    cp_rank = parallel_state.get_context_parallel_rank()
    cp_size = parallel_state.get_context_parallel_world_size()
    batches = [policy_batch(mb, cp_rank, cp_size) for mb in micro_batches]
    if reference is not None:
        began = time.perf_counter()
        set_reference_logprobs(reference, batches, settings.temperature)
        times["reference"] = time.perf_counter() - began
    mismatch = None
    if algorithm.old_logprobs == "recompute":
        began = time.perf_counter()
        with measured(routing, True):
            recompute_old_logprobs(trainable.model[0], batches, settings.temperature, trainable.hooks)
        times["recompute"] = time.perf_counter() - began
        began = time.perf_counter()
        mismatch = correct_rollouts(settings, batches)
        times["correction"] = time.perf_counter() - began
    set_aggregation(settings, batches)
    loss = policy_loss_func(algorithm, settings.temperature, settings.teacher_coef, settings.teacher_top_k_coef)
    began = time.perf_counter()
    updates = []
    for _ in range(algorithm.policy_epochs):
        for group in minibatch_groups(batches):
            if updates:
                kill_point("step.minibatch")
            with measured(routing, not updates and algorithm.old_logprobs != "recompute"):
                updates.append(train_on_batches(trainable, group, loss))
    times["train"] = time.perf_counter() - began
    record = summarise_updates(updates, algorithm.policy_epochs, mismatch, times)
    if routing is not None:
        record.update(routing.statistics())
    return record


def measured(routing: ModelRouting | None, first_pass: bool):
    """Router health is measured on the weights that sampled: in the pi_old pass when there is
    one, else in the first mini-batch's training forward (before any update of the step)."""
    return routing.measure() if routing is not None and first_pass else nullcontext()


def check_routes(micro_batches: list[MicroBatch], mode: str) -> None:
    """Raises ValueError naming `algorithm.routing_replay` when a micro-batch of this rank's grid
    item (other than a dummy) comes without the sampler's routes."""
    missing = [index for index, mb in enumerate(micro_batches) if not mb.is_dummy and mb.routes is None]
    if missing:
        raise ValueError(
            f"algorithm.routing_replay is {mode!r}, but micro-batches {missing[:8]} of this step's policy grid "
            "carry no routes: the orchestrator packs them only with the same setting; give both the same "
            "resolved config"
        )


def _means(metrics: dict) -> dict:
    tokens = max(metrics.get("num_tokens", 0.0), 1.0)
    return {
        "ratio_mean": metrics.get("ratio_sum", 0.0) / tokens,
        "clip_fraction": metrics.get("clipped_sum", 0.0) / tokens,
        "approx_kl": metrics.get("approx_kl_sum", 0.0) / tokens,
    }


# Statistics summarise_updates reports under names of their own.
KNOWN_SUMS = frozenset(("ratio_sum", "clipped_sum", "approx_kl_sum", "entropy_sum", "kl_ref_sum", "log_ratio_sum",
                        "ratio_squared_sum"))  # fmt: skip


def summarise_updates(updates: list[dict], epochs: int, mismatch: dict | None, times: dict) -> dict:
    """One step's metrics from its updates' reduced metrics (`epochs` passes over the step's
    samples)."""
    total = {key: sum(u.get(key, 0.0) for u in updates) for key in ("num_tokens", "ratio_sum", "clipped_sum",
             "approx_kl_sum", "entropy_sum", "kl_ref_sum")}  # fmt: skip
    first, last = updates[0], updates[-1]
    tokens = max(total["num_tokens"], 1.0)
    grad_norms = [u["grad_norm"] for u in updates if u.get("grad_norm") is not None]
    record = {
        "optimizer_steps": len(updates),
        "loss": sum(u["loss"] for u in updates) / len(updates),
        "num_tokens": total["num_tokens"] / epochs,  # the step's action tokens
        "trained_tokens": total["num_tokens"],  # over every update
        **_means(total),
        "entropy": total["entropy_sum"] / tokens,
        "kl_ref": total["kl_ref_sum"] / tokens,
        **{f"{k}_first": v for k, v in _means(first).items()},
        **{f"{k}_last": v for k, v in _means(last).items()},
        "grad_norm": sum(grad_norms) / len(grad_norms) if grad_norms else None,
        "update_successful": all(u.get("update_successful", True) for u in updates),
        "skipped_steps": last.get("skipped_steps", 0),
        "lr": last.get("lr"),
        "time": times,
    }
    # Every other summed statistic of the loss (GSPO's sequence ratio, a plug-in's own): its mean per
    # action token over all updates, under its name without `_sum`.
    for key in sorted({k for u in updates for k in u if k.endswith("_sum") and k not in KNOWN_SUMS}):
        record.setdefault(key.removesuffix("_sum"), sum(u.get(key, 0.0) for u in updates) / tokens)
    if mismatch is None:  # sampler: the first update's ratio is the mismatch (no update before it)
        first_tokens = max(first.get("num_tokens", 0.0), 1.0)
        mismatch = {
            "mismatch_kl": first.get("approx_kl_sum", 0.0) / first_tokens,
            "mismatch_kl_k1": -first.get("log_ratio_sum", 0.0) / first_tokens,
            "mismatch_chi2_token": first.get("ratio_squared_sum", 0.0) / first_tokens - 1.0,
        }
    record.update(mismatch)
    return record
