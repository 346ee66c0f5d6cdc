"""One registry for the parts of an algorithm, built-in and plug-in: advantage estimators and
policy losses (environments: `megatron_rl.envs.make_environment`). A config names a part by a
built-in name or by an import path "package.module:name". A built-in is declared once, by the
decorator on its function (algorithms/parts.py: `register_advantage`, `register_policy_loss`);
resolving a config checks its names against these tables (config/parts.py reaches
`builtin_parts` by its import path) and `check-config` imports a plug-in and checks its signature
(config/plugins.py); each process that calls a part imports it again.

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

from megatron_rl.algorithms import advantages, losses  # noqa: F401  (importing them declares the built-ins)
from megatron_rl.algorithms.parts import ADVANTAGE_ESTIMATORS, POLICY_LOSSES
from megatron_rl.config import AlgorithmConfig
from megatron_rl.config.parts import BuiltinParts
from megatron_rl.config.plugins import is_plugin, load_plugin

# A bound estimator as the orchestrator calls it: (groups, action_tokens) -> advantages per group.
AdvantageEstimator = Callable[[list[torch.Tensor], list[torch.Tensor] | None], list[torch.Tensor]]


def builtin_parts() -> BuiltinParts:
    """The built-in names, for the config loader and the reference page (config/parts.py)."""
    table = ADVANTAGE_ESTIMATORS.values()
    return BuiltinParts(
        advantages=tuple(ADVANTAGE_ESTIMATORS),
        critic_advantages=tuple(part.name for part in table if part.needs_critic),
        group_advantages=tuple(part.name for part in table if part.group_baseline),
        policy_losses=tuple(POLICY_LOSSES),
    )


def needs_critic(advantage: str) -> bool:
    """Whether the estimator `advantage` reads the critic's values (a built-in declared so: gae;
    a plug-in never does, its protocol has no values)."""
    part = ADVANTAGE_ESTIMATORS.get(advantage)
    return part is not None and part.needs_critic


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
    if needs_critic(name):
        raise ValueError(
            f"algorithm.advantage {name!r} is not an outcome estimator: it needs the critic's values per token "
            "(algorithms.base.CriticAlgorithm computes it per group)"
        )
    if is_plugin(name):
        estimator = load_plugin("advantage", name, "algorithm.advantage", tuple(arguments))
    elif name in ADVANTAGE_ESTIMATORS:
        if arguments:
            raise ValueError(f"algorithm.advantage_args: the built-in {name!r} takes none, got {sorted(arguments)}")
        return _calling_convention(ADVANTAGE_ESTIMATORS[name].function, name)
    else:
        raise ValueError(
            f"algorithm.advantage: unknown {name!r}; choose from {list(ADVANTAGE_ESTIMATORS)} or "
            "'package.module:name'"
        )
    return _calling_convention(partial(estimator, **arguments) if arguments else estimator, name)


def policy_loss(name: str, **arguments: Any) -> losses.PolicyObjective:
    """The policy loss `name` (built-in or "package.module:name"), with `arguments` bound (a
    built-in's coefficients, a plug-in's `policy_loss_args`)."""
    if is_plugin(name):
        target = load_plugin("policy_loss", name, "algorithm.policy_loss", tuple(arguments))
    elif name in POLICY_LOSSES:
        target, accepted = POLICY_LOSSES[name].function, POLICY_LOSSES[name].reads
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
    if is_plugin(config.policy_loss) or config.policy_loss not in POLICY_LOSSES:
        return policy_loss(config.policy_loss, **config.policy_loss_args)  # a plug-in, or the unknown-name error
    coefficients = loss_coefficients(config)
    return policy_loss(config.policy_loss, **{key: coefficients[key] for key in POLICY_LOSSES[config.policy_loss].reads})


def loss_coefficients(config: AlgorithmConfig) -> dict[str, Any]:
    """The algorithm keys a built-in policy loss may read (`register_policy_loss(reads=...)`), by
    name: a test checks that every key a registered loss reads is here."""
    return {"eps_low": config.eps_low, "eps_high": config.eps_high, "dual_clip": config.dual_clip}
