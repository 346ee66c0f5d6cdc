"""Value pretraining data: a JSONL file of samples the critic trains on before RL starts.

Each line is one object: `token_ids` (ints), `loss_mask` (bools/0/1, same length; True on the
tokens whose value is trained, i.e. the action tokens) and either `reward` (a terminal scalar:
returns are Monte Carlo, `gamma ** (K - k) * reward` on the k-th of K action tokens, the same as
skip-observation GAE with lambda 1 and zero values) or `returns` (per token, precomputed).
Every line is checked when the file is read; an error names the file and the line.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np
import torch

from megatron_rl.algorithms.advantages import skip_observation_gae
from megatron_rl.data.types import TrainingSample


class PretrainDataError(ValueError):
    pass


def _finite32(x) -> bool:
    """Finite, and still finite as the float32 the critic trains on."""
    return bool(np.isfinite(x)) and abs(x) <= float(np.finfo(np.float32).max)


class PretrainRecord(msgspec.Struct, forbid_unknown_fields=True):
    """One line of the file (the types are checked when it is decoded, errors name the JSON path)."""

    token_ids: list[int]
    loss_mask: list[bool | int]
    reward: float | None = None
    returns: list[float] | None = None


def _sample(record: PretrainRecord, vocab_size: int, seq_len: int) -> TrainingSample:
    """The record's sample (returns still to compute when it gives a reward); ValueError when a
    value is impossible."""
    ids = record.token_ids
    if not ids or len(ids) > seq_len:
        raise ValueError(f"token_ids has {len(ids)} tokens; 1..{seq_len} (value.model.seq_len) allowed")
    if min(ids) < 0 or max(ids) >= vocab_size:
        raise ValueError(f"token_ids outside the vocabulary 0..{vocab_size - 1}")
    if len(record.loss_mask) != len(ids) or not all(m in (0, 1) for m in record.loss_mask):
        raise ValueError(f"loss_mask must be {len(ids)} booleans (or 0/1), one per token")
    mask = np.asarray(record.loss_mask, dtype=bool)
    if not mask.any():
        raise ValueError("loss_mask has no True entry: nothing to train on")
    if (record.reward is None) == (record.returns is None):
        raise ValueError("give exactly one of 'reward' (a number) or 'returns' (one number per token)")
    sample = TrainingSample(
        token_ids=ids, loss_mask=mask, inference_logprobs=np.zeros(len(ids), np.float32), reward=0.0
    )
    if record.reward is not None:
        if not _finite32(record.reward):
            raise ValueError(f"reward must be a finite float32 number, got {record.reward!r}")
        sample.reward = record.reward
    else:
        returns = record.returns
        if len(returns) != len(ids) or not all(_finite32(r) for r in returns):
            raise ValueError(f"returns must be {len(ids)} finite float32 numbers, one per token")
        sample.returns = np.where(mask, np.asarray(returns, np.float32), 0.0).astype(np.float32)
    return sample


def read_pretrain_jsonl(
    path: str | Path, vocab_size: int, seq_len: int, gamma: float = 1.0
) -> list[TrainingSample]:
    """All samples of the file with `returns` set (float32, 0 off the loss mask)."""
    path = Path(path)
    if not path.is_file():
        raise PretrainDataError(f"value.pretrain_jsonl: {path} does not exist")
    decoder = msgspec.json.Decoder(PretrainRecord)
    samples: list[TrainingSample] = []
    with open(path, "rb") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                samples.append(_sample(decoder.decode(line), vocab_size, seq_len))
            except (ValueError, msgspec.DecodeError) as exc:  # msgspec.ValidationError is a DecodeError
                raise PretrainDataError(f"{path}:{number}: {exc}") from None
    if not samples:
        raise PretrainDataError(f"value.pretrain_jsonl: {path} holds no samples")
    from_rewards = [s for s in samples if s.returns is None]
    if from_rewards:
        _monte_carlo_returns(from_rewards, gamma)
    for sample in samples:
        sample.values = np.zeros(len(sample), np.float32)
    return samples


def _monte_carlo_returns(samples: list[TrainingSample], gamma: float) -> None:
    longest = max(len(s) for s in samples)
    mask = torch.zeros(len(samples), longest, dtype=torch.bool)
    for i, s in enumerate(samples):
        mask[i, : len(s)] = torch.from_numpy(s.loss_mask)
    zeros = torch.zeros(len(samples), dtype=torch.float64)
    _, returns = skip_observation_gae(
        rewards=torch.tensor([s.reward for s in samples], dtype=torch.float64),
        values=torch.zeros(mask.shape, dtype=torch.float64),
        loss_mask=mask,
        bootstrap_values=zeros,
        truncated=torch.zeros(len(samples), dtype=torch.bool),
        gamma=gamma,
        lam=1.0,
    )
    for i, s in enumerate(samples):
        s.returns = returns[i, : len(s)].numpy().astype(np.float32)


def pretrain_batches(samples: list[TrainingSample], batch_size: int, steps: int, seed: int):
    """`steps` batches of `batch_size` samples: passes over the data in a seeded random order
    (the same on every rank), the last batch of a pass topped up from the next pass."""
    rng = np.random.default_rng(seed)
    order: list[int] = []
    for _ in range(steps):
        while len(order) < batch_size:
            order.extend(rng.permutation(len(samples)).tolist())
        batch, order = order[:batch_size], order[batch_size:]
        yield [samples[i] for i in batch]
