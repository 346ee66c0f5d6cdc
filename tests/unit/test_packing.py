"""pack_into_grid / unpack / packing_stats: properties over random inputs, and the error cases."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_rl.data.packing import (
    PackingError,
    pack_into_grid,
    pack_minibatches,
    packing_stats,
    split_into_minibatches,
    unpack,
)
from megatron_rl.data.types import TrainingSample
from tests.support.top_k import add_teacher_top_k


def make_samples(lengths, seed=0, annotate=True):
    rng = np.random.default_rng(seed)
    samples = []
    for i, n in enumerate(lengths):
        mask = rng.random(n) < 0.7
        samples.append(
            TrainingSample(
                token_ids=rng.integers(1, 1000, n),
                loss_mask=mask,
                inference_logprobs=np.where(mask, -rng.random(n), 0.0),
                reward=float(rng.normal()),
                group_id=i // 3,
                branch_index=i % 3,
                values=rng.normal(size=n).astype(np.float32) if annotate else None,
                advantages=rng.normal(size=n).astype(np.float32) if annotate else None,
                returns=rng.normal(size=n).astype(np.float32) if annotate else None,
            )
        )
    return samples


def check_grid(samples, grid, seq_len, dp, cp):
    assert len(grid) == dp
    steps = {len(row) for row in grid}
    assert len(steps) == 1, f"unequal micro-step counts {steps}"
    seen = []
    for row in grid:
        for mb in row:
            assert mb.num_tokens <= seq_len and mb.num_tokens % cp == 0
            arrays = mb.arrays()
            assert all(len(a) == mb.num_tokens for k, a in arrays.items() if k != "cu_seqlens")
            if mb.is_dummy:
                assert not mb.loss_mask.any() and (mb.sample_index == -1).all()
                continue
            real = int(mb.cu_seqlens[-1])
            assert not mb.loss_mask[real:].any() and (mb.sample_index[real:] == -1).all()
            for start, end in zip(mb.cu_seqlens[:-1], mb.cu_seqlens[1:]):
                index = int(mb.sample_index[start])
                sample = samples[index]
                assert (mb.sample_index[start:end] == index).all()
                np.testing.assert_array_equal(mb.position_ids[start:end], np.arange(end - start))
                np.testing.assert_array_equal(mb.input_ids[start:end], sample.token_ids)
                np.testing.assert_array_equal(mb.loss_mask[start:end], sample.loss_mask)
                np.testing.assert_array_equal(mb.inference_logprobs[start:end], sample.inference_logprobs)
                if sample.advantages is not None:
                    np.testing.assert_array_equal(mb.advantages[start:end], sample.advantages)
                    np.testing.assert_array_equal(mb.returns[start:end], sample.returns)
                    np.testing.assert_array_equal(mb.old_values[start:end], sample.values)
                seen.append(index)
    # Every sample exactly once.
    assert sorted(seen) == list(range(len(samples)))
    # unpack restores original order.
    outputs = [[mb.input_ids.astype(np.float64) * 2 for mb in row] for row in grid]
    restored = unpack(grid, outputs, len(samples))
    for sample, out in zip(samples, restored):
        np.testing.assert_array_equal(out, sample.token_ids * 2)


@settings(max_examples=80, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 64), min_size=1, max_size=40),
    dp=st.integers(1, 4),
    cp=st.sampled_from([1, 2, 4]),
    seed=st.integers(0, 1000),
)
def test_grid_properties(lengths, dp, cp, seed):
    samples = make_samples(lengths, seed, annotate=seed % 2 == 0)
    seq_len = 64
    grid = pack_into_grid(samples, seq_len, dp, cp)
    check_grid(samples, grid, seq_len, dp, cp)


@pytest.mark.parametrize("dp,cp", [(1, 1), (2, 1), (2, 2), (3, 4), (8, 2)])
def test_seeded_sizes(dp, cp):
    rng = np.random.default_rng(dp * 10 + cp)
    for trial in range(5):
        lengths = rng.integers(1, 512, rng.integers(1, 60)).tolist()
        samples = make_samples(lengths, trial)
        grid = pack_into_grid(samples, 512, dp, cp)
        check_grid(samples, grid, 512, dp, cp)


def test_oversize_sample_is_rejected_with_both_lengths():
    samples = make_samples([10, 70, 5])
    with pytest.raises(
        PackingError, match=r"sample 1 \(group 0, branch 1\) has 70 tokens, longer than seq_len 64"
    ):
        pack_into_grid(samples, 64, 2)


def test_seq_len_must_divide_by_cp():
    with pytest.raises(
        PackingError,
        match=r"seq_len \(63\) must be a multiple of context_parallel_size x sequence_parallel_size \(2\)",
    ):
        pack_into_grid(make_samples([5]), 63, 1, 2)


def test_sequence_parallel_pads_bins_to_cp_times_tp():
    samples = make_samples([5, 9, 30, 3, 17])
    grid = pack_into_grid(samples, 64, 2, 2, sequence_parallel_size=2)
    check_grid(samples, grid, 64, 2, 4)


def test_cp_padding_never_pushes_a_bin_over_seq_len():
    # 63 + 1 tokens fit in 64, but with CP=4 the bin holding 63 pads to 64 and nothing else fits.
    samples = make_samples([63, 1, 62, 2])
    grid = pack_into_grid(samples, 64, 1, 4)
    check_grid(samples, grid, 64, 1, 4)


def test_fewer_bins_than_ranks_fill_with_dummies():
    samples = make_samples([5, 6])
    grid = pack_into_grid(samples, 64, 4, 2)
    check_grid(samples, grid, 64, 4, 2)
    stats = packing_stats(grid, 64)
    assert stats["dummies"] == 4 * stats["micro_steps"] - stats["num_bins"]
    assert all(len(row) == 1 for row in grid)


def test_two_layouts_give_independent_grids():
    samples = make_samples(np.random.default_rng(0).integers(1, 200, 30).tolist())
    policy = pack_into_grid(samples, 256, 2, 2)
    critic = pack_into_grid(samples, 512, 3, 1)
    check_grid(samples, policy, 256, 2, 2)
    check_grid(samples, critic, 512, 3, 1)
    policy[0][0].advantages[:] = 99.0  # writing into one grid touches neither the other nor the samples
    assert not any((mb.advantages == 99.0).any() for row in critic for mb in row)
    assert not any((s.advantages == 99.0).any() for s in samples)


def test_balance_and_bin_count_on_long_tailed_lengths():
    rng = np.random.default_rng(1)
    lengths = (rng.integers(100, 600, 128) + np.minimum(rng.lognormal(np.log(2000), 0.9, 128), 7000)).astype(
        int
    )
    samples = make_samples(lengths.tolist(), annotate=False)
    for dp in (2, 4):
        stats = packing_stats(pack_into_grid(samples, 8192, dp), 8192)
        assert stats["num_bins"] <= 1.03 * stats["lower_bound_bins"] + 1
        assert stats["dp_imbalance"] <= 1.05
        assert stats["fill_ratio"] > 0.9


def test_unpack_rejects_missing_and_mismatched_outputs():
    samples = make_samples([5, 6, 7])
    grid = pack_into_grid(samples, 8, 1)
    with pytest.raises(ValueError, match="tokens for a micro-batch"):
        unpack(grid, [[np.zeros(1) for _ in row] for row in grid])
    with pytest.raises(ValueError, match=r"no output for samples \[3\]"):
        unpack(grid, [[np.zeros(mb.num_tokens) for mb in row] for row in grid], num_samples=4)


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 64), min_size=1, max_size=40),
    minibatches=st.integers(1, 6),
    dp=st.integers(1, 4),
    cp=st.sampled_from([1, 2]),
    seed=st.integers(0, 1000),
)
def test_minibatch_grids(lengths, minibatches, dp, cp, seed):
    """Each mini-batch is its own balanced grid (equal micro-steps on every data rank), every
    sample is in exactly one, sizes differ by at most one, and the split is reproducible."""
    samples = make_samples(lengths, seed)
    grid = pack_minibatches(samples, minibatches, (seed, 3), 64, dp, cp)
    parts = split_into_minibatches(len(samples), minibatches, (seed, 3))
    assert len(parts) == min(minibatches, len(samples))
    assert sorted(i for part in parts for i in part) == list(range(len(samples)))
    assert max(map(len, parts)) - min(map(len, parts)) <= 1
    assert parts == split_into_minibatches(len(samples), minibatches, (seed, 3))
    for k, part in enumerate(parts):
        rows = [[mb for mb in row if mb.minibatch == k] for row in grid]
        assert len({len(r) for r in rows}) == 1  # the same number of micro-steps on every rank
        real = {int(mb.sample_index[start]) for row in rows for mb in row if not mb.is_dummy
                for start in mb.cu_seqlens[:-1]}  # fmt: skip
        assert real == set(part)
    for row in grid:  # mini-batches come in order
        assert [mb.minibatch for mb in row] == sorted(mb.minibatch for mb in row)
    check_grid(samples, grid, 64, dp, cp)


def test_one_minibatch_is_exactly_pack_into_grid():
    samples = make_samples([5, 40, 17, 33, 9, 61, 2], seed=4)
    grid = pack_minibatches(samples, 1, 123, 64, 2, 2)
    reference = pack_into_grid(samples, 64, 2, 2)
    for row, reference_row in zip(grid, reference, strict=True):
        for mb, expected in zip(row, reference_row, strict=True):
            assert mb.minibatch == 0 and mb.is_dummy == expected.is_dummy
            for name, array in expected.arrays().items():
                np.testing.assert_array_equal(mb.arrays()[name], array)


def test_split_differs_by_seed_and_step():
    assert split_into_minibatches(40, 4, (0, 1)) != split_into_minibatches(40, 4, (0, 2))
    assert split_into_minibatches(0, 4, 1) == [[]]
    with pytest.raises(PackingError, match="num_minibatches must be >= 1"):
        split_into_minibatches(5, 0, 1)


@pytest.mark.parametrize("dp, cp, minibatches", [(1, 1, 1), (2, 2, 1), (3, 1, 2)])
def test_teacher_top_k_rows_follow_their_tokens(dp, cp, minibatches):
    """With `teacher_top_k` every real micro-batch carries [N, K] int32 / float32 rows: each
    sequence's rows are its sample's, the padding's ids 0 and log-probabilities 0; dummies carry
    none; without the flag no micro-batch carries them."""
    samples = add_teacher_top_k(make_samples([5, 40, 17, 33, 9, 61, 2, 3], seed=5), 1000, 6, seed=5)
    grid = pack_minibatches(samples, minibatches, 9, 64, dp, cp, teacher_top_k=True)
    seen = set()
    for mb in (mb for row in grid for mb in row):
        if mb.is_dummy:
            assert mb.teacher_top_ids is None and mb.teacher_top_logprobs is None
            continue
        assert mb.teacher_top_ids.dtype == np.int32 and mb.teacher_top_logprobs.dtype == np.float32
        assert mb.teacher_top_ids.shape == mb.teacher_top_logprobs.shape == (mb.num_tokens, 6)
        for start, end in zip(mb.cu_seqlens[:-1], mb.cu_seqlens[1:]):
            sample = samples[int(mb.sample_index[start])]
            np.testing.assert_array_equal(mb.teacher_top_ids[start:end], sample.teacher_top_ids)
            np.testing.assert_array_equal(mb.teacher_top_logprobs[start:end], sample.teacher_top_logprobs)
            seen.add(int(mb.sample_index[start]))
        tail = slice(int(mb.cu_seqlens[-1]), None)
        assert not mb.teacher_top_ids[tail].any() and not mb.teacher_top_logprobs[tail].any()
    assert seen == set(range(len(samples)))
    assert any(mb.num_tokens > mb.cu_seqlens[-1] for row in grid for mb in row) == (cp > 1)
    assert all(mb.teacher_top_ids is None for row in pack_into_grid(samples, 64, dp, cp) for mb in row)


def test_teacher_top_k_missing_or_misshapen_is_refused_naming_the_sample():
    samples = add_teacher_top_k(make_samples([5, 7, 9, 4], seed=6), 1000, 3, seed=6)
    samples[2].teacher_top_logprobs = None
    with pytest.raises(PackingError, match=r"sample 2 \(group 0, branch 2\) has no teacher_top_ids / teacher_top_logprobs"):
        pack_into_grid(samples, 64, 1, teacher_top_k=True)
    samples = add_teacher_top_k(make_samples([5, 7, 9, 4], seed=6), 1000, 3, seed=6)
    samples[3].teacher_top_ids = samples[3].teacher_top_ids[:-1]
    with pytest.raises(PackingError, match=r"sample 3 \(group 1, branch 0\): teacher_top_ids of shape \(3, 3\) .*"
                                           r"expected both \[4 tokens, K\]"):  # fmt: skip
        pack_into_grid(samples, 64, 1, teacher_top_k=True)
    samples = add_teacher_top_k(make_samples([5, 7], seed=6), 1000, 3, seed=6)
    samples[1] = add_teacher_top_k([samples[1]], 1000, 4)[0]
    with pytest.raises(PackingError, match=r"samples \[0, 1\] carry teacher top k of different K: \[3, 4\]"):
        pack_into_grid(samples, 64, 1, teacher_top_k=True)
