"""One registry for the parts of an algorithm, built-in and plug-in: advantage estimators and
policy losses (environments: `megatron_rl.envs.make_environment`). A config names a part by a
built-in name or by an import path "package.module:name"; `check-config` imports a plug-in and
checks its signature (config/plugins.py), and each process that calls it imports it again.

The protocols, each documented here once:

**Advantage estimator** (`algorithm.advantage`, keyword arguments `algorithm.advantage_args`):

    estimator(groups: list[torch.Tensor], **advantage_args) -> list[torch.Tensor]
    estimator(groups, *, action_tokens, **advantage_args)   # when it declares `action_tokens`

`groups` holds one 1-D float64 tensor per admitted group of the training step, its members'
rewards in branch order; the estimator returns each member's scalar advantage in the same
shapes. It sees the whole step at once, so a batch-level estimator normalises over all groups
(REINFORCE++). An estimator with a parameter named `action_tokens` also receives each member's
number of action tokens (int64 tensors in the same shapes), for statistics over tokens rather
than members (REINFORCE++ whitens over every action token of the step, as verl does); one
without it is called with `groups` alone. The orchestrator puts a member's advantage on each of
its action tokens. `gae` is the one built-in that is not of this kind: it needs the critic's
per-token values.

**Policy loss** (`algorithm.policy_loss`, keyword arguments `algorithm.policy_loss_args`):

    loss(logprobs, old_logprobs, advantages, mask, *, sequences, weights, **policy_loss_args)
        -> (loss_sum: 0-d tensor, metrics: dict[str, 0-d tensor])

on one packed micro-batch of one rank, all [n] tensors of the next token: `logprobs` of
softmax(logits / T) with gradient, `old_logprobs` (the ratio's denominator), `advantages`,
`mask` (bool: action tokens); `sequences` a `losses.Sequences` (the row's sequence boundaries,
with sums over whole sequences across context-parallel ranks); `weights` None or per-token
detached factors (loss aggregation times rollout correction) to multiply the per-token loss by.
Return the *sum* over masked tokens, not a mean: the trainer divides by the global normaliser of
`algorithm.loss_aggregation`. Metrics whose names end in `_sum` are summed over every
micro-batch and rank: `num_tokens`, `ratio_sum`, `clipped_sum`, `approx_kl_sum` feed the policy's
ratio_mean, clip_fraction and approx_kl (with _first and _last), and any other `NAME_sum` is
reported as NAME, its mean per action token over the step's updates; other entries are dropped.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from megatron_rl.algorithms import advantages as adv
from megatron_rl.algorithms import losses
from megatron_rl.config import AlgorithmConfig
from megatron_rl.config.plugins import is_plugin, load_plugin

# A bound estimator as the orchestrator calls it: (groups, action_tokens) -> advantages per group.
AdvantageEstimator = Callable[[list[torch.Tensor], list[torch.Tensor] | None], list[torch.Tensor]]

ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {
    "grpo": adv.group_normalised,
    "dr_grpo": adv.group_mean_centered,
    "rloo": adv.leave_one_out,
    "reinforce_pp": adv.reinforce_plus_plus,
    "reinforce_pp_baseline": adv.reinforce_plus_plus_baseline,
}

# Built-in losses, and the algorithm keys each reads (as keyword arguments of the same name,
# except dual_clip which only ppo_clip takes).
POLICY_LOSSES: dict[str, tuple[Callable, tuple[str, ...]]] = {
    "ppo_clip": (losses.ppo_clip_loss, ("eps_low", "eps_high", "dual_clip")),
    "dis": (losses.sao_dis_loss, ("eps_low", "eps_high")),
    "gspo": (losses.gspo_loss, ("eps_low", "eps_high")),
    "cispo": (losses.cispo_loss, ("eps_low", "eps_high")),
}


def takes_action_tokens(estimator: Callable) -> bool:
    """Whether `estimator` declares a parameter `action_tokens` that can be passed by keyword."""
    try:
        parameter = inspect.signature(estimator).parameters.get("action_tokens")
    except (TypeError, ValueError):  # a builtin without a signature
        return False
    return parameter is not None and parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY)


def _calling_convention(estimator: Callable, name: str) -> AdvantageEstimator:
    """`estimator` as f(groups, action_tokens=None): the counts go to an estimator that declares
    them (and must be given then), the others get `groups` alone."""
    if not takes_action_tokens(estimator):
        return lambda groups, action_tokens=None: estimator(groups)

    def estimate(groups, action_tokens=None):
        if action_tokens is None:
            raise ValueError(
                f"algorithm.advantage {name!r} weighs each member by its action tokens: pass action_tokens "
                "(one int64 tensor of counts per group)"
            )
        return estimator(groups, action_tokens=action_tokens)

    return estimate


def advantage_estimator(name: str, **arguments: Any) -> AdvantageEstimator:
    """The estimator `name` (built-in or "package.module:name") with `arguments` bound, called as
    f(groups, action_tokens=None) (the module docstring says which estimators get the counts)."""
    if name == "gae":
        raise ValueError(
            "algorithm.advantage 'gae' is not an outcome estimator: it needs the critic's values per token "
            "(algorithms.base.CriticAlgorithm computes it per group)"
        )
    if is_plugin(name):
        estimator = load_plugin("advantage", name, "algorithm.advantage", tuple(arguments))
    elif name in ADVANTAGE_ESTIMATORS:
        if arguments:
            raise ValueError(f"algorithm.advantage_args: the built-in {name!r} takes none, got {sorted(arguments)}")
        return _calling_convention(ADVANTAGE_ESTIMATORS[name], name)
    else:
        raise ValueError(
            f"algorithm.advantage: unknown {name!r}; choose from {['gae', *ADVANTAGE_ESTIMATORS]} or "
            "'package.module:name'"
        )
    return _calling_convention(partial(estimator, **arguments) if arguments else estimator, name)


def policy_loss(name: str, **arguments: Any) -> losses.PolicyObjective:
    """The policy loss `name` (built-in or "package.module:name"), with `arguments` bound (a
    built-in's coefficients, a plug-in's `policy_loss_args`)."""
    if is_plugin(name):
        target = load_plugin("policy_loss", name, "algorithm.policy_loss", tuple(arguments))
    elif name in POLICY_LOSSES:
        target, accepted = POLICY_LOSSES[name]
        unknown = sorted(set(arguments) - set(accepted))
        if unknown:
            raise ValueError(f"algorithm.policy_loss {name!r} takes {list(accepted)}, not {unknown}")
    else:
        raise ValueError(
            f"algorithm.policy_loss: unknown {name!r}; choose from {list(POLICY_LOSSES)} or 'package.module:name'"
        )
    return partial(target, **arguments)


def advantage_for(config: AlgorithmConfig) -> AdvantageEstimator:
    """The outcome estimator `config` names (not for gae)."""
    return advantage_estimator(config.advantage, **config.advantage_args)


def policy_loss_for(config: AlgorithmConfig) -> losses.PolicyObjective:
    """The policy loss `config` trains with: a built-in bound to the config's coefficients, or a
    plug-in bound to `policy_loss_args`."""
    if is_plugin(config.policy_loss):
        return policy_loss(config.policy_loss, **config.policy_loss_args)
    _, accepted = POLICY_LOSSES[config.policy_loss]
    coefficients = {"eps_low": config.eps_low, "eps_high": config.eps_high, "dual_clip": config.dual_clip}
    return policy_loss(config.policy_loss, **{key: coefficients[key] for key in accepted})
