"""Path (b) into vLLM's layer-wise reload holds about one decoder layer at a time: a tiny Qwen3-MoE
published from EP = 2, PP = 2 and PP = 2 x EP = 2 policy ranks over gloo into the real
WeightReceiverExtension around vLLM's own model and in-place reload (tests/support/vllm_worker.py).
Measured in the worker: the largest total of bytes received but not yet consumed by the model
(bucket memory kept alive by views included), against one decoder layer plus one bucket, for 2
and 4 layers; afterwards the model holds what vLLM loading the policy's tensors gives; the stream
arrives layer by layer, every owner's tensors of a layer before the next layer."""

from __future__ import annotations

import re

import pytest
import torch

from tests.support.vllm_worker import measure_updates

BUCKET_BYTES = 16 << 10
PLAN_SLACK = 4 << 10  # plan bytes in flight


def layer_of(name: str) -> int | None:
    match = re.match(r"model\.layers\.(\d+)\.", name)
    return int(match.group(1)) if match else None


def layer_bytes(state: dict[str, torch.Tensor]) -> dict[int, int]:
    sizes: dict[int, int] = {}
    for name, tensor in state.items():
        layer = layer_of(name)
        if layer is not None:
            sizes[layer] = sizes.get(layer, 0) + tensor.numel() * tensor.element_size()
    return sizes


@pytest.mark.slow  # PP = 2 x EP = 2: four policy ranks and a worker, twice
@pytest.mark.parametrize("layers", [2, 4])
def test_moe_update_holds_about_one_decoder_layer(layers, tmp_path):
    from megatron_rl.models.tiny import make_tiny_model

    hf_dir = make_tiny_model(
        "qwen3_moe", tmp_path / "hf", seed=5, hidden_size=64, layers=layers, vocab_size=64, tokenizer="char"
    )
    layouts = [(1, 2), (2, 1), (2, 2)] if layers == 4 else [(1, 2)]
    for update in measure_updates(hf_dir, layouts, BUCKET_BYTES, tmp_path / "worker"):
        state, record = update.state, update.record
        layout = f"pp={update.pp} ep={update.ep} layers={layers}"
        model_bytes = sum(t.numel() * t.element_size() for t in state.values())
        largest_layer = max(layer_bytes(state).values())
        assert update.sent == len(state) == record["count"], layout
        assert sorted(n for n, _ in record["arrived"]) == sorted(state), layout
        peak = record["peak_held_bytes"]
        print(f"{layout}: peak held {peak} B = {peak / model_bytes:.3f} of the model ({model_bytes} B), "
              f"{peak / largest_layer:.2f} layers ({largest_layer} B), bucket {BUCKET_BYTES} B")  # fmt: skip
        assert peak <= largest_layer + BUCKET_BYTES + PLAN_SLACK, (layout, peak, largest_layer, model_bytes)
        assert record["held_at_end_bytes"] == 0, layout
        # layer by layer: every tensor of a layer (from every owner) before the next layer's
        order = [layer_of(n) for n, _ in record["arrived"] if layer_of(n) is not None]
        assert order == sorted(order), (layout, order)
        # what the reload left is what vLLM's own load of the policy's tensors gives (packed
        # linear weights and prepacked experts included), and it holds the policy's tensors
        assert sorted(update.reloaded) == sorted(update.fresh), layout
        for name, tensor in update.fresh.items():
            assert torch.equal(update.reloaded[name], tensor), (layout, name)
        plain = [  # kept in checkpoint layout (norms, embeddings; vLLM-cpu empties packed linears)
            n for n in state if n in update.reloaded and update.reloaded[n].shape == state[n].shape
        ]
        assert len(plain) >= 2 * layers + 2, plain
        for name in plain:
            assert torch.equal(update.reloaded[name], state[name]), (layout, name)
