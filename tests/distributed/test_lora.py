"""LoRA: only adapters train, TP=2 equals TP=1, merged weights reproduce the adapted model."""

from __future__ import annotations

import torch

from megatron_rl import parallel
from megatron_rl.models.builder import build_gpt_model
from megatron_rl.models.sharding import full_parameters, load_full_state_dict
from megatron_rl.testing.ranks import DENSE, gather_vocab, model_logits, reference_weights
from megatron_rl.testing.spawn import run_ranks
from megatron_rl.testing.tensors import tokens

ARCH = DENSE.model_copy(update=dict(num_layers=2))


def test_lora_trains_only_adapters_and_matches_across_tp():
    full = run_ranks(reference_weights, 1, ARCH, 3)[0]
    ref_out, trainable, changed, ref_a, ref_merged, ref_stepped = run_ranks(lora_step, 1, ARCH, full)[0]
    assert trainable and all(".lora_a" in n or ".lora_b" in n for n in trainable)
    assert {n.rsplit(".", 2)[-2] for n in trainable} == {
        "linear_qkv",
        "linear_proj",
        "linear_fc1",
        "linear_fc2",
    }
    assert sorted(changed) == sorted(trainable)  # a step moves adapters and nothing else
    torch.testing.assert_close(ref_merged, ref_stepped, atol=1e-5, rtol=0)
    plain = run_ranks(model_logits, 1, ARCH, full, 1, 1, tokens(vocab=ARCH.vocab_size))[0]
    assert (ref_out - plain).abs().max() > 1e-3  # the adapters change the output
    for out, _, _, a, merged, stepped in run_ranks(lora_step, 2, ARCH, full, 2):
        torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=0)
        torch.testing.assert_close(stepped, ref_stepped, atol=1e-5, rtol=0)
        torch.testing.assert_close(merged, ref_merged, atol=1e-5, rtol=0)
        for name, value in ref_a.items():  # replicated A got the TP-summed gradient
            torch.testing.assert_close(a[name], value, atol=1e-6, rtol=0)


def test_lora_on_the_value_model_keeps_the_head_trainable():
    full = run_ranks(reference_weights, 1, ARCH, 3)[0]
    _, trainable, changed, _, merged, stepped = run_ranks(lora_step, 1, ARCH, full, 1, True)[0]
    assert "value_head.weight" in trainable and sorted(changed) == sorted(trainable)
    assert all(".lora_" in n or n.startswith("value_head.") for n in trainable)
    torch.testing.assert_close(merged, stepped, atol=1e-5, rtol=0)


# Rank functions: module-level, so that the spawned ranks can import them.


def lora_step(rank, world_size, arch, full, tp=1, value_model=False):
    """LoRA (rank 4, alpha 8, B set to 0.01 so adapters matter) on a GPT or value model:
    (output before the step, trainable names, changed names, replicated lora_a after an SGD step,
    output after merging the stepped adapters, output of the stepped LoRA model)."""
    from megatron_rl.models.lora import apply_lora, merge_lora
    from megatron_rl.models.value_model import build_value_model

    parallel.initialize_model_parallel(tp=tp)
    model = build_value_model(arch, tp=tp, head_init_std=0.1) if value_model else build_gpt_model(arch, tp=tp)
    reference = {k: v for k, v in full.items() if not k.startswith("value_head")}
    load_full_state_dict(model, {**full_parameters(model), **reference})
    apply_lora(model, rank=4, alpha=8.0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_b"):
                p.fill_(0.01)
    input_ids = tokens(vocab=arch.vocab_size)
    positions = torch.arange(input_ids.shape[1]).expand_as(input_ids)

    def output():
        out = model(input_ids, positions, attention_mask=None)
        return out if value_model else gather_vocab(out)

    before_step = output()
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    snapshot = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
    before_step.float().pow(2).mean().backward()
    optimizer.step()
    changed = [n for n, p in model.named_parameters() if not torch.equal(p.detach(), snapshot[n])]
    column_a = {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith("linear_qkv.lora_a")}
    model.eval()
    with torch.no_grad():
        stepped = output()
        merge_lora(model)
        merged = output()
    return before_step.detach(), trainable, changed, column_a, merged, stepped
