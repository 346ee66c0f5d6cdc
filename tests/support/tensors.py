"""Torch tensors for tests: token batches, a set of named tensors of mixed dtypes, and the
loss masks and right-padded batches of the advantage tests."""

from __future__ import annotations

import random

import torch


def tokens(batch: int = 2, seq: int = 24, vocab: int = 128, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def named_tensors() -> dict[str, torch.Tensor]:
    """Five small tensors of mixed dtypes and shapes (one larger than a 256-byte bucket)."""
    g = torch.Generator().manual_seed(0)
    return {
        "a": torch.randn(10, 4, generator=g),
        "b": torch.randn(3, generator=g).to(torch.bfloat16),
        "c": torch.randn(100, generator=g),  # 400 bytes: larger than the bucket
        "d": torch.randn(2, 2, generator=g).to(torch.bfloat16),
        "e": torch.arange(6).reshape(2, 3),
    }


def random_mask(rng: random.Random, length: int) -> list[bool]:
    """Prompt, then alternating action and observation spans (back to back, at the end, anywhere)."""
    mask = []
    prompt = rng.randint(0, max(0, length // 3))
    mask += [False] * min(prompt, length)
    while len(mask) < length:
        span = rng.randint(1, max(1, length // 4))
        mask += [rng.random() < 0.6] * span
    return mask[:length]


def pad_batch(rows, fill, dtype) -> torch.Tensor:
    """Rows of unequal length right-padded with `fill` into one [len(rows), longest] tensor."""
    longest = max(len(r) for r in rows)
    return torch.tensor([list(r) + [fill] * (longest - len(r)) for r in rows], dtype=dtype)
