"""Batched critic scoring across ranks equals scoring one sequence per request, in order, and
equals the value model run directly on each sequence."""

from __future__ import annotations

import random

import pytest
import torch

from megatron_rl import parallel
from megatron_rl.models.sharding import full_parameters, load_full_state_dict
from tests.support.ranks import DENSE
from tests.support.spawn import run_ranks

ARCH = DENSE.model_copy(update=dict(num_layers=2))


@pytest.fixture(scope="module")
def weights():
    return run_ranks(value_reference_weights, 1, ARCH, 4)[0]


def mixed_requests():
    rng = random.Random(0)
    batch = [[rng.randrange(ARCH.vocab_size) for _ in range(rng.randint(1, 50))] for _ in range(9)]
    return batch, [[ids] for ids in batch]


def direct_values(weights, batch):
    """Reference: the value model on each sequence alone, one process, unpacked."""
    return run_ranks(value_model_direct, 1, ARCH, weights, batch)[0]


@pytest.mark.parametrize("tp,cp,world,pp", [(1, 1, 2, 1), (1, 2, 2, 1), (1, 1, 2, 2)])
def test_batched_scoring_equals_per_sequence_scoring(weights, tp, cp, world, pp):
    batch, singles = mixed_requests()
    results = run_ranks(critic_scores, world, ARCH, weights, tp, cp, [batch, *singles], 64, pp)[0]
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


@pytest.mark.parametrize("tp,cp,world,pp", [(1, 1, 2, 1), (1, 2, 2, 1), (1, 1, 2, 2)])
def test_isolated_requests_score_bit_for_bit_as_alone(weights, tp, cp, world, pp):
    """With the request sizes (value.service.isolate_requests, the default) a merged batch gives
    every request exactly the values it gets scored alone, whatever arrived with it."""
    batch, _ = mixed_requests()
    requests = [batch[:3], batch[3:4], batch[4:8], batch[8:]]
    merged, alone = run_ranks(critic_scores_isolated, world, ARCH, weights, tp, cp, requests, 64, pp)[0]
    start = 0
    for (values, boots), request in zip(alone, requests):
        for i in range(len(request)):
            assert merged[0][start + i] == values[i] and merged[1][start + i] == boots[i], (start, i)
        start += len(request)
    assert start == len(batch) and max(abs(b) for b in merged[1]) > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize(
    "tp,cp,world,pp", [(1, 1, 4, 1), (1, 2, 4, 1), (1, 4, 4, 1), (2, 1, 4, 1), (1, 2, 4, 2), (1, 1, 4, 2)]
)
def test_batched_scoring_on_four_ranks(weights, tp, cp, world, pp):
    test_batched_scoring_equals_per_sequence_scoring(weights, tp, cp, world, pp)


# Rank functions: module-level, so that the spawned ranks can import them.


def value_reference_weights(rank, world_size, arch, seed):
    """Random full weights of a TP=1 value model (non-zero head)."""
    from megatron_rl.models.value_model import build_value_model

    parallel.initialize_model_parallel(seed=seed)
    torch.manual_seed(seed)
    return full_parameters(build_value_model(arch, head_init_std=0.5))

def critic_scores(rank, world_size, arch, full, tp, cp, requests, seq_len=64, pp=1):
    """Scores each request (a list of token-id lists) with a value model at (tp, cp, pp,
    dp = rest); rank 0 returns its ScoreResults as plain lists, other ranks None."""
    from megatron_rl.critic.scoring import score_sequences
    from megatron_rl.models.value_model import build_value_model

    parallel.initialize_model_parallel(tp=tp, cp=cp, pp=pp)
    model = build_value_model(arch, tp=tp, cp=cp, pp=pp)
    load_full_state_dict(model, full)
    results = []
    for request in requests:
        result = score_sequences(model, request if rank == 0 else None, seq_len)
        if result is not None:
            results.append(([v.tolist() for v in result.values], result.bootstrap_values))
    return results if rank == 0 else None

def critic_scores_isolated(rank, world_size, arch, full, tp, cp, requests, seq_len=64, pp=1):
    """Scores the requests merged with their sizes, then each alone; rank 0 returns
    ((values, boots) merged, [(values, boots) of each alone]), other ranks None."""
    from megatron_rl.critic.scoring import score_sequences
    from megatron_rl.models.value_model import build_value_model

    parallel.initialize_model_parallel(tp=tp, cp=cp, pp=pp)
    model = build_value_model(arch, tp=tp, cp=cp, pp=pp)
    load_full_state_dict(model, full)

    def score(request, sizes):
        result = score_sequences(model, request if rank == 0 else None, seq_len, sizes if rank == 0 else None)
        return None if result is None else ([v.tolist() for v in result.values], result.bootstrap_values)

    merged = score([ids for r in requests for ids in r], [len(r) for r in requests])
    alone = [score(r, [len(r)]) for r in requests]
    return (merged, alone) if rank == 0 else None


def value_model_direct(rank, world_size, arch, full, batch):
    """Head output per token for each sequence alone ([T] float32 each), TP=1, unpacked."""
    from megatron_rl.models.value_model import build_value_model

    parallel.initialize_model_parallel()
    model = build_value_model(arch)
    load_full_state_dict(model, full)
    model.eval()
    with torch.no_grad():
        return [
            model(torch.tensor([ids]), torch.arange(len(ids))[None], attention_mask=None)[0] for ids in batch
        ]
