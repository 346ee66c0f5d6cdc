"""Advantages, losses and Algorithm classes. Pure: no torch.distributed, no sockets, no files."""

from megatron_rl.algorithms.advantages import (
    decoupled_gae,
    grpo_advantages,
    length_adaptive_lambda,
    skip_observation_gae,
)
from megatron_rl.algorithms.base import (
    Algorithm,
    GRPOAlgorithm,
    InProcessScorer,
    PPOAlgorithm,
    SAOAlgorithm,
    ScoreReplyError,
    ValueScorer,
    make_algorithm,
)
from megatron_rl.algorithms.losses import ppo_clip_loss, sao_dis_loss, value_loss

__all__ = [
    "Algorithm",
    "GRPOAlgorithm",
    "InProcessScorer",
    "PPOAlgorithm",
    "SAOAlgorithm",
    "ScoreReplyError",
    "ValueScorer",
    "decoupled_gae",
    "grpo_advantages",
    "length_adaptive_lambda",
    "make_algorithm",
    "ppo_clip_loss",
    "sao_dis_loss",
    "skip_observation_gae",
    "value_loss",
]
