"""Rank functions and references shared by several distributed tests (the spawned ranks import
them from here); a rank function takes (rank, world_size, ...) and returns plain tensors."""

from __future__ import annotations

import megatron_rl.compat  # noqa: F401  (megatron-core on CPU needs its patches first)

import torch
from megatron.core import tensor_parallel

from megatron_rl import parallel
from megatron_rl.config import Architecture
from megatron_rl.models.builder import build_gpt_model
from megatron_rl.models.sharding import full_parameters, load_full_state_dict
from tests.support.tensors import tokens

DENSE = Architecture(
    family="qwen3",
    hidden_size=64,
    num_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=96,
    vocab_size=128,
    qk_norm=True,
)


def reference_weights(rank: int, world_size: int, arch: Architecture, seed: int) -> dict[str, torch.Tensor]:
    """Random full weights from a TP=EP=PP=1 model."""
    parallel.initialize_model_parallel(seed=seed)
    torch.manual_seed(seed)
    return full_parameters(build_gpt_model(arch))


def gather_vocab(logits: torch.Tensor) -> torch.Tensor:
    return tensor_parallel.gather_from_tensor_model_parallel_region(logits)


def model_logits(rank, world_size, arch, full, tp=1, ep=1, input_ids=None):
    """Full-vocabulary logits [batch, seq, vocab] of the model at (tp, ep), eval mode."""
    parallel.initialize_model_parallel(tp=tp, ep=ep)
    model = build_gpt_model(arch, tp=tp, ep=ep)
    load_full_state_dict(model, full)
    model.eval()
    input_ids = tokens() if input_ids is None else input_ids
    positions = torch.arange(input_ids.shape[1]).expand_as(input_ids)
    with torch.no_grad():
        out = model(input_ids, positions, attention_mask=None)
    return gather_vocab(out)


def hf_logits(directory, input_ids):
    """The transformers reference: logits of the HF model in `directory` (float32, eval)."""
    from transformers import AutoModelForCausalLM  # heavy: only for the tests that compare with it

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids).logits
