"""Batched critic scoring across ranks equals scoring one sequence per request, in order, and
equals the value model run directly on each sequence."""

from __future__ import annotations

import random

import pytest
import torch

from megatron_rl.testing.spawn import run_ranks
from tests.distributed import megatron_workers as w

ARCH = w.DENSE.model_copy(update=dict(num_layers=2))


@pytest.fixture(scope="module")
def weights():
    return run_ranks(w.value_reference_weights, 1, ARCH, 4)[0]


def mixed_requests():
    rng = random.Random(0)
    batch = [[rng.randrange(ARCH.vocab_size) for _ in range(rng.randint(1, 50))] for _ in range(9)]
    return batch, [[ids] for ids in batch]


def direct_values(weights, batch):
    """Reference: the value model on each sequence alone, one process, unpacked."""
    return run_ranks(w.value_model_direct, 1, ARCH, weights, batch)[0]


@pytest.mark.parametrize("tp,cp,world,pp", [(1, 1, 2, 1), (1, 2, 2, 1), (1, 1, 2, 2)])
def test_batched_scoring_equals_per_sequence_scoring(weights, tp, cp, world, pp):
    batch, singles = mixed_requests()
    results = run_ranks(w.critic_scores, world, ARCH, weights, tp, cp, [batch, *singles], 64, pp)[0]
    (values, boots), per_sequence = results[0], results[1:]
    assert len(values) == len(batch) and [len(v) for v in values] == [len(ids) for ids in batch]
    for i, ((single_values,), (single_boot,)) in enumerate(per_sequence):
        torch.testing.assert_close(torch.tensor(values[i]), torch.tensor(single_values), atol=1e-5, rtol=0)
        assert boots[i] == pytest.approx(single_boot, abs=1e-5)
    for i, head in enumerate(direct_values(weights, batch)):
        # values[t] is the head at t - 1; the bootstrap value is the head at the last token
        expected = torch.cat([torch.zeros(1), head[:-1]])
        torch.testing.assert_close(torch.tensor(values[i]), expected, atol=1e-5, rtol=0)
        assert boots[i] == pytest.approx(float(head[-1]), abs=1e-5)
    assert max(abs(b) for b in boots) > 1e-3  # a non-trivial head


@pytest.mark.slow
@pytest.mark.parametrize(
    "tp,cp,world,pp", [(1, 1, 4, 1), (1, 2, 4, 1), (1, 4, 4, 1), (2, 1, 4, 1), (1, 2, 4, 2), (1, 1, 4, 2)]
)
def test_batched_scoring_on_four_ranks(weights, tp, cp, world, pp):
    test_batched_scoring_equals_per_sequence_scoring(weights, tp, cp, world, pp)
