"""The orchestrator side of an algorithm: GRPOAlgorithm, PPOAlgorithm, SAOAlgorithm prepare each
group's advantages (and for critic algorithms values and returns) before it is trained on.

`make_algorithm(config.algorithm, scorer)` picks the class from `algorithm.type`. PPO and SAO
call an injected `ValueScorer` (HTTP in critic/, in-process in tests) once per group. The
trainer side, the policy loss, is `losses.policy_objective(config)`: the policy trainer needs
no scorer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from megatron_rl.algorithms import advantages as adv
from megatron_rl.config import AlgorithmConfig
from megatron_rl.data.types import ScoreResult, TrainingSample


@runtime_checkable
class ValueScorer(Protocol):
    """Scores sequences: per-token values and one bootstrap value per sequence, in order."""

    async def score(self, batched_token_ids: list[list[int]]) -> ScoreResult: ...


class InProcessScorer:
    """A ValueScorer over a plain function (tests, single-process tools). Records its calls."""

    def __init__(self, score_fn: Callable[[list[list[int]]], ScoreResult]):
        self.score_fn = score_fn
        self.calls: list[list[list[int]]] = []

    async def score(self, batched_token_ids: list[list[int]]) -> ScoreResult:
        self.calls.append(batched_token_ids)
        return self.score_fn(batched_token_ids)


class ScoreReplyError(ValueError):
    """The critic's reply does not match the request."""


def _pad(rows: Sequence[np.ndarray], dtype: torch.dtype, fill=0) -> torch.Tensor:
    longest = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), longest), fill, dtype=dtype)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.as_tensor(np.asarray(row))
    return out


class Algorithm(ABC):
    """What the orchestrator needs from an algorithm: `prepare_group`."""

    needs_critic = False

    def __init__(self, config: AlgorithmConfig):
        self.config = config

    @abstractmethod
    async def prepare_group(self, samples: list[TrainingSample]) -> None:
        """Annotates `advantages` (and for critic algorithms `values`, `returns`) in place."""


class GRPOAlgorithm(Algorithm):
    """Group-normalised outcome rewards on every action token; no critic."""

    async def prepare_group(self, samples: list[TrainingSample]) -> None:
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
        group_ids = torch.tensor([s.group_id for s in samples])
        scalars = adv.grpo_advantages(rewards, group_ids, self.config.normalize_advantage_std)
        for sample, value in zip(samples, scalars.tolist()):
            sample.advantages = np.where(sample.loss_mask, value, 0.0).astype(np.float32)


class PPOAlgorithm(Algorithm):
    """Critic values from the scorer, skip-observation GAE (the trainer's loss: losses.policy_objective)."""

    needs_critic = True

    def __init__(self, config: AlgorithmConfig, scorer: ValueScorer | None):
        super().__init__(config)
        if scorer is None:
            raise ValueError(f"algorithm.type '{config.type}' needs a ValueScorer (the critic), got None")
        self.scorer = scorer

    async def score_samples(self, samples: list[TrainingSample]) -> None:
        """One scorer call with every branch's token_ids; annotates values and bootstrap_value."""
        if not samples:
            return
        request = [s.token_ids.tolist() for s in samples]
        reply = await self.scorer.score(request)
        group = samples[0].group_id
        if len(reply.values) != len(samples) or len(reply.bootstrap_values) != len(samples):
            raise ScoreReplyError(
                f"critic reply for group {group}: {len(reply.values)} value rows and "
                f"{len(reply.bootstrap_values)} bootstrap values for {len(samples)} sequences"
            )
        for i, (sample, values) in enumerate(zip(samples, reply.values)):
            values = np.asarray(values, dtype=np.float32)
            if values.shape != (len(sample),):
                raise ScoreReplyError(
                    f"critic reply for group {group}, sequence {i}: {values.shape[0] if values.ndim else 0} "
                    f"values for {len(sample)} tokens"
                )
            sample.values = values
            sample.bootstrap_value = float(reply.bootstrap_values[i])

    def compute_advantages(self, samples: list[TrainingSample]) -> None:
        """Decoupled skip-observation GAE on scored samples; annotates advantages and returns."""
        c = self.config
        advantages, returns = adv.decoupled_gae(
            rewards=torch.tensor([s.reward for s in samples], dtype=torch.float64),
            values=_pad([s.values for s in samples], torch.float64),
            loss_mask=_pad([s.loss_mask for s in samples], torch.bool, False),
            bootstrap_values=torch.tensor([s.bootstrap_value for s in samples], dtype=torch.float64),
            truncated=torch.tensor([s.truncated and not s.episode_done for s in samples]),  # bootstrap the tail
            gamma=c.gamma,
            policy_lambda=c.policy_lambda,
            value_lambda=c.value_lambda,
            length_adaptive_alpha=c.length_adaptive_alpha,
        )
        for i, sample in enumerate(samples):
            sample.advantages = advantages[i, : len(sample)].numpy().astype(np.float32)
            sample.returns = returns[i, : len(sample)].numpy().astype(np.float32)

    async def prepare_group(self, samples: list[TrainingSample]) -> None:
        await self.score_samples(samples)
        if samples:
            self.compute_advantages(samples)


class SAOAlgorithm(PPOAlgorithm):
    """PPO's scoring and GAE; the trainer side differs (the DIS loss: losses.policy_objective)."""


def make_algorithm(config: AlgorithmConfig, scorer: ValueScorer | None = None) -> Algorithm:
    """The algorithm named by `config.type`."""
    if config.type == "grpo":
        return GRPOAlgorithm(config)
    if config.type == "ppo":
        return PPOAlgorithm(config, scorer)
    if config.type == "sao":
        return SAOAlgorithm(config, scorer)
    raise ValueError(f"algorithm.type: unknown algorithm {config.type!r} (expected grpo, ppo or sao)")
