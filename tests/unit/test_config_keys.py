"""Every config key has a consumer: a key that nothing reads is a setting that silently does
nothing. Walks the config models and looks for each field read as an attribute (`.name`) in
megatron_rl's code (the config package's own rules and derivations count: they turn a key into
the layout or an error). Strings and comments do not count."""

from __future__ import annotations

import io
import tokenize
import typing
from pathlib import Path

from pydantic import BaseModel

import megatron_rl
from megatron_rl.config import Config

# Keys waiting for the work that will read them, each with that work. Empty today.
WAITING: dict[str, str] = {}


def attributes_read(root: Path) -> set[str]:
    names = set()
    for path in root.rglob("*.py"):
        tokens = list(tokenize.generate_tokens(io.StringIO(path.read_text()).readline))
        for dot, name in zip(tokens, tokens[1:]):
            if dot.type == tokenize.OP and dot.string == "." and name.type == tokenize.NAME:
                names.add(name.string)
    return names


def config_models(annotation) -> list[type[BaseModel]]:
    found = []
    for arg in (annotation, *typing.get_args(annotation)):
        for candidate in (arg, *typing.get_args(arg)):
            if isinstance(candidate, type) and issubclass(candidate, BaseModel):
                found.append(candidate)
    return found


def config_keys(model: type[BaseModel], prefix: str = "", seen: set | None = None) -> list[tuple[str, str]]:
    """(dotted key, field name) of every field under `model`."""
    seen = set() if seen is None else seen
    keys = []
    for name, field in model.model_fields.items():
        keys.append((prefix + name, name))
        for sub in config_models(field.annotation):
            if sub not in seen:
                seen.add(sub)
                keys += config_keys(sub, f"{prefix}{name}.", seen)
    return keys


def test_every_config_key_is_read_somewhere():
    read = attributes_read(Path(megatron_rl.__file__).parent)
    keys = config_keys(Config)
    assert len(keys) > 100  # the walk reaches every section
    unread = [key for key, name in keys if name not in read and key not in WAITING]
    assert not unread, f"config keys that no module reads (use them, remove them, or list them in WAITING): {unread}"
    stale = [key for key in WAITING if key not in dict(keys)]
    assert not stale, f"WAITING lists keys the config no longer has: {stale}"


def test_the_check_catches_an_unread_key(tmp_path):
    (tmp_path / "reader.py").write_text('config.logging.dir\nprint("console")  # .level in a comment\n')
    read = attributes_read(tmp_path)
    assert "dir" in read and "console" not in read and "level" not in read
