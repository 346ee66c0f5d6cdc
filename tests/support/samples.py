"""Sample factories for tests (numpy only: spawned processes import them cheaply): training samples
and packed grids. Torch tensors for tests: tests/support/tensors.py."""

from __future__ import annotations

import numpy as np

from megatron_rl.data.packing import pack_into_grid
from megatron_rl.data.types import TrainingSample


def training_samples(count: int, vocab: int, seed: int = 0) -> list[TrainingSample]:
    """Random samples with prompts, action/observation spans, advantages, returns, old logprobs
    near a uniform policy's (so importance ratios land inside and outside the clip bands)."""
    rng = np.random.default_rng(seed)
    samples = []
    for i in range(count):
        n = int(rng.integers(6, 40))
        mask = np.zeros(n, dtype=bool)
        mask[3:] = rng.random(n - 3) < 0.75
        samples.append(
            TrainingSample(
                token_ids=rng.integers(0, vocab, n),
                loss_mask=mask,
                inference_logprobs=np.where(mask, -np.log(vocab) + rng.uniform(-0.4, 0.4, n), 0.0),
                reward=float(rng.normal()),
                group_id=i,
                values=rng.normal(size=n).astype(np.float32),
                advantages=np.where(mask, rng.normal(size=n), 0.0).astype(np.float32),
                returns=np.where(mask, rng.normal(size=n), 0.0).astype(np.float32),
            )
        )
    return samples


def make_grid(step: int, dp: int, cp: int = 1, count: int = 20):
    """A grid of `count` random samples (lengths 3..89, vocabulary 50,000) packed into rows of
    128 tokens for `dp` data ranks and `cp` context-parallel ranks; seeded by `step`."""
    rng = np.random.default_rng(step)
    samples = []
    for i in range(count):
        n = int(rng.integers(3, 90))
        mask = rng.random(n) < 0.6
        samples.append(
            TrainingSample(
                token_ids=rng.integers(0, 50_000, n),
                loss_mask=mask,
                inference_logprobs=-rng.random(n),
                reward=1.0,
                values=rng.normal(size=n).astype(np.float32),
                advantages=rng.normal(size=n).astype(np.float32),
                returns=rng.normal(size=n).astype(np.float32),
                group_id=i,
            )
        )
    return pack_into_grid(samples, 128, dp, cp)
