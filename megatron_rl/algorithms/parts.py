"""The tables of built-in algorithm parts, and the decorators that declare a part where its
function is defined (as verl's `register_adv_est` / `register_policy_loss`):

    @register_advantage("rloo", group_baseline=True)
    def leave_one_out(groups): ...

    @register_policy_loss("ppo_clip", reads=("eps_low", "eps_high", "dual_clip"))
    def ppo_clip_loss(logprobs, old_logprobs, advantages, mask, eps_low=0.2, ...): ...

A name is a built-in's only declaration: the config holds it as a plain string, the registry
(`algorithms/registry.py`) looks it up here, the config loader checks it against these tables
(config/parts.py) and the reference page lists them. Declaring a name twice is an error when the
second module is imported. The tables are filled once, by importing advantages.py and losses.py
(registry.py does), and never changed after.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class AdvantagePart:
    name: str
    function: Callable
    needs_critic: bool  # reads the critic's per-token values (gae): not an outcome estimator
    group_baseline: bool  # its baseline is the member's group: a group needs two members


@dataclass(frozen=True)
class PolicyLossPart:
    name: str
    function: Callable
    reads: tuple[str, ...]  # the algorithm keys it takes, as keyword arguments of the same name


ADVANTAGE_ESTIMATORS: dict[str, AdvantagePart] = {}
POLICY_LOSSES: dict[str, PolicyLossPart] = {}


def _where(function: Callable) -> str:
    return f"{function.__module__}.{function.__qualname__}"


def _declare(table: dict, part, kind: str) -> None:
    if not part.name or ":" in part.name:
        raise ValueError(
            f"{kind} {part.name!r}: a built-in name is non-empty and has no ':' (that spells a plug-in)"
        )
    if part.name in table:
        raise ValueError(
            f"{kind} {part.name!r} is declared twice: by {_where(table[part.name].function)} and by "
            f"{_where(part.function)}"
        )
    table[part.name] = part


def register_advantage(name: str, *, needs_critic: bool = False, group_baseline: bool = False):
    """Declares the decorated function as the built-in advantage estimator `name`."""

    def declare(function: Callable) -> Callable:
        _declare(
            ADVANTAGE_ESTIMATORS, AdvantagePart(name, function, needs_critic, group_baseline), "advantage"
        )
        return function

    return declare


def register_policy_loss(name: str, *, reads: tuple[str, ...]):
    """Declares the decorated function as the built-in policy loss `name`, which takes the
    algorithm keys `reads` as keyword arguments of the same names."""

    def declare(function: Callable) -> Callable:
        missing = [key for key in reads if key not in inspect.signature(function).parameters]
        if missing:
            raise ValueError(f"policy loss {name!r} reads {missing}, which {_where(function)} does not take")
        _declare(POLICY_LOSSES, PolicyLossPart(name, function, tuple(reads)), "policy loss")
        return function

    return declare
