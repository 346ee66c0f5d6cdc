"""Torch tensors for tests: token batches and a set of named tensors of mixed dtypes."""

from __future__ import annotations

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
