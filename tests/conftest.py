"""Shared fixtures: tiny random HF models built locally once per session (no download)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """family -> directory with config.json, model.safetensors and a tokenizer."""
    from megatron_rl.models.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("tiny_models")
    return {
        family: make_tiny_model(family, root / family, seed=3) for family in ("qwen3", "qwen3_moe", "llama")
    }
