"""LoRA: only adapters train, TP=2 equals TP=1, merged weights reproduce the adapted model."""

from __future__ import annotations

import torch

from megatron_rl.testing.spawn import run_ranks
from tests.distributed import megatron_workers as w

ARCH = w.DENSE.model_copy(update=dict(num_layers=2))


def test_lora_trains_only_adapters_and_matches_across_tp():
    full = run_ranks(w.reference_weights, 1, ARCH, 3)[0]
    ref_out, trainable, changed, ref_a, ref_merged, ref_stepped = run_ranks(w.lora_step, 1, ARCH, full)[0]
    assert trainable and all(".lora_a" in n or ".lora_b" in n for n in trainable)
    assert {n.rsplit(".", 2)[-2] for n in trainable} == {
        "linear_qkv",
        "linear_proj",
        "linear_fc1",
        "linear_fc2",
    }
    assert sorted(changed) == sorted(trainable)  # a step moves adapters and nothing else
    torch.testing.assert_close(ref_merged, ref_stepped, atol=1e-5, rtol=0)
    plain = run_ranks(w.logits, 1, ARCH, full, 1, 1, w.tokens(vocab=ARCH.vocab_size))[0]
    assert (ref_out - plain).abs().max() > 1e-3  # the adapters change the output
    for out, _, _, a, merged, stepped in run_ranks(w.lora_step, 2, ARCH, full, 2):
        torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=0)
        torch.testing.assert_close(stepped, ref_stepped, atol=1e-5, rtol=0)
        torch.testing.assert_close(merged, ref_merged, atol=1e-5, rtol=0)
        for name, value in ref_a.items():  # replicated A got the TP-summed gradient
            torch.testing.assert_close(a[name], value, atol=1e-6, rtol=0)


def test_lora_on_the_value_model_keeps_the_head_trainable():
    full = run_ranks(w.reference_weights, 1, ARCH, 3)[0]
    _, trainable, changed, _, merged, stepped = run_ranks(w.lora_step, 1, ARCH, full, 1, True)[0]
    assert "value_head.weight" in trainable and sorted(changed) == sorted(trainable)
    assert all(".lora_" in n or n.startswith("value_head.") for n in trainable)
    torch.testing.assert_close(merged, stepped, atol=1e-5, rtol=0)
