"""Ulysses context parallel on packed THD input (sequences of different lengths, GQA, tail
padding): forward logits, loss and gradients equal CP=1."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.testing.spawn import run_ranks
from tests.distributed import megatron_workers as w

LENGTHS = [5, 17, 1, 9]  # 32 tokens; CP slices cut through sequences


@pytest.fixture(scope="module")
def weights():
    return run_ranks(w.reference_weights, 1, w.DENSE, 7)[0]


def check(weights, tp, cp, pad, arch=w.DENSE):
    ref_logits, ref_loss, ref_grads, ref_core = run_ranks(
        w.context_parallel_step, 1, arch, weights, LENGTHS, 1, 1, pad
    )[0]
    assert ref_core == "PackedDotProductAttention"
    for logits, loss, grads, core in run_ranks(
        w.context_parallel_step, tp * cp, arch, weights, LENGTHS, tp, cp, pad
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
