"""A policy loss, an advantage estimator and an environment brought without forking megatron_rl
(docs/plugins.md). Put this directory on PYTHONPATH and name the parts in the config:

    algorithm.policy_loss: my_rl_parts:tempered_pg_loss
    algorithm.policy_loss_args: {clip: 2.0}
    algorithm.advantage: my_rl_parts:median_baseline
    orchestrator.environment: my_rl_parts:ShortReverse
"""

from __future__ import annotations

import torch

from megatron_rl.envs.procedural import ProceduralTask


def tempered_pg_loss(logprobs, old_logprobs, advantages, mask, *, sequences, weights, clip=2.0):
    """REINFORCE with the importance weight min(r, clip), detached, and each sequence's loss
    divided by its length (sequences.sum spans context-parallel ranks)."""
    ratio = torch.exp(logprobs - old_logprobs).detach()
    per_token = -torch.clamp(ratio, max=clip) * advantages * logprobs
    lengths = sequences.sum(mask.float())[sequences.of_token].to(logprobs.dtype)
    per_token = per_token / lengths.clamp(min=1.0)
    if weights is not None:
        per_token = per_token * weights
    loss = torch.where(mask, per_token, 0.0).sum()
    metrics = {
        "num_tokens": mask.sum().double(),
        "ratio_sum": torch.where(mask, ratio, 0.0).sum().double(),
        "clipped_sum": (mask & (ratio > clip)).sum().double(),
        "tempered_weight_sum": torch.where(mask, torch.clamp(ratio, max=clip), 0.0).sum().double(),
    }
    return loss, metrics


def median_baseline(groups, shift=0.0):
    """Each member's reward minus its group's median (plus `shift`)."""
    return [rewards - rewards.median() + shift for rewards in groups]


class ShortReverse(ProceduralTask):
    """The procedural 'reverse' task on strings of 2 or 3 characters (`dataset` is ignored)."""

    def __init__(self, dataset=None, seed=0):
        super().__init__(dataset="reverse", seed=seed, min_len=2, max_len=3)
