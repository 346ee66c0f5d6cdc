"""The value-pretraining JSONL reader: Monte Carlo returns, precomputed returns, clear errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

from megatron_rl.critic.pretrain import PretrainDataError, pretrain_batches, read_pretrain_jsonl


def write(tmp_path, records):
    path = tmp_path / "values.jsonl"
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n")
    return path


def test_monte_carlo_and_precomputed_returns(tmp_path):
    path = write(
        tmp_path,
        [
            {"token_ids": [1, 2, 3, 4, 5], "loss_mask": [0, 1, 0, 1, 1], "reward": 2.0},
            {"token_ids": [7, 8], "loss_mask": [False, True], "returns": [9.0, 0.5]},
        ],
    )
    first, second = read_pretrain_jsonl(path, vocab_size=10, seq_len=8, gamma=0.5)
    # action tokens 1, 3, 4: returns gamma^2 R, gamma R, R; observation tokens 0
    np.testing.assert_allclose(first.returns, [0, 0.5, 0, 1.0, 2.0])
    np.testing.assert_allclose(second.returns, [0, 0.5])  # masked-off entries are dropped
    assert first.values.tolist() == [0] * 5 and second.loss_mask.tolist() == [False, True]


@pytest.mark.parametrize(
    "line,message",
    [
        ("not json", "values.jsonl:2:"),
        ('["a list"]', "Expected `object`, got `array`"),
        ('{"token_ids": [1], "loss_mask": [1]}', "exactly one of 'reward'"),
        ('{"token_ids": [1], "loss_mask": [1], "reward": 1, "returns": [1]}', "exactly one of 'reward'"),
        ('{"token_ids": [1, 2], "loss_mask": [1], "reward": 1}', "loss_mask must be 2 booleans"),
        ('{"token_ids": [1, 2], "loss_mask": [0, 0], "reward": 1}', "no True entry"),
        ('{"token_ids": [1, 20], "loss_mask": [0, 1], "reward": 1}', "outside the vocabulary"),
        ('{"token_ids": [1, 2.0], "loss_mask": [0, 1], "reward": 1}', "Expected `int`, got `float` - at `$.token_ids[1]`"),
        ('{"loss_mask": [1], "reward": 1}', "missing required field `token_ids`"),
        ('{"token_ids": [1], "loss_mask": [1], "reward": "high"}', "got `str` - at `$.reward`"),
        ('{"token_ids": [1], "loss_mask": [1], "reward": NaN}', "JSON is malformed"),  # NaN is not JSON
        ('{"token_ids": [1], "loss_mask": [1], "reward": 1e39}', "reward must be a finite float32 number, got 1e+39"),
        ('{"token_ids": [1, 2], "loss_mask": [0, 1], "returns": [0, 1e39]}', "returns must be 2 finite float32 numbers"),
        ('{"token_ids": [1], "loss_mask": [1], "returns": [1, 2]}', "returns must be 1 finite float32 numbers"),
        ('{"token_ids": [1], "loss_mask": [1], "reward": 1, "extra": 0}', "unknown field `extra`"),
        (
            '{"token_ids": ' + str(list(range(9))) + ', "loss_mask": ' + str([1] * 9) + ', "reward": 1}',
            "9 tokens",
        ),
    ],
)
def test_bad_lines_name_file_and_line(tmp_path, line, message):
    path = write(tmp_path, [{"token_ids": [1], "loss_mask": [1], "reward": 1.0}, line])
    with pytest.raises(PretrainDataError) as info:
        read_pretrain_jsonl(path, vocab_size=10, seq_len=8)
    assert "values.jsonl:2" in str(info.value) and message in str(info.value)


def test_missing_or_empty_file(tmp_path):
    with pytest.raises(PretrainDataError, match="does not exist"):
        read_pretrain_jsonl(tmp_path / "nope.jsonl", 10, 8)
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(PretrainDataError, match="holds no samples"):
        read_pretrain_jsonl(tmp_path / "empty.jsonl", 10, 8)


def test_batches_cover_every_sample_each_pass_and_are_seeded(tmp_path):
    samples = list(range(5))
    batches = list(pretrain_batches(samples, batch_size=2, steps=5, seed=3))
    assert [len(b) for b in batches] == [2] * 5
    flat = [x for b in batches for x in b]
    assert sorted(flat[:5]) == samples and sorted(flat[5:10]) == samples
    assert batches == list(pretrain_batches(samples, 2, 5, seed=3))
