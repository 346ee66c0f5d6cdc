"""Tool calls in the model's own format: a completion's text -> the calls it makes.

A parser reads the text a model wrote (decoded from the sampled ids, its reasoning removed) and
returns the calls in it, the text outside them, and each malformed call as an error message: a
malformed call never raises, it becomes a tool-error observation the model sees and a counted
`tool_errors` (envs/tools.py). Parsers by name, as the other registries:

    hermes        <tool_call>{"name": ..., "arguments": {...}}</tool_call>  (Hermes, Qwen2.5, Qwen3)
    qwen3_coder   <tool_call><function=NAME><parameter=KEY>VALUE</parameter></function></tool_call>
    "my_pkg.parsers:Mine"   a plug-in: a ToolParser subclass (or a factory returning one)

`tags` are the strings a parser needs to find calls: a tokenizer must keep them when it decodes
(added tokens that are not special, as Qwen3's own `<tool_call>`; orchestrator/chat.py checks).
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from megatron_rl.config.plugins import PluginError, is_plugin, load_plugin


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict


@dataclass
class ParsedCompletion:
    content: str  # the text outside the calls (stripped)
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # one message per malformed call

    @property
    def attempted(self) -> int:
        """Calls the completion tried to make: parsed and malformed."""
        return len(self.calls) + len(self.errors)


class ToolParser(ABC):
    """Turns a completion's text into tool calls; never raises on the model's text."""

    name: str = ""
    tags: tuple[str, ...] = ()

    @abstractmethod
    def parse(self, text: str) -> ParsedCompletion: ...

    def format(self, call: ToolCall) -> str:
        """`call` as the model writes it (demonstrations for a warm start); parse(format(c)) is c.
        Optional for a plug-in parser: only a warm start on demonstrations calls it, so the default
        names the parser instead of guessing its format."""
        raise NotImplementedError(f"tool parser {self.name!r} cannot write calls")


def _arguments(value, where: str) -> dict:
    """A call's arguments: a JSON object, or a string holding one (OpenAI's wire form)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: arguments are a string that is not JSON ({exc.msg})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{where}: arguments must be a JSON object, got {type(value).__name__}")
    return value


class _Tagged(ToolParser):
    """Calls between an opening and a closing tag; an opening tag without its closing one is a
    malformed call (the completion ended inside it)."""

    open_tag, close_tag = "<tool_call>", "</tool_call>"

    def parse(self, text: str) -> ParsedCompletion:
        calls, errors, outside, position = [], [], [], 0
        while True:
            start = text.find(self.open_tag, position)
            if start < 0:
                outside.append(text[position:])
                break
            outside.append(text[position:start])
            end = text.find(self.close_tag, start + len(self.open_tag))
            number = len(calls) + len(errors) + 1
            if end < 0:
                errors.append(f"tool call {number}: {self.open_tag} is never closed by {self.close_tag}")
                break
            body = text[start + len(self.open_tag) : end]
            try:
                calls.append(self.call(body, f"tool call {number}"))
            except ValueError as exc:
                errors.append(str(exc))
            position = end + len(self.close_tag)
        stray = "".join(outside)
        if self.close_tag in stray:
            errors.append(f"{self.close_tag} without an opening {self.open_tag}")
            stray = stray.replace(self.close_tag, "")
        return ParsedCompletion(stray.strip(), calls, errors)

    @abstractmethod
    def call(self, body: str, where: str) -> ToolCall: ...


class HermesParser(_Tagged):
    """`<tool_call>{"name": "f", "arguments": {...}}</tool_call>`, one JSON object per tag pair:
    the format of Hermes, Qwen2.5 and Qwen3 (and their templates' tool prompt)."""

    name = "hermes"
    tags = ("<tool_call>", "</tool_call>")

    def call(self, body: str, where: str) -> ToolCall:
        try:
            payload = json.loads(body)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not JSON ({exc.msg} at character {exc.pos})") from None
        if not isinstance(payload, dict):
            raise ValueError(f"{where}: a JSON object with name and arguments, got {type(payload).__name__}")
        name = payload.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where}: no function name (the object's 'name')")
        return ToolCall(name, _arguments(payload.get("arguments", {}), f"{where} ({name})"))

    def format(self, call: ToolCall) -> str:
        return f"<tool_call>\n{json.dumps({'name': call.name, 'arguments': call.arguments})}\n</tool_call>"


_FUNCTION = re.compile(r"<function=([^>\s]+)>(.*?)</function>", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\s]+)>(.*?)</parameter>", re.DOTALL)


class Qwen3CoderParser(_Tagged):
    """Qwen3-Coder's XML calls: `<tool_call><function=f><parameter=x>VALUE</parameter>...
    </function></tool_call>`. A value is JSON when it parses as JSON (numbers, lists, objects,
    true/false/null), else the text itself with its surrounding newlines removed."""

    name = "qwen3_coder"
    tags = ("<tool_call>", "</tool_call>")

    def call(self, body: str, where: str) -> ToolCall:
        function = _FUNCTION.fullmatch(body.strip())
        if function is None:
            raise ValueError(f"{where}: no <function=NAME>...</function> inside the tags")
        name, inner = function.group(1), function.group(2)
        arguments = {}
        for match in _PARAMETER.finditer(inner):
            key, raw = match.group(1), match.group(2).strip("\n")
            if key in arguments:
                raise ValueError(f"{where} ({name}): parameter {key!r} given twice")
            try:
                arguments[key] = json.loads(raw)
            except json.JSONDecodeError:
                arguments[key] = raw
        if _PARAMETER.sub("", inner).strip():
            raise ValueError(f"{where} ({name}): text between parameters that is not a <parameter=...> block")
        return ToolCall(name, arguments)

    def format(self, call: ToolCall) -> str:
        parameters = "".join(
            f"<parameter={key}>\n{value if isinstance(value, str) else json.dumps(value)}\n</parameter>\n"
            for key, value in call.arguments.items()
        )
        return f"<tool_call>\n<function={call.name}>\n{parameters}</function>\n</tool_call>"


TOOL_PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesParser, "qwen3_coder": Qwen3CoderParser}


def make_tool_parser(name: str, key: str = "orchestrator.environment_args.tool_parser") -> ToolParser:
    """The built-in parser `name`, or a plug-in "package.module:name" (a ToolParser class or a
    factory returning one, called without arguments)."""
    if is_plugin(name):
        parser = load_plugin("tool parser", name, key, ())()
    elif name in TOOL_PARSERS:
        parser = TOOL_PARSERS[name]()
    else:
        raise ValueError(f"{key}: unknown tool parser {name!r} (known: {sorted(TOOL_PARSERS)}, or 'package.module:name')")
    if not isinstance(parser, ToolParser):
        raise PluginError(f"{key}: {name!r} returned a {type(parser).__name__}, not a megatron_rl.envs.ToolParser")
    return parser
