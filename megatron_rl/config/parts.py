"""The built-in algorithm parts a config may name (`algorithm.advantage`, `algorithm.policy_loss`),
as the registry that declares them says.

Each built-in's name is declared once, on its function, by registration
(`megatron_rl.algorithms.parts`: `register_advantage`, `register_policy_loss`). The config holds
the names as plain strings; `config` sits below `algorithms` in the import order and imports
nothing of ours, so the loader reaches the registry the way it reaches a plug-in, by its import
path (`REGISTRY`), when it resolves a config (the rule `algorithm_parts_are_registered`) and when
the reference page lists the choices.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_rl.config.plugins import is_plugin, load_object

# A function returning `BuiltinParts`: the registry's view of its tables.
REGISTRY = "megatron_rl.algorithms.registry:builtin_parts"

# The config keys that name a part, and the kind of part each names.
PART_KEYS = {"advantage": "algorithm.advantage", "policy_loss": "algorithm.policy_loss"}


@dataclass(frozen=True)
class BuiltinParts:
    """The names of the built-in parts, in registration order."""

    advantages: tuple[str, ...]  # every advantage estimator
    critic_advantages: tuple[str, ...]  # those that read the critic's per-token values (gae)
    group_advantages: tuple[str, ...]  # those whose baseline is the member's group (a group needs two)
    policy_losses: tuple[str, ...]

    def names(self, kind: str) -> tuple[str, ...]:
        """The built-in names of `kind` ("advantage" or "policy_loss")."""
        return {"advantage": self.advantages, "policy_loss": self.policy_losses}[kind]

    def problem(self, kind: str, name: str | None) -> str | None:
        """The error line for `name` as a `kind`, None when it is a built-in, a plug-in's import
        path (checked by `plugins_import_and_fit`) or unset (the preset's)."""
        if name is None or is_plugin(name) or name in self.names(kind):
            return None
        return (
            f"{PART_KEYS[kind]}: unknown {name!r}; choose from {list(self.names(kind))} "
            "or give a plug-in as 'package.module:name'"
        )


def builtin_parts() -> BuiltinParts:
    """The registry's built-in parts (imports `megatron_rl.algorithms` on first use)."""
    return load_object(REGISTRY, "algorithm")()
