"""Advantages, losses and Algorithm classes. Pure: no torch.distributed, no sockets, no files."""

from megatron_rl.algorithms.advantages import (
    decoupled_gae,
    grpo_advantages,
    length_adaptive_lambda,
    skip_observation_gae,
)
from megatron_rl.algorithms.base import (
    Algorithm,
    CriticAlgorithm,
    OutcomeAlgorithm,
    ScoreReplyError,
    ValueScorer,
    make_algorithm,
)
from megatron_rl.algorithms.losses import (
    Sequences,
    cispo_loss,
    gspo_loss,
    ppo_clip_loss,
    sao_dis_loss,
    value_loss,
)
from megatron_rl.algorithms.registry import advantage_estimator, policy_loss, policy_loss_for

__all__ = [
    "Algorithm",
    "CriticAlgorithm",
    "OutcomeAlgorithm",
    "ScoreReplyError",
    "Sequences",
    "ValueScorer",
    "advantage_estimator",
    "cispo_loss",
    "decoupled_gae",
    "grpo_advantages",
    "gspo_loss",
    "length_adaptive_lambda",
    "make_algorithm",
    "policy_loss",
    "policy_loss_for",
    "ppo_clip_loss",
    "sao_dis_loss",
    "skip_observation_gae",
    "value_loss",
]
