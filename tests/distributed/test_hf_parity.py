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


@pytest.mark.parametrize("tp,cp", [(1, 1), (2, 2)])
def test_trainer_path_logprobs_match_transformers_per_token(tiny_models, tp, cp):
    """The policy trainer's per-token log-probabilities for a packed, CP-sliced grid (the shift in
    trainer/batches.py included) equal transformers' per-sequence log-probabilities of the same
    action tokens, and exactly the action tokens get one."""
    import numpy as np

    from megatron_rl.data.types import TrainingSample

    directory = tiny_models["qwen3"]
    arch = Architecture.from_hf_config(json.loads((directory / "config.json").read_text()), str(directory))
    full = hf_to_megatron(load_file(directory / "model.safetensors"), arch)
    rng = np.random.default_rng(7)
    samples = []
    for length in (9, 23, 2, 14, 31, 6):
        mask = np.zeros(length, dtype=bool)
        mask[min(3, length - 1):] = rng.random(length - min(3, length - 1)) < 0.8  # a prompt, then actions
        samples.append(TrainingSample(token_ids=rng.integers(0, arch.vocab_size, length), loss_mask=mask,
                                      inference_logprobs=np.zeros(length, np.float32), reward=0.0))  # fmt: skip
    got = run_ranks(w.trainer_path_logprobs, tp * cp, arch, full, samples, 40, tp, cp)[0]
    expected = {}
    for index, sample in enumerate(samples):
        log_p = torch.log_softmax(hf_logits(directory, torch.as_tensor(sample.token_ids)[None])[0], dim=-1)
        for q in range(1, len(sample.token_ids)):
            if sample.loss_mask[q]:
                expected[(index, q)] = float(log_p[q - 1, sample.token_ids[q]])
    assert set(got) == set(expected)
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, abs=1e-4), key
