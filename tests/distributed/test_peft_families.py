"""LoRA adapters of the sigmoid-router MoE families read back through transformers + PEFT
(`PeftModel.from_pretrained` over the HF model) and through our merged export: a tiny glm4_moe
(GQA with q/k/v biases, a dense first layer, a shared expert) and a tiny deepseek_v3 (multi-latent
attention: q_a/q_b, kv_a_proj_with_mqa, kv_b, o; a dense first layer, two shared experts), with
LoRA on every linear, experts included (one linear per expert, as the policy trainer builds them).

transformers 5 stores the routed experts fused (`mlp.experts.gate_up_proj` [experts, 2 ffn,
hidden], `down_proj`); PEFT 0.21.2's conversion of a per-expert adapter (glm4_moe and deepseek_v3
both use transformers' `qwen2_moe` conversion pattern) turns every `gate_proj`/`up_proj`/`down_proj`
target into a parameter of those fused experts, which left the same-named plain linears of the
dense first layer and of the shared experts unwrapped and their adapters unread (the logits were
the trainer's with those adapters off, 0.15 away) until the export named their weights in
target_parameters (transforms/peft.py). Now PEFT's logits are the trainer's with every adapter
(1e-4, float32), and so are those of the merged export (W + (alpha / rank) B A converted to HF's
names, loaded by transformers), which gives the trainer's logits with all of them."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_rl import parallel
from megatron_rl.config import Architecture
from megatron_rl.conversion.hf_mapping import hf_to_megatron, megatron_to_hf
from megatron_rl.models.builder import build_gpt_model
from megatron_rl.models.sharding import gather_full_parameters, load_full_state_dict
from megatron_rl.transforms.lora import apply_lora, merge_adapter_tensors
from megatron_rl.transforms.peft import is_adapter, megatron_adapters_to_peft, write_peft_adapter
from tests.support.spawn import run_ranks

RANK, ALPHA = 4, 8.0
FAMILIES = ("glm4_moe", "deepseek_v3")
HF_ATTENTION = {
    "glm4_moe": ["k_proj", "o_proj", "q_proj", "v_proj"],
    "deepseek_v3": ["kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "q_a_proj", "q_b_proj"],
}


def dense_or_shared_mlp(name: str) -> bool:
    """A linear of a dense layer's MLP or of the shared experts (megatron's names): not a routed expert."""
    return ".mlp." in name and ".experts." not in name


def adapted_logits(rank, world_size, cases, input_ids):
    """Per family: (logits with every adapter, logits with the dense/shared MLP adapters off, the
    full adapters) of the model at TP = EP = 1, LoRA on every linear with B drawn at random."""
    parallel.initialize_model_parallel()
    out = {}
    for family, (arch, full) in cases.items():
        model = build_gpt_model(arch, moe_grouped_gemm=False)
        load_full_state_dict(model, full)
        wrapped = apply_lora(model, RANK, ALPHA, seed=5)
        assert any(".experts." in n for n in wrapped) and any(".shared_experts." in n for n in wrapped)
        generator = torch.Generator().manual_seed(11)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(".lora_b"):
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
        model.eval()
        positions = torch.arange(input_ids.shape[1]).expand_as(input_ids)
        adapters = gather_full_parameters(model, select=is_adapter)
        with torch.no_grad():
            every = model(input_ids, positions, attention_mask=None)
            for name, param in model.named_parameters():
                if name.endswith(".lora_b") and dense_or_shared_mlp(name):
                    param.zero_()
            without_dense_shared = model(input_ids, positions, attention_mask=None)
        out[family] = (every, without_dense_shared, adapters)
    return out


@pytest.fixture(scope="module")
def families(tiny_models):
    cases = {}
    for family in FAMILIES:
        directory = tiny_models[family]
        arch = Architecture.from_hf_config(json.loads((directory / "config.json").read_text()), str(directory))
        cases[family] = (arch, hf_to_megatron(load_file(directory / "model.safetensors"), arch))
    input_ids = torch.randint(1, 512, (1, 20), generator=torch.Generator().manual_seed(2))
    (results,) = run_ranks(adapted_logits, 1, cases, input_ids)
    return {family: (tiny_models[family], *cases[family], *results[family]) for family in FAMILIES}, input_ids


@pytest.mark.parametrize("family", FAMILIES)
def test_peft_reads_back_every_adapter_attention_dense_shared_and_routed_experts(family, families, tmp_path):
    from peft import PeftModel
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.lora import ParamWrapper
    from transformers import AutoModelForCausalLM

    cases, input_ids = families
    directory, arch, _, every, without_dense_shared, adapters = cases[family]
    peft_tensors = megatron_adapters_to_peft(adapters, arch)
    out = write_peft_adapter(tmp_path / "adapter", peft_tensors, RANK, ALPHA, base_model=str(directory))
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["target_modules"] == sorted(HF_ATTENTION[family] + ["down_proj", "gate_proj", "up_proj"])
    assert config["target_parameters"] == sorted(f"mlp.{part}{leaf}.weight" for part in ("", "shared_experts.")
                                                  for leaf in ("down_proj", "gate_proj", "up_proj"))  # fmt: skip
    shared = [n for n in peft_tensors if ".shared_experts." in n]
    dense = [n for n in peft_tensors if ".layers.0.mlp." in n]
    assert len(shared) == len(dense) == 6  # gate, up, down: A and B each
    base = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        plain = base(input_ids).logits
        reference = PeftModel.from_pretrained(base, str(out)).eval()
        with_adapter = reference(input_ids).logits
    assert (with_adapter - plain).abs().max() > 1e-2  # the adapters change the output
    torch.testing.assert_close(with_adapter, every, atol=1e-4, rtol=0)
    # the dense and shared MLP adapters count: without them PEFT's logits would be far off
    assert (every - without_dense_shared).abs().max() > 1e-2
    modules = dict(reference.named_modules())
    layer0, layer1 = "base_model.model.model.layers.0", "base_model.model.model.layers.1"
    for leaf in HF_ATTENTION[family]:
        assert isinstance(modules[f"{layer1}.self_attn.{leaf}"], LoraLinear), leaf
    assert isinstance(modules[f"{layer1}.mlp.experts"], ParamWrapper)  # down_proj around gate_up_proj
    for leaf in ("gate_proj", "up_proj", "down_proj"):  # wrapped by target_parameters
        assert isinstance(modules[f"{layer1}.mlp.shared_experts.{leaf}"], ParamWrapper), leaf
        assert isinstance(modules[f"{layer0}.mlp.{leaf}"], ParamWrapper), leaf


@pytest.mark.parametrize("family", FAMILIES)
def test_merged_export_gives_the_trainers_logits_with_every_adapter(family, families, tmp_path):
    """W + (alpha / rank) B A for every adapted linear (attention, dense MLP, shared and routed
    experts), converted to HF's names and loaded by transformers."""
    from transformers import AutoModelForCausalLM

    cases, input_ids = families
    directory, arch, full, every, _, adapters = cases[family]
    merged = megatron_to_hf(merge_adapter_tensors({**full, **adapters}, ALPHA), arch)
    out = tmp_path / "merged"
    out.mkdir()
    shutil.copy(directory / "config.json", out / "config.json")
    save_file({k: v.contiguous() for k, v in merged.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids).logits
    torch.testing.assert_close(logits, every, atol=1e-4, rtol=0)
