"""What adapters on an MoE model's experts cost a training pass: forward + backward of one packed
micro-batch through an MoE model whose experts are one linear each (SequentialMLP, as the policy
is built with expert adapters), with rank-r adapters on every expert's linears against the same
model with adapters on attention only (the experts frozen, no adapter GEMMs there); on CUDA with
TransformerEngine also TE's grouped GEMM (one GEMM for a layer's experts, which no adapter can
wrap). Shared by benchmarks/expert_adapters.py (CPU) and the GPU check `expert_adapters`.

Every variant has the same tokens and weights (the grouped GEMM's experts excepted: other tensors,
drawn alike; the router is shared, so the tokens go to the same experts); the backward computes
the adapters' gradients and the activations' (the base is frozen, as in a LoRA policy)."""

from __future__ import annotations

import statistics
import time

import megatron_rl.compat  # noqa: F401  (megatron-core on CPU needs its patches first)

import numpy as np
import torch

from megatron_rl.config import Architecture
from megatron_rl.data.packing import pack_into_grid
from megatron_rl.data.types import TrainingSample
from megatron_rl.models.attention import packed_seq_params
from megatron_rl.models.builder import build_gpt_model
from megatron_rl.models.sharding import full_parameters, load_full_state_dict
from megatron_rl.policy.loss import policy_batch
from megatron_rl.transforms.lora import apply_lora

ATTENTION = ("linear_qkv", "linear_proj")
VARIANTS = {  # name -> (moe_grouped_gemm, LoRA targets; None: every linear of the model, experts' too)
    "per_expert": (False, ATTENTION),
    "per_expert_adapters": (False, None),
    "grouped": (True, ATTENTION),
}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def pass_seconds(arch: Architecture, tokens: int, variants: list[str], rank: int = 16, dtype: str = "float32",
                 repeats: int = 5, seed: int = 0) -> dict[str, float]:  # fmt: skip
    """{variant: median seconds of one forward + backward} over `repeats` passes (after one
    warm-up) of a micro-batch of `tokens` tokens; the caller has initialised model parallel."""
    torch.manual_seed(seed)
    full = full_parameters(build_gpt_model(arch, dtype=dtype, moe_grouped_gemm=False))
    rng = np.random.default_rng(seed)
    samples = [
        TrainingSample(token_ids=rng.integers(0, arch.vocab_size, 64), loss_mask=np.ones(64, dtype=bool),
                       inference_logprobs=np.zeros(64), reward=0.0, group_id=i)
        for i in range(max(1, tokens // 64))
    ]  # fmt: skip
    (batch,) = [policy_batch(mb) for mb in pack_into_grid(samples, tokens, 1)[0]][:1]
    seconds = {}
    for name in variants:
        grouped, targets = VARIANTS[name]
        model = build_gpt_model(arch, dtype=dtype, moe_grouped_gemm=grouped)
        if grouped:  # TE's grouped experts hold other tensors: theirs stay random, the rest (router too) is shared
            with torch.no_grad():
                for name, param in model.named_parameters():
                    if name in full:
                        param.copy_(full[name])
        else:
            load_full_state_dict(model, full)
        apply_lora(model, rank, 2.0 * rank, None if targets is None else tuple(targets), seed=1)
        params = packed_seq_params(batch.cu_seqlens, batch.total_tokens)
        _one_pass(model, batch, params)  # warm-up
        times = []
        for _ in range(repeats):
            _sync()
            began = time.perf_counter()
            _one_pass(model, batch, params)
            _sync()
            times.append(time.perf_counter() - began)
        seconds[name] = statistics.median(times)
        del model
    return seconds


def _one_pass(model, batch, params) -> None:
    logits = model(batch.input_ids, batch.position_ids, attention_mask=None, packed_seq_params=params)
    logits.float().square().mean().backward()
    model.zero_grad(set_to_none=True)


def per_expert_overhead_us(arch: Architecture, seconds: dict[str, float], local_experts: int) -> float:
    """The adapters' cost per local expert and layer of one pass, in microseconds."""
    extra = seconds["per_expert_adapters"] - seconds["per_expert"]
    return 1e6 * extra / (local_experts * arch.num_layers)
