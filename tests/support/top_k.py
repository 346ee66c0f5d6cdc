"""A stand-in teacher's top k for training samples (distillation.mode top_k_kl), numpy only."""

from __future__ import annotations

import numpy as np

from megatron_rl.data.types import TrainingSample


def teacher_top_k(length: int, action: np.ndarray, vocab: int, k: int, rng: np.random.Generator, scale: float = 3.0):
    """([length, k] int32, [length, k] float32): on each action row the k most likely tokens of a
    random distribution softmax(scale * N(0, 1) over `vocab`), most likely first, and their
    log-probabilities (their mass is below 1: not renormalised); ids 0 and log-probabilities 0 on
    the other rows."""
    action = np.asarray(action, dtype=bool)
    logits = scale * rng.normal(size=(int(action.sum()), vocab))
    log_p = logits - logits.max(axis=1, keepdims=True)
    log_p -= np.log(np.exp(log_p).sum(axis=1, keepdims=True))
    ids = np.argsort(-log_p, axis=1, kind="stable")[:, :k]
    top_ids, top_logprobs = np.zeros((length, k), dtype=np.int32), np.zeros((length, k), dtype=np.float32)
    top_ids[action], top_logprobs[action] = ids, np.take_along_axis(log_p, ids, axis=1)
    return top_ids, top_logprobs


def add_teacher_top_k(samples: list[TrainingSample], vocab: int, k: int, seed: int = 0, scale: float = 3.0):
    """Sets every sample's `teacher_top_ids` / `teacher_top_logprobs` (`teacher_top_k`, seeded)."""
    rng = np.random.default_rng(seed)
    for sample in samples:
        sample.teacher_top_ids, sample.teacher_top_logprobs = teacher_top_k(
            len(sample), sample.loss_mask, vocab, k, rng, scale
        )
    return samples
