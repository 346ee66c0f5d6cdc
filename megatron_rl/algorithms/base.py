"""The orchestrator side of an algorithm: its advantages (and for critic algorithms values and
returns), prepared for a whole training step before it is trained on.

`make_algorithm(config.algorithm, scorer)` picks the kind from `algorithm.advantage`: `gae`
(PPO, SAO presets) is a `CriticAlgorithm`, which calls an injected `ValueScorer` (HTTP in critic/,
in-process in tests) once per group and runs skip-observation GAE; every other estimator is an
`OutcomeAlgorithm` over the step's member rewards (algorithms/registry.py: the protocol, the
built-ins, plug-ins). The trainer side, the policy loss, is `registry.policy_loss_for(config)`:
the policy trainer needs no scorer.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from megatron_rl.algorithms import advantages as adv
from megatron_rl.algorithms import registry
from megatron_rl.algorithms.distillation import Distillation, baselines
from megatron_rl.config import AlgorithmConfig
from megatron_rl.data.types import ScoreResult, TrainingSample


@runtime_checkable
class ValueScorer(Protocol):
    """Scores sequences: per-token values and one bootstrap value per sequence, in order."""

    async def score(self, batched_token_ids: list[list[int]]) -> ScoreResult: ...


class ScoreReplyError(ValueError):
    """The critic's reply does not match the request."""


def _pad(rows: Sequence[np.ndarray], dtype: torch.dtype, fill=0) -> torch.Tensor:
    longest = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), longest), fill, dtype=dtype)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.as_tensor(np.asarray(row))
    return out


class Algorithm(ABC):
    """What the orchestrator needs from an algorithm: `prepare_batch` over a step's groups. With
    `distillation` (algorithms/distillation.py) the teacher scores every sample first; under its
    mode "reward" the dense reward joins the task reward (GAE per token; outcome estimators its
    sum), under "advantage" each action token's advantage gets -coef * k_t after the estimator."""

    needs_critic = False

    def __init__(self, config: AlgorithmConfig, distillation: Distillation | None = None):
        self.config = config
        self.distillation = distillation

    async def score_teacher(self, groups: list[list[TrainingSample]]) -> None:
        if self.distillation is not None:
            await self.distillation.score([s for group in groups for s in group])

    def dense_reward(self, sample: TrainingSample) -> float:
        """The teacher's dense reward summed over the sample (0 without distillation or unless its
        mode is "reward")."""
        return 0.0 if self.distillation is None else float(self.distillation.rewards(sample).sum())

    async def prepare_batch(self, groups: list[list[TrainingSample]], version: int | None = None) -> None:
        """Annotates `advantages` (and for critic algorithms `values`, `returns`) in place, for
        every sample of the step's admitted groups; `version`: the policy version the step
        trains (the step's index; None: the newest version in the samples). The estimator's
        advantages (`estimate`), then distillation's per-token term (`add_teacher_advantages`)."""
        await self.estimate(groups, version)
        self.add_teacher_advantages(groups)

    @abstractmethod
    async def estimate(self, groups: list[list[TrainingSample]], version: int | None = None) -> None:
        """The estimator's advantages (and values, returns), the teacher's scores first."""

    def add_teacher_advantages(self, groups: list[list[TrainingSample]]) -> None:
        """Distillation's mode "advantage": A_t += -coef * k_t on every action token, after the
        estimator (and its whitening): the token's own reverse KL, a discount of 0 (Tinker's
        `incorporate_kl_penalty`), the critic's returns untouched; with `distillation.baseline`
        A_t += -coef * (k_t - b), b the mean k_t over the step's action tokens or the group's
        (`distillation.baselines`)."""
        if self.distillation is None or self.distillation.mode != "advantage":
            return
        for group, b in zip(groups, baselines(groups, self.distillation.baseline)):
            for sample in group:
                added = sample.advantages.astype(np.float64) + self.distillation.token_advantages(sample, b)
                sample.advantages = added.astype(np.float32)

    async def prepare_group(self, samples: list[TrainingSample], version: int | None = None) -> None:
        """`prepare_batch` of a step made of this one group."""
        await self.prepare_batch([samples], version)


class OutcomeAlgorithm(Algorithm):
    """One scalar advantage per member from the step's rewards (`algorithm.advantage`: grpo,
    dr_grpo, rloo, reinforce_pp, reinforce_pp_baseline or a plug-in), on every action token."""

    def __init__(self, config: AlgorithmConfig, distillation: Distillation | None = None):
        super().__init__(config, distillation)
        self.estimator = registry.advantage_for(config)

    async def estimate(self, groups: list[list[TrainingSample]], version: int | None = None) -> None:
        await self.score_teacher(groups)
        rewards = [torch.tensor([s.reward + self.dense_reward(s) for s in group], dtype=torch.float64) for group in groups]
        action_tokens = [torch.tensor([s.num_action_tokens for s in group], dtype=torch.int64) for group in groups]
        scalars = self.estimator(rewards, action_tokens)
        name = f"algorithm.advantage {self.config.advantage!r}"
        if not isinstance(scalars, list | tuple) or len(scalars) != len(groups):
            got = len(scalars) if isinstance(scalars, list | tuple) else type(scalars).__name__
            raise ValueError(f"{name} returned {got} advantage tensors for {len(groups)} groups (one per group)")
        for group, values, given in zip(groups, scalars, rewards):
            values = torch.as_tensor(values, dtype=torch.float64)
            if values.shape != given.shape:
                raise ValueError(
                    f"{name} returned shape {tuple(values.shape)} for group {group[0].group_id} of "
                    f"{len(group)} members (expected {tuple(given.shape)})"
                )
            if not torch.isfinite(values).all():
                raise ValueError(f"{name} returned non-finite advantages for group {group[0].group_id}: {values.tolist()}")
            for sample, value in zip(group, values.tolist()):
                sample.advantages = np.where(sample.loss_mask, value, 0.0).astype(np.float32)


class CriticAlgorithm(Algorithm):
    """Critic values from the scorer (one request per group, all groups at once), skip-observation
    GAE per group, and with `whiten_advantages` the step's advantages whitened over all its action
    tokens (verl's masked_whiten on GAE advantages)."""

    needs_critic = True

    def __init__(self, config: AlgorithmConfig, scorer: ValueScorer | None, distillation: Distillation | None = None):
        super().__init__(config, distillation)
        if scorer is None:
            raise ValueError(
                f"algorithm.advantage '{config.advantage}' (algorithm.type '{config.type}') needs a ValueScorer "
                "(the critic), got None"
            )
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

    def compute_advantages(self, samples: list[TrainingSample], version: int | None = None) -> None:
        """Decoupled skip-observation GAE on scored samples; annotates advantages and returns
        (`algorithm.value_targets` 'version_bootstrap': returns cut at the samples' version
        boundaries, for policy `version`)."""
        c = self.config
        batch = dict(
            rewards=torch.tensor([s.reward for s in samples], dtype=torch.float64),
            values=_pad([s.values for s in samples], torch.float64),
            loss_mask=_pad([s.loss_mask for s in samples], torch.bool, False),
            bootstrap_values=torch.tensor([s.bootstrap_value for s in samples], dtype=torch.float64),
            truncated=torch.tensor([s.truncated and not s.episode_done for s in samples]),  # bootstrap the tail
            gamma=c.gamma,
            kl_rewards=None if self.distillation is None else _pad([self.distillation.rewards(s) for s in samples],
                                                                   torch.float64),  # the teacher's, per token
        )  # fmt: skip
        advantages, returns = adv.decoupled_gae(**batch, policy_lambda=c.policy_lambda, value_lambda=c.value_lambda,
                                                length_adaptive_alpha=c.length_adaptive_alpha)  # fmt: skip
        if c.value_targets == "version_bootstrap":
            versions = _pad([s.versions() for s in samples], torch.int64)
            newest = int(versions.max()) if versions.numel() else 0
            returns, _ = adv.version_bootstrap_returns(
                **batch, lam=c.value_lambda, token_versions=versions, current_version=newest if version is None else version,
                max_lag=c.value_targets_max_lag,
            )  # fmt: skip
        for i, sample in enumerate(samples):
            sample.advantages = advantages[i, : len(sample)].numpy().astype(np.float32)
            sample.returns = returns[i, : len(sample)].numpy().astype(np.float32)

    async def estimate(self, groups: list[list[TrainingSample]], version: int | None = None) -> None:
        await asyncio.gather(self.score_teacher(groups), *[self.score_samples(group) for group in groups])
        for group in groups:
            if group:
                self.compute_advantages(group, version)
        if self.config.whiten_advantages:
            samples = [s for group in groups for s in group]
            rows = [torch.from_numpy(s.advantages.astype(np.float64)) for s in samples]
            masks = [torch.from_numpy(s.loss_mask) for s in samples]
            for sample, row in zip(samples, adv.masked_whiten(rows, masks)):
                sample.advantages = row.numpy().astype(np.float32)


def make_algorithm(config: AlgorithmConfig, scorer: ValueScorer | None = None,
                   distillation: Distillation | None = None) -> Algorithm:  # fmt: skip
    """The algorithm `config.advantage` calls for: a CriticAlgorithm for an estimator that reads the
    critic's values (gae), else an OutcomeAlgorithm; either with `distillation`'s teacher."""
    if registry.needs_critic(config.advantage):
        return CriticAlgorithm(config, scorer, distillation)
    return OutcomeAlgorithm(config, distillation)
