"""Megatron models built from HF configs give the logits of `transformers` on the same weights."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from megatron_rl.config import Architecture
from megatron_rl.models.hf_mapping import hf_to_megatron
from megatron_rl.testing.spawn import run_ranks
from tests.distributed import megatron_workers as w

LAYOUTS = {"qwen3": [(1, 1), (2, 1)], "llama": [(1, 1), (2, 1)], "qwen3_moe": [(1, 1), (2, 1), (1, 2)]}


def hf_logits(directory, input_ids):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids).logits


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen3_moe"])
def test_logits_match_transformers(family, tiny_models):
    """A right-padded batch: row 0 is full, row 1 has 14 tokens then padding; each row's real
    tokens match transformers run on that row alone."""
    directory = tiny_models[family]
    arch = Architecture.from_hf_config(json.loads((directory / "config.json").read_text()), str(directory))
    full = hf_to_megatron(load_file(directory / "model.safetensors"), arch)
    input_ids = torch.randint(1, arch.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    input_ids[1, 14:] = 0  # the tokenizer's pad id
    row0 = hf_logits(directory, input_ids[:1])[0]
    row1 = hf_logits(directory, input_ids[1:, :14])[0]
    assert row0.abs().mean() > 1e-2
    for tp, ep in LAYOUTS[family]:
        for logits in run_ranks(w.logits, tp * ep, arch, full, tp, ep, input_ids):
            torch.testing.assert_close(logits[0], row0, atol=1e-4, rtol=0, msg=f"{family} tp={tp} ep={ep}")
            torch.testing.assert_close(
                logits[1, :14], row1, atol=1e-4, rtol=0, msg=f"{family} tp={tp} ep={ep}"
            )


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen3_moe"])
def test_packed_thd_logits_match_transformers_per_sequence(family, tiny_models):
    """Sequences of different lengths packed in one row (with CP-style tail padding) give each
    sequence's own transformers logits."""
    directory = tiny_models[family]
    arch = Architecture.from_hf_config(json.loads((directory / "config.json").read_text()), str(directory))
    full = hf_to_megatron(load_file(directory / "model.safetensors"), arch)
    lengths = [7, 19, 1, 12, 8]
    for tp, ep in LAYOUTS[family]:
        for packed, separate, sequences in run_ranks(
            w.packed_logits, tp * ep, arch, full, lengths, tp, ep, 3
        ):
            for got, alone, ids in zip(packed, separate, sequences):
                torch.testing.assert_close(got, hf_logits(directory, ids[None])[0], atol=1e-4, rtol=0)
                if alone is not None:
                    torch.testing.assert_close(got, alone, atol=1e-5, rtol=0)
