"""MoE routing of a bfloat16 model runs in float32 (moe_router_dtype), as vLLM's and
transformers' softmax over the router logits does."""

from __future__ import annotations

import torch

from megatron_rl import parallel
from tests.support.ranks import DENSE
from tests.support.spawn import run_ranks
from tests.support.tensors import tokens

MOE = DENSE.model_copy(
    update=dict(num_layers=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
)


def test_a_bfloat16_model_routes_in_float32():
    probs, reference = run_ranks(router_probabilities, 1, MOE)[0]
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs, reference, atol=1e-6, rtol=0)


def router_probabilities(rank, world_size, arch):
    """(the first layer's routing probabilities [tokens, experts] in a bf16 forward, the same
    written plainly: float32 softmax of float32 logits of the bf16 input, top-k renormalised)."""
    from megatron_rl.models.builder import build_gpt_model

    parallel.initialize_model_parallel()
    torch.manual_seed(0)
    model = build_gpt_model(arch, dtype="bfloat16").eval()
    router = model.decoder.layers[0].mlp.router
    seen = {}
    router.register_forward_hook(lambda module, inputs, output: seen.update(input=inputs[0], probs=output[0]))
    input_ids = tokens(vocab=arch.vocab_size)
    with torch.no_grad():
        model(input_ids, torch.arange(input_ids.shape[1]).expand_as(input_ids), attention_mask=None)
    hidden = seen["input"].reshape(-1, arch.hidden_size).float()
    logits = hidden @ router.weight.float().T
    top = torch.topk(logits, arch.num_experts_per_tok, dim=-1)
    weights = torch.softmax(top.values, dim=-1)  # pre-softmax off: softmax over the top-k logits
    reference = torch.zeros_like(logits).scatter(1, top.indices, weights)
    return seen["probs"].reshape(reference.shape), reference
