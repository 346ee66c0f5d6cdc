"""Value pretraining data: a JSONL file of samples the critic trains on before RL starts.

Each line is one object: `token_ids` (ints), `loss_mask` (bools/0/1, same length; True on the
tokens whose value is trained, i.e. the action tokens) and either `reward` (a terminal scalar:
returns are Monte Carlo, `gamma ** (K - k) * reward` on the k-th of K action tokens, the same as
skip-observation GAE with lambda 1 and zero values) or `returns` (per token, precomputed).
Every line is checked when the file is read; an error names the file and the line.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from megatron_rl.algorithms.advantages import skip_observation_gae
from megatron_rl.data.types import TrainingSample


class PretrainDataError(ValueError):
    pass


def _finite32(x) -> bool:
    """Finite, and still finite as the float32 the critic trains on."""
    return bool(np.isfinite(x)) and abs(x) <= float(np.finfo(np.float32).max)


def _int_list(value, what: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise ValueError(f"{what} must be a list of integers")
    return value


def read_pretrain_jsonl(
    path: str | Path, vocab_size: int, seq_len: int, gamma: float = 1.0
) -> list[TrainingSample]:
    """All samples of the file with `returns` set (float32, 0 off the loss mask)."""
    path = Path(path)
    if not path.is_file():
        raise PretrainDataError(f"value.pretrain_jsonl: {path} does not exist")
    samples: list[TrainingSample] = []
    rewards: list[int] = []  # indices of samples whose returns come from a reward
    with open(path) as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                record = json.loads(line)
                if not isinstance(record, dict):
                    raise ValueError("a line must be a JSON object")
                unknown = set(record) - {"token_ids", "loss_mask", "reward", "returns"}
                if unknown:
                    raise ValueError(f"unknown keys {sorted(unknown)}")
                ids = _int_list(record.get("token_ids"), "token_ids")
                if not ids or len(ids) > seq_len:
                    raise ValueError(
                        f"token_ids has {len(ids)} tokens; 1..{seq_len} (value.model.seq_len) allowed"
                    )
                if min(ids) < 0 or max(ids) >= vocab_size:
                    raise ValueError(f"token_ids outside the vocabulary 0..{vocab_size - 1}")
                mask = record.get("loss_mask")
                if not isinstance(mask, list) or len(mask) != len(ids) or not all(m in (0, 1) for m in mask):
                    raise ValueError(f"loss_mask must be {len(ids)} booleans (or 0/1), one per token")
                mask = np.asarray(mask, dtype=bool)
                if not mask.any():
                    raise ValueError("loss_mask has no True entry: nothing to train on")
                if ("reward" in record) == ("returns" in record):
                    raise ValueError(
                        "give exactly one of 'reward' (a number) or 'returns' (one number per token)"
                    )
                sample = TrainingSample(
                    token_ids=ids,
                    loss_mask=mask,
                    inference_logprobs=np.zeros(len(ids), np.float32),
                    reward=0.0,
                )
                if "reward" in record:
                    reward = record["reward"]
                    if not isinstance(reward, (int, float)) or isinstance(reward, bool) or not _finite32(reward):
                        raise ValueError(f"reward must be a finite float32 number, got {reward!r}")
                    sample.reward = float(reward)
                    rewards.append(len(samples))
                else:
                    returns = record["returns"]
                    if (
                        not isinstance(returns, list)
                        or len(returns) != len(ids)
                        or not all(isinstance(r, (int, float)) and not isinstance(r, bool) for r in returns)
                        or not all(_finite32(r) for r in returns)
                    ):
                        raise ValueError(f"returns must be {len(ids)} finite float32 numbers, one per token")
                    sample.returns = np.where(mask, np.asarray(returns, np.float32), 0.0).astype(np.float32)
            except (ValueError, json.JSONDecodeError) as exc:
                raise PretrainDataError(f"{where}: {exc}") from None
            samples.append(sample)
    if not samples:
        raise PretrainDataError(f"value.pretrain_jsonl: {path} holds no samples")
    if rewards:
        _monte_carlo_returns([samples[i] for i in rewards], gamma)
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
