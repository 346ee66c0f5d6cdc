"""Plug-ins named in a config as "package.module:name": importing them, and checking that they
take what their protocol passes, with errors that name the config key and the import path.

The protocols themselves (what each call receives and returns) are documented in
`megatron_rl.algorithms.registry`; here is only what a call passes, so that `check-config` can
refuse a plug-in that would fail at its first call, in the process that resolves the config,
long before a trainer reaches it. The processes that call a plug-in import it again.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

# What each kind of plug-in is called with: positional arguments, then keyword arguments (the
# config's `*_args` mapping adds its keys to the keywords).
CALLS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "policy_loss": (("logprobs", "old_logprobs", "advantages", "mask"), ("sequences", "weights")),
    "advantage": (("groups",), ()),
    "environment": ((), ("dataset", "seed")),
    "tool parser": ((), ()),
    "tool": ((), ()),
}
# Keywords a kind of plug-in is also called with when its signature names them.
OPTIONAL_KEYWORDS: dict[str, tuple[str, ...]] = {"advantage": ("action_tokens",)}


class PluginError(ValueError):
    """A plug-in that cannot be imported or called as its protocol calls it."""


def is_plugin(name: str) -> bool:
    """True for an import path "package.module:name" (built-in names have no colon)."""
    return ":" in name


def load_object(path: str, key: str) -> Any:
    """The object "package.module:attr[.attr]" names; PluginError naming `key` and `path`."""
    module_name, _, attribute = path.partition(":")
    if not module_name or not attribute:
        raise PluginError(f"{key}: {path!r} is not an import path 'package.module:name'")
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # ImportError, or the module's own error while importing
        raise PluginError(
            f"{key}: cannot import module {module_name!r} of {path!r} ({type(error).__name__}: {error}); "
            "is its package installed or on PYTHONPATH?"
        ) from error
    target = module
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise PluginError(f"{key}: module {module_name!r} has no {attribute!r} (from {path!r})")
        target = getattr(target, part)
    if not callable(target):
        raise PluginError(f"{key}: {path!r} is a {type(target).__name__}, not a callable")
    return target


def check_call(kind: str, target: Any, key: str, path: str, extra_keywords: tuple[str, ...] = ()) -> None:
    """Raises PluginError naming `key` and `path` unless `target` accepts the call its protocol
    `kind` makes (positional and keyword names from CALLS, plus `extra_keywords`)."""
    positional, keywords = CALLS[kind]
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return  # a builtin without a signature: the first call will tell
    keywords += tuple(name for name in OPTIONAL_KEYWORDS.get(kind, ()) if name in signature.parameters)
    try:
        signature.bind(*positional, **{name: None for name in (*keywords, *extra_keywords)})
    except TypeError as error:
        wanted = ", ".join([*positional, *(f"{name}=" for name in (*keywords, *extra_keywords))])
        raise PluginError(
            f"{key}: {path!r} cannot be called as a {kind} plug-in is, f({wanted}): {error} "
            f"(its signature is {signature})"
        ) from None


def load_plugin(kind: str, path: str, key: str, extra_keywords: tuple[str, ...] = ()) -> Any:
    """`load_object` then `check_call`: the plug-in, ready to call."""
    target = load_object(path, key)
    check_call(kind, target, key, path, extra_keywords)
    return target
