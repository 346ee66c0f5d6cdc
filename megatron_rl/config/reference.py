"""The configuration reference, generated from the models: every key a user writes (from
`Config` down, nested sections, lists of sections as `KEY[]`) with its type, default, allowed
range and description, then the cross-field rules in words (the docstrings of `RULES` and of the
models' validators). `render()` is the page docs/reference/configuration.md holds
(`megatron-rl config-reference --out docs/reference/configuration.md` writes it);
`explain(key)` is one key's entry (`megatron-rl check-config --explain KEY`). Reads the models;
the keys that name an algorithm part list the registry's built-ins (config/parts.py, which
reaches the registry by its import path)."""

from __future__ import annotations

import difflib
import inspect
import json
import re
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from megatron_rl.config.algorithm import ALGORITHM_DEFAULTS, POLICY_LOSS_DEFAULTS
from megatron_rl.config.parts import builtin_parts
from megatron_rl.config.run import Config
from megatron_rl.config.validators import RULES

REGENERATE = "megatron-rl config-reference --out docs/reference/configuration.md"


@dataclass
class Key:
    """One config key: its dotted name (lists of sections as `name[]`) and what the page says."""

    name: str
    type: str
    default: str
    range: str
    description: str
    section: type[BaseModel] | None = None  # the model of a key that is a section
    field_name: str = ""
    owner: type[BaseModel] | None = None  # the model the key belongs to


@dataclass
class Rule:
    """A named validator: a cross-field rule of RULES, or a check inside one section's model."""

    name: str
    where: str  # "RULES" or the section's dotted name
    text: str
    func: Callable = field(repr=False)
    keys: list[str] = field(default_factory=list)


def _is_model(candidate: Any) -> bool:
    return isinstance(candidate, type) and issubclass(candidate, BaseModel)


def _members(annotation: Any) -> list[Any]:
    """The members of a union (X | None, Union[...]); the annotation itself otherwise."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return list(typing.get_args(annotation))
    return [annotation]


def _annotated(annotation: Any) -> tuple[Any, list[Any]]:
    """(the bare type, its Annotated metadata)."""
    if typing.get_origin(annotation) is typing.Annotated:
        base, *metadata = typing.get_args(annotation)
        return base, metadata
    return annotation, []


def _validator_note(metadata: list[Any]) -> str:
    notes = []
    for item in metadata:
        func = getattr(item, "func", None)
        if func is not None:
            notes.append(_first_line(func.__doc__) or func.__name__)
    return "; ".join(notes)


def type_name(annotation: Any) -> str:
    """A type as the page writes it: `int`, `float | str`, `"train" | "wait"`, `list[str]`,
    `section`, `list of sections`, `null` for None."""
    parts = []
    for member in _members(annotation):
        member, _ = _annotated(member)
        origin = typing.get_origin(member)
        if member is type(None):
            parts.append("null")
        elif origin is Literal:  # the choices are the key's range
            parts += list(dict.fromkeys(type(choice).__name__ for choice in typing.get_args(member)))
        elif _is_model(member):
            parts.append("section")
        elif origin is list:
            (item,) = typing.get_args(member) or (Any,)
            parts.append("list of sections" if _is_model(item) else f"list[{type_name(item)}]")
        elif origin is dict:
            key, value = typing.get_args(member) or (Any, Any)
            parts.append(f"mapping[{type_name(key)}, {type_name(value)}]")
        elif member is Any:
            parts.append("any")
        elif isinstance(member, type):
            parts.append(member.__name__)
        else:
            parts.append(str(member))
    return " | ".join(parts)


def _value(value: Any) -> str:
    if isinstance(value, BaseModel):
        return "(section defaults)"
    return json.dumps(value)


def _default(info: FieldInfo) -> Any:
    """The field's default value, PydanticUndefined when the key is required."""
    if info.default_factory is not None:
        return info.default_factory()
    return info.default


def default_text(info: FieldInfo) -> str:
    if info.is_required():
        return "required"
    return _value(_default(info))


def _part_kind(info: FieldInfo) -> str | None:
    """The kind of algorithm part a key names ("advantage", "policy_loss"), None for other keys."""
    extra = info.json_schema_extra
    return extra.get("part") if isinstance(extra, dict) else None


def range_text(info: FieldInfo) -> str:
    """The bounds of the field's constraints (ge/gt/le/lt), or the choices of a Literal."""
    bounds = []
    for item in info.metadata:
        for cls, attr, symbol in ((annotated_types.Gt, "gt", ">"), (annotated_types.Ge, "ge", ">="),
                                  (annotated_types.Lt, "lt", "<"), (annotated_types.Le, "le", "<="),
                                  (annotated_types.Interval, None, None)):  # fmt: skip
            if not isinstance(item, cls):
                continue
            pairs = [(attr, symbol)] if attr else [("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")]
            bounds += [
                f"{s} {_value(getattr(item, a))}" for a, s in pairs if getattr(item, a, None) is not None
            ]
    choices = [
        json.dumps(choice)
        for member in _members(info.annotation)
        if typing.get_origin(_annotated(member)[0]) is Literal
        for choice in typing.get_args(_annotated(member)[0])
    ]
    if choices:
        bounds.append("one of " + ", ".join(choices))
    part = _part_kind(info)
    if part is not None:
        names = ", ".join(json.dumps(name) for name in builtin_parts().names(part))
        bounds.append(f"one of {names} (the registry's built-ins), or a plug-in 'package.module:name'")
    notes = [_validator_note(info.metadata)]  # an Annotated type's validators land in the metadata
    notes += [_validator_note(_annotated(member)[1]) for member in _members(info.annotation)]
    bounds += [note for note in notes if note]
    return ", ".join(bounds) or "-"


def _section_of(annotation: Any) -> tuple[type[BaseModel] | None, bool]:
    """(the model a key holds, whether it holds a list of them)."""
    for member in _members(annotation):
        member, _ = _annotated(member)
        if _is_model(member):
            return member, False
        if typing.get_origin(member) is list:
            args = typing.get_args(member)
            if args and _is_model(args[0]):
                return args[0], True
    return None, False


def _preset_note(model: type[BaseModel], name: str) -> str:
    """The defaults the algorithm's presets and policy losses give a key (AlgorithmConfig)."""
    from megatron_rl.config.algorithm import AlgorithmConfig

    if model is not AlgorithmConfig:
        return ""
    by_preset = [
        f"{preset} {_value(values[name])}" for preset, values in ALGORITHM_DEFAULTS.items() if name in values
    ]
    by_loss = [
        f"{loss} {_value(values[name])}" for loss, values in POLICY_LOSS_DEFAULTS.items() if name in values
    ]
    notes = []
    if by_preset:
        notes.append("by algorithm.type: " + ", ".join(by_preset))
    if by_loss:
        notes.append("by algorithm.policy_loss: " + ", ".join(by_loss))
    return "; ".join(notes)


def _walk(model: type[BaseModel], prefix: str, factory_default: BaseModel | None) -> Iterator[Key]:
    for name, info in model.model_fields.items():
        dotted = prefix + name
        section, is_list = _section_of(info.annotation)
        default = default_text(info)
        if factory_default is not None:
            # A section with a default_factory that differs from its fields' defaults
            # (value.optimizer: lr 1e-5): the value when the section is left out comes first.
            given = getattr(factory_default, name)
            if not info.is_required() and given != _default(info) and not isinstance(given, BaseModel):
                default = f"{_value(given)} (section left out), {default} (section given)"
        preset = _preset_note(model, name)
        if preset:
            default = f"{default} ({preset})"
        yield Key(
            name=dotted + ("[]" if is_list else ""),
            type=type_name(info.annotation),
            default=default,
            range=range_text(info),
            description=(info.description or "").strip(),
            section=section,
            field_name=name,
            owner=model,
        )
        if section is not None:
            inner = None
            if not is_list and not info.is_required():
                candidate = _default(info)
                inner = candidate if isinstance(candidate, BaseModel) else None
            yield from _walk(section, dotted + ("[]." if is_list else "."), inner)


def keys() -> list[Key]:
    """Every key a user writes, in the models' order."""
    return list(_walk(Config, "", None))


def sections() -> list[tuple[str, type[BaseModel], list[Key]]]:
    """(dotted section name, its model, its own keys), the top level as "" first."""
    all_keys = keys()
    found: list[tuple[str, type[BaseModel], list[Key]]] = [("", Config, [])]
    for key in all_keys:
        if key.section is not None:
            found.append((key.name, key.section, []))
    by_name = {name: own for name, _, own in found}
    for key in all_keys:
        parent = key.name.rsplit(".", 1)[0] if "." in key.name else ""
        by_name[parent].append(key)
    return found


def _first_line(doc: str | None) -> str:
    """A docstring's first paragraph, on one line."""
    if not doc:
        return ""
    paragraph = inspect.cleandoc(doc).split("\n\n")[0]
    return " ".join(paragraph.split())


def _doc(doc: str | None) -> str:
    return " ".join(inspect.cleandoc(doc).split()) if doc else ""


def _mentions(func: Callable, names: list[str], own: list[Key]) -> list[str]:
    """The keys a validator's source names: a dotted key written out, or (for a model's own
    validator) `self.FIELD` / a field named in quotes."""
    try:
        source = inspect.getsource(func)
    except (OSError, TypeError):
        return []
    found = [name for name in names
             if re.search(rf"(?<![\w.]){re.escape(name.replace('[]', ''))}(?![\w\[])", source)]  # fmt: skip
    for key in own:
        if (
            re.search(rf"self\.{key.field_name}\b|[\"']{key.field_name}[\"']", source)
            and key.name not in found
        ):
            found.append(key.name)
    return found


def _scalar_names(all_keys: list[Key]) -> list[str]:
    """The keys a rule can name: those that are not whole sections (`value` is also a word)."""
    return [key.name for key in all_keys if key.section is None]


def rules() -> list[Rule]:
    """The cross-field rules of RULES, then each section model's own validators (once per model,
    listed where every section of that model is: `model, value.model`)."""
    all_keys = keys()
    names = _scalar_names(all_keys)
    found = [
        Rule(rule.__name__, "RULES", _doc(rule.__doc__), rule, _mentions(rule, names, [])) for rule in RULES
    ]
    by_model: dict[type[BaseModel], tuple[list[str], list[Key]]] = {}
    for where, model, own in sections():
        wheres, keys_of = by_model.setdefault(model, ([], []))
        wheres.append(where or "<top>")
        keys_of += [key for key in own if key.section is None]
    for model, (wheres, own) in by_model.items():
        decorators = model.__pydantic_decorators__
        for group in (decorators.model_validators, decorators.field_validators):
            for decorator in group.values():
                func = decorator.func
                func = getattr(func, "__func__", func)
                found.append(Rule(func.__name__, ", ".join(wheres), _doc(func.__doc__), func,
                                  _mentions(func, names, own)))  # fmt: skip
    return found


def missing() -> list[str]:
    """Keys without a description and rules without a docstring (the page needs both)."""
    gaps = [f"{key.name}: no description" for key in keys() if not key.description]
    gaps += [f"{rule.where} {rule.name}: no docstring" for rule in rules() if not rule.text]
    return gaps


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _code(text: str) -> str:
    """Values in code font, the words around them not: `1e-05` (section left out)."""
    if text in ("-", "required") or text.startswith("("):
        return text
    return re.sub(r"(^|, )([^ ,(][^ ]*?)(?= \(|, |$)", lambda m: f"{m.group(1)}`{m.group(2)}`", text)


def render() -> str:
    """The whole page, Markdown."""
    lines = [
        "# Configuration reference",
        "",
        "<!-- Generated from the config models (megatron_rl/config/reference.py); do not edit.",
        f"     Regenerate: {REGENERATE} -->",
        "",
        "Every key of a run's YAML config, by section: its type, default, allowed range and what it is.",
        "A key is written as its dotted path (`orchestrator.dynamic_sampling.max_extra_groups`);",
        "`KEY[]` is a list of sections (`orchestrator.eval[].name` is the `name` of each evaluation set).",
        "`megatron-rl check-config --explain KEY` prints one key's entry; `--set KEY=VALUE` (check-config, run)",
        "overrides a key from the command line. Unknown keys are errors.",
        "The cross-field rules, checked once every section is valid, are at the end.",
        "",
    ]
    for where, model, own in sections():
        title = where or "Top level"
        lines += [f"## {title}", ""]
        doc = _doc(model.__doc__) if model.__doc__ and model.__doc__ is not BaseModel.__doc__ else ""
        if doc:
            lines += [doc, ""]
        lines += ["| Key | Type | Default | Range | Description |", "| --- | --- | --- | --- | --- |"]
        for key in own:
            name = f"[`{key.name}`](#{_anchor(key.name)})" if key.section is not None else f"`{key.name}`"
            lines.append(
                f"| {name} | {_cell(f'`{key.type}`')} | {_cell(_code(key.default))} | "
                f"{_cell(key.range)} | {_cell(key.description)} |"
            )
        lines.append("")
    lines += [
        "## Cross-field rules",
        "",
        "Checked by `check-config` (and before every run), each reported by its name's key; every problem",
        "is listed at once.",
        "",
        "### Across sections (`megatron_rl/config/validators.py`, `RULES`)",
        "",
    ]
    all_rules = rules()
    for rule in [r for r in all_rules if r.where == "RULES"]:
        lines.append(_rule_line(rule))
    lines += ["", "### Within a section (the models' validators)", ""]
    for rule in [r for r in all_rules if r.where != "RULES"]:
        lines.append(_rule_line(rule, show_where=True))
    lines.append("")
    return "\n".join(lines)


def _rule_line(rule: Rule, show_where: bool = False) -> str:
    where = " (" + ", ".join(f"`{w}`" for w in rule.where.split(", ")) + ")" if show_where else ""
    keys_text = f" Keys: {', '.join(f'`{k}`' for k in rule.keys)}." if rule.keys else ""
    return f"- **{rule.name}**{where}: {rule.text}{keys_text}"


def _anchor(name: str) -> str:
    """GitHub's heading anchor for a section's heading."""
    return re.sub(r"[^\w\- ]", "", name.lower()).replace(" ", "-")


def normalize(key: str) -> str:
    """`orchestrator.eval[0].name` / `orchestrator.eval.0.name` -> `orchestrator.eval[].name`
    (`orchestrator.eval.name` is found too)."""
    key = re.sub(r"\[\d*\]", "[]", key.strip())
    return re.sub(r"\.\d+(?=\.|$)", "[]", key)


class UnknownKey(KeyError):
    def __init__(self, key: str, suggestions: list[str]):
        self.key, self.suggestions = key, suggestions
        hint = f"; did you mean {', '.join(suggestions)}?" if suggestions else ""
        super().__init__(f"unknown config key {key!r}{hint}")

    def __str__(self) -> str:
        return self.args[0]


def find(key: str) -> Key:
    """The entry of `key` (list indices optional); UnknownKey with close matches otherwise."""
    by_name = {k.name: k for k in keys()}
    wanted = normalize(key)
    plain = {name.replace("[]", ""): name for name in by_name}
    if wanted in by_name:
        return by_name[wanted]
    if wanted.replace("[]", "") in plain:
        return by_name[plain[wanted.replace("[]", "")]]
    close = difflib.get_close_matches(wanted, list(by_name), n=3, cutoff=0.6)
    if not close:  # a field name alone (`max_extra_groups`) or its last part mistyped
        last = wanted.rsplit(".", 1)[-1]
        close = [name for name in by_name if name.rsplit(".", 1)[-1] == last][:3]
        close = close or difflib.get_close_matches(last, list(by_name), n=3, cutoff=0.6)
    raise UnknownKey(key, close)


def explain(key: str) -> str:
    """One key's entry as text: type, default, range, description, the rules that name it and,
    for a section, its keys."""
    entry = find(key)
    lines = [
        entry.name,
        f"  type:        {entry.type}",
        f"  default:     {entry.default}",
        f"  range:       {entry.range}",
        f"  description: {entry.description}",
    ]
    if entry.section is not None:
        inner = [
            k.name
            for k in keys()
            if k.name.startswith(entry.name + ".") and k.name.count(".") == entry.name.count(".") + 1
        ]
        lines.append(f"  keys:        {', '.join(inner)}")
    named = [rule for rule in rules() if entry.name in rule.keys]
    for rule in named:
        lines.append(f"  rule {rule.name} ({rule.where}): {rule.text}")
    return "\n".join(lines)
