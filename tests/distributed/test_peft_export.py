"""LoRA adapters in PEFT's format: a LoRA-adapted megatron model's adapters, exported, load into
transformers + PEFT on the same base and give the trainer's logits (attention, the dense MLP,
GQA's fused q/k/v and the gated [gate; up] split exactly); TP=2 loads the full adapters sharded
and gathers them back with the same logits; the export reads back to the same megatron adapters, and a PEFT adapter whose fused
parts have different A is refused, naming the layer."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from megatron_rl import parallel
from megatron_rl.config import Architecture
from megatron_rl.conversion.hf_mapping import hf_to_megatron
from megatron_rl.models.builder import build_gpt_model
from megatron_rl.models.sharding import gather_full_parameters, load_full_state_dict
from megatron_rl.transforms.lora import apply_lora
from megatron_rl.transforms.peft import (
    PeftFormatError,
    is_adapter,
    megatron_adapters_to_peft,
    peft_to_megatron_adapters,
    read_peft_adapter,
    write_peft_adapter,
)
from tests.support.ranks import gather_vocab
from tests.support.spawn import run_ranks

RANK, ALPHA = 4, 8.0


def adapted_logits(rank, world_size, arch, full, tp, input_ids, adapters=None):
    """Logits of the model at TP=`tp` with LoRA on every linear and the full adapters gathered
    from its ranks. `adapters`: the full adapters to load (sharded like their weights); None
    draws B at random (so that the adapters change the output)."""
    parallel.initialize_model_parallel(tp=tp)
    model = build_gpt_model(arch, tp=tp)
    load_full_state_dict(model, full)
    apply_lora(model, RANK, ALPHA, seed=5)
    if adapters is None:
        generator = torch.Generator().manual_seed(11)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(".lora_b"):
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    else:
        load_full_state_dict(model, {**full, **adapters})
    model.eval()
    positions = torch.arange(input_ids.shape[1]).expand_as(input_ids)
    with torch.no_grad():
        logits = gather_vocab(model(input_ids, positions, attention_mask=None))
    return logits, gather_full_parameters(model, select=is_adapter)


@pytest.fixture(scope="module")
def qwen3(tiny_models):
    directory = tiny_models["qwen3"]
    arch = Architecture.from_hf_config(json.loads((directory / "config.json").read_text()), str(directory))
    return directory, arch, hf_to_megatron(load_file(directory / "model.safetensors"), arch)


def test_exported_adapter_gives_the_trainers_logits_in_transformers_with_peft(qwen3, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    directory, arch, full = qwen3
    input_ids = torch.randint(1, arch.vocab_size, (1, 20), generator=torch.Generator().manual_seed(2))
    logits, adapters = run_ranks(adapted_logits, 1, arch, full, 1, input_ids)[0]
    peft_tensors = megatron_adapters_to_peft(adapters, arch)
    assert len(peft_tensors) == 2 * 7 * arch.num_layers  # q k v o gate up down, A and B each
    out = write_peft_adapter(tmp_path / "adapter", peft_tensors, RANK, ALPHA, base_model=str(directory))
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    base = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        plain = base(input_ids).logits
        reference = PeftModel.from_pretrained(base, str(out)).eval()(input_ids).logits
    assert (reference - plain).abs().max() > 1e-2  # the adapters change the output
    torch.testing.assert_close(logits, reference, atol=1e-4, rtol=0)
    # and back: the same megatron adapters
    tensors, read_config = read_peft_adapter(out)
    assert read_config["r"] == RANK and read_config["lora_alpha"] == ALPHA
    back = peft_to_megatron_adapters(tensors, arch)
    assert set(back) == set(adapters)
    for name, tensor in adapters.items():
        torch.testing.assert_close(back[name], tensor, atol=0, rtol=0)


def test_tp2_gathers_the_same_adapters_and_logits(qwen3):
    _, arch, full = qwen3
    input_ids = torch.randint(1, arch.vocab_size, (1, 16), generator=torch.Generator().manual_seed(4))
    logits1, adapters1 = run_ranks(adapted_logits, 1, arch, full, 1, input_ids)[0]
    for logits2, adapters2 in run_ranks(adapted_logits, 2, arch, full, 2, input_ids, adapters1):
        torch.testing.assert_close(logits2, logits1, atol=1e-5, rtol=0)
        assert set(adapters2) == set(adapters1)
        for name, tensor in adapters1.items():
            torch.testing.assert_close(adapters2[name], tensor, atol=0, rtol=0)


def test_fused_parts_with_different_a_are_refused_naming_the_layer(qwen3):
    _, arch, _ = qwen3
    a, b = torch.randn(RANK, arch.hidden_size), torch.randn(arch.num_attention_heads * arch.kv_channels, RANK)
    kv_b = torch.randn(arch.num_key_value_heads * arch.kv_channels, RANK)
    layer = "base_model.model.model.layers.0.self_attn"
    peft = {f"{layer}.q_proj.lora_A.weight": a, f"{layer}.q_proj.lora_B.weight": b,
            f"{layer}.k_proj.lora_A.weight": a.clone(), f"{layer}.k_proj.lora_B.weight": kv_b,
            f"{layer}.v_proj.lora_A.weight": a + 1, f"{layer}.v_proj.lora_B.weight": kv_b}  # fmt: skip
    with pytest.raises(PeftFormatError, match=r"decoder.layers.0.self_attention.linear_qkv: .* different lora_A"):
        peft_to_megatron_adapters(peft, arch)
    del peft[f"{layer}.v_proj.lora_A.weight"], peft[f"{layer}.v_proj.lora_B.weight"]
    with pytest.raises(PeftFormatError, match=r"linear_qkv: the adapter has \['k_proj', 'q_proj'\] but not \['v_proj'\]"):
        peft_to_megatron_adapters(peft, arch)
