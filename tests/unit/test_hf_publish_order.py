"""The order megatron_to_hf emits HF tensors in (the order weights are published in): the
embeddings, then each decoder layer in turn with every tensor of a vLLM module together (q/k/v,
gate/up) and each expert's gate, up and down together, then the final norm and the output layer;
and `stream_parts`, which cuts an owner's share into those parts."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.conversion.checkpoint_io import read_architecture, read_hf_state_dict
from megatron_rl.conversion.hf_mapping import decoder_layer_of, hf_to_megatron, megatron_to_hf
from megatron_rl.policy.publish import stream_parts


def published(hf_dir) -> tuple[object, dict[str, torch.Tensor], list[str]]:
    arch = read_architecture(hf_dir)
    hf = dict(read_hf_state_dict(hf_dir))
    out = megatron_to_hf(hf_to_megatron(hf, arch), arch)
    assert sorted(out) == sorted(hf) and all(torch.equal(out[n], hf[n]) for n in hf)  # round trip
    return arch, hf, list(out)


def stream_position(name: str, num_layers: int) -> int:
    layer = decoder_layer_of(name)
    if layer is not None:
        return 1 + layer
    return 0 if name == "model.embed_tokens.weight" else num_layers + 1


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "llama"])
def test_tensors_come_layer_by_layer_with_each_module_together(family, tiny_models):
    arch, _, names = published(tiny_models[family])
    positions = [stream_position(n, arch.num_layers) for n in names]
    assert positions == sorted(positions), names
    assert names[0] == "model.embed_tokens.weight" and names[-2:] == ["model.norm.weight", "lm_head.weight"]
    for layer in range(arch.num_layers):
        prefix = f"model.layers.{layer}."
        in_layer = [n.removeprefix(prefix) for n in names if n.startswith(prefix)]
        fused = [("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")]
        if arch.num_experts:
            fused += [
                tuple(f"mlp.experts.{e}.{p}_proj.weight" for p in ("gate", "up", "down"))
                for e in range(arch.num_experts)
            ]
            experts = [n for n in in_layer if ".experts." in n]
            assert in_layer[-len(experts) :] == experts, in_layer  # the experts last, router before
        else:
            fused += [("mlp.gate_proj.weight", "mlp.up_proj.weight")]
        for group in fused:
            start = in_layer.index(group[0])
            assert tuple(in_layer[start : start + len(group)]) == group, (layer, group, in_layer)


def test_stream_parts_cut_a_share_by_layer_in_order(tiny_models):
    arch, hf, names = published(tiny_models["qwen3_moe"])
    share = {n: hf[n] for n in names if ".experts.1." in n or n == "lm_head.weight"}  # one expert rank
    parts = stream_parts(share, arch.num_layers)
    assert len(parts) == arch.num_layers + 2 and parts[0] == {}
    assert list(parts[-1]) == ["lm_head.weight"]
    for layer in range(arch.num_layers):
        assert list(parts[1 + layer]) == [n for n in share if n.startswith(f"model.layers.{layer}.")]
    with pytest.raises(ValueError, match=r"model\.layers\.9\.mlp\.gate\.weight: decoder layer 9"):
        stream_parts({"model.layers.9.mlp.gate.weight": torch.ones(1)}, arch.num_layers)
