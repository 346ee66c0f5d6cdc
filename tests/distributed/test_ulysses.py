"""Ulysses context parallel on packed THD input (sequences of different lengths, GQA, tail
padding): forward logits, loss and gradients equal CP=1."""

from __future__ import annotations

import pytest
import torch

from megatron_rl import parallel
from megatron_rl.models.builder import build_gpt_model
from megatron_rl.models.sharding import load_full_state_dict, local_to_global_name
from tests.support.ranks import DENSE, gather_vocab, reference_weights
from tests.support.spawn import run_ranks

LENGTHS = [5, 17, 1, 9]  # 32 tokens; CP slices cut through sequences


@pytest.fixture(scope="module")
def weights():
    return run_ranks(reference_weights, 1, DENSE, 7)[0]


def check(weights, tp, cp, pad, arch=DENSE):
    ref_logits, ref_loss, ref_grads, ref_core = run_ranks(
        context_parallel_step, 1, arch, weights, LENGTHS, 1, 1, pad
    )[0]
    assert ref_core == "PackedDotProductAttention"
    for logits, loss, grads, core in run_ranks(
        context_parallel_step, tp * cp, arch, weights, LENGTHS, tp, cp, pad
    ):
        assert core == "UlyssesAttention"
        torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=0)
        torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=0)
        assert set(grads) == set(ref_grads)
        for name, grad in ref_grads.items():
            torch.testing.assert_close(grads[name], grad, atol=1e-6, rtol=1e-4, msg=name)


def test_cp2_equals_cp1(weights):
    check(weights, tp=1, cp=2, pad=2)


@pytest.mark.slow
def test_tp2_cp2_equals_cp1(weights):
    check(weights, tp=2, cp=2, pad=0)


@pytest.mark.slow
def test_cp4_with_fewer_kv_heads_than_ranks(weights):
    # 2 KV heads, CP=4: KV heads are repeated so each rank holds the group its queries use.
    check(weights, tp=1, cp=4, pad=0)


# Rank functions: module-level, so that the spawned ranks can import them.


def context_parallel_step(rank, world_size, arch, full, lengths, tp=1, cp=1, pad=0, seed=0):
    """One forward/backward on sequences packed in one THD row, the row split contiguously over
    CP ranks. Returns (full-row logits [T, V], loss, grads of replicated params summed over CP)."""
    from megatron.core import parallel_state

    from megatron_rl.models.attention import packed_seq_params
    from megatron_rl.models.logprobs import megatron_vocab_parallel_logprobs
    from megatron_rl.models.sharding import _offsets

    parallel.initialize_model_parallel(tp=tp, cp=cp)
    model = build_gpt_model(arch, tp=tp, cp=cp)
    load_full_state_dict(model, full)
    g = torch.Generator().manual_seed(seed)
    row = torch.cat(
        [torch.randint(0, arch.vocab_size, (n,), generator=g) for n in lengths]
        + [torch.zeros(pad, dtype=torch.long)]
    )
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    total = len(row)
    targets = torch.roll(row, -1)
    mask = torch.zeros(total, dtype=torch.bool)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        mask[a : b - 1] = True  # predict the next token inside each sequence
    cp_rank = parallel_state.get_context_parallel_rank()
    local = slice(cp_rank * total // cp, (cp_rank + 1) * total // cp)
    logits = model(
        row[None, local],
        torch.arange(total)[None, local],
        attention_mask=None,
        packed_seq_params=packed_seq_params(cu, total),
    )[0]
    logprobs, _ = megatron_vocab_parallel_logprobs(logits, targets[local])
    loss = -(logprobs * mask[local]).sum() / mask.sum()  # normalised by the global token count
    loss.backward()
    cp_group = parallel_state.get_context_parallel_group()
    layer_offset, expert_offset = _offsets(model)
    grads = {}
    for name, p in model.named_parameters():
        if getattr(p, "tensor_model_parallel", False):
            continue
        grad = p.grad.detach().clone()
        if cp > 1:
            torch.distributed.all_reduce(grad, group=cp_group)
        if tp > 1 and ("q_layernorm" in name or "k_layernorm" in name):
            # As megatron's finalize_model_grads: each TP rank saw only its own heads.
            torch.distributed.all_reduce(grad, group=parallel_state.get_tensor_model_parallel_group())
        grads[local_to_global_name(name, layer_offset, expert_offset)] = grad
    full_logits = gather_vocab(logits.detach()[:, None, :])[:, 0, :]
    if cp > 1:
        parts = [torch.empty_like(full_logits) for _ in range(cp)]
        torch.distributed.all_gather(parts, full_logits.contiguous(), group=cp_group)
        full_logits = torch.cat(parts)
    total_loss = loss.detach().clone()
    if cp > 1:
        torch.distributed.all_reduce(total_loss, group=cp_group)
    core = type(model.decoder.layers[0].self_attention.core_attention).__name__
    return full_logits, total_loss, grads, core
