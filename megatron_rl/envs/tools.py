"""Tool-calling environments: tools declared as JSON schemas, calls in the model's own format.

A `ToolEnvironment` declares its tools (`tool_schemas()`: the chat template renders them in the
prompt), reads each completion's calls with a parser (envs/tool_parsers.py: `hermes` by
default), runs them, and answers with the results as `tool` messages: the orchestrator appends
them as the template renders them (orchestrator/chat.py), tokens with loss mask 0. A malformed
call, an unknown tool, arguments that do not fit the schema and a tool that fails are each a
tool-error message the model sees (`Error: ...`) and a counted `tool_errors`, never a crash. A
completion without a call is the final answer: `grade(row, answer)` scores it. A call in the
last allowed turn (`max_turns`) ends the rollout with reward 0.

Tools run in worker threads (`astep`), so a slow tool (the sandboxed Python of
envs/sandbox.py) never blocks the other rollouts; grading stays on the event loop's thread
(math-verify's timeouts need the main thread).

    tools: python                      # built-in tools by name (environment_args)
    tools: {python: {timeout_s: 5}}    # with their keyword arguments
    tools: ["my_pkg.tools:Search"]     # a plug-in: a Tool subclass or a factory returning one
"""

from __future__ import annotations

import asyncio
from abc import abstractmethod
from dataclasses import dataclass

from megatron_rl.config.plugins import PluginError, is_plugin, load_plugin
from megatron_rl.envs.base import Environment, Turn
from megatron_rl.envs.tool_parsers import ParsedCompletion, ToolCall, make_tool_parser

_JSON_TYPES = {
    "string": str, "integer": int, "number": (int, float), "boolean": bool, "object": dict, "array": list,
    "null": type(None),
}  # fmt: skip


@dataclass
class ToolResult:
    content: str
    error: bool = False  # counted in `tool_errors`


class Tool:
    """A function the model may call: `name`, `description`, `parameters` (a JSON schema of an
    object) and `run(arguments) -> ToolResult`. `__call__` checks the arguments against the
    schema's top level (required keys, unknown keys, primitive types) before running."""

    name: str = ""
    description: str = ""
    parameters: dict = {"type": "object", "properties": {}}

    @abstractmethod
    def run(self, arguments: dict) -> ToolResult: ...

    def schema(self) -> dict:
        """The OpenAI function-tool form chat templates render (`tools=` of apply_chat_template)."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}  # fmt: skip

    def check(self, arguments: dict) -> str | None:
        """What is wrong with `arguments`, or None."""
        properties = self.parameters.get("properties", {})
        missing = [key for key in self.parameters.get("required", ()) if key not in arguments]
        if missing:
            return f"missing required argument(s) {missing} (parameters: {sorted(properties)})"
        if self.parameters.get("additionalProperties", True) is False:
            unknown = sorted(set(arguments) - set(properties))
            if unknown:
                return f"unknown argument(s) {unknown} (parameters: {sorted(properties)})"
        for key, value in arguments.items():
            expected = properties.get(key, {}).get("type")
            types = tuple(_JSON_TYPES[t] for t in ([expected] if isinstance(expected, str) else expected or ())
                          if t in _JSON_TYPES)  # fmt: skip
            wrong_bool = isinstance(value, bool) and bool not in types and types  # JSON true is not a number
            if types and (not isinstance(value, types) or wrong_bool):
                return f"argument {key!r} must be {expected}, got {type(value).__name__}"
        return None

    def __call__(self, arguments: dict) -> ToolResult:
        problem = self.check(arguments)
        if problem is not None:
            return ToolResult(f"Error: {self.name}: {problem}", error=True)
        try:
            return self.run(arguments)
        except Exception as exc:  # the tool's own failure is the model's observation
            return ToolResult(f"Error: {self.name} failed: {type(exc).__name__}: {exc}", error=True)


class PythonTool(Tool):
    """Runs Python code in the sandbox (envs/sandbox.py): the observation is what it printed
    (its last newline removed), or the error (a limit hit, an exception's traceback). Keywords:
    the sandbox's limits (timeout_s, memory_mb, processes, output_bytes, file_bytes) and
    `packages` (default true: the venv's site-packages, numpy and sympy among them, importable
    read-only; false: the standard library only). Refuses to start where the sandbox's
    isolation is not available, naming what is missing."""

    name = "python"
    description = "Run Python code and return what it prints. Use print() to see values."
    parameters = {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "A Python program."}},
        "required": ["code"],
        "additionalProperties": False,
    }

    def __init__(self, packages: bool = True, **limits):
        from megatron_rl.envs.sandbox import PythonSandbox, SandboxLimits

        self.sandbox = PythonSandbox(SandboxLimits(**limits), packages=packages)

    def run(self, arguments: dict) -> ToolResult:
        result = self.sandbox.run(arguments["code"])
        return ToolResult(result.observation().rstrip("\n") or "(no output: print what you want to see)",
                          error=not result.ok)  # fmt: skip


TOOLS: dict[str, type[Tool]] = {"python": PythonTool}


def make_tools(spec, key: str = "orchestrator.environment_args.tools") -> list[Tool]:
    """Tools from a name, a list of names, or a mapping name -> keyword arguments; a name is a
    built-in (TOOLS) or a plug-in "package.module:name"."""
    if isinstance(spec, str):
        spec = [spec]
    if isinstance(spec, dict):
        spec = list(spec.items())
    elif isinstance(spec, list | tuple) and all(isinstance(name, str) for name in spec):
        spec = [(name, {}) for name in spec]
    else:
        raise ValueError(f"{key}: a tool name, a list of names or a mapping name -> arguments, got {spec!r}")
    tools = []
    for name, arguments in spec:
        if not isinstance(arguments, dict):
            raise ValueError(f"{key}.{name}: the tool's keyword arguments as a mapping, got {arguments!r}")
        if is_plugin(name):
            factory = load_plugin("tool", name, f"{key}.{name}", tuple(arguments))
        elif name in TOOLS:
            factory = TOOLS[name]
        else:
            raise ValueError(f"{key}: unknown tool {name!r} (known: {sorted(TOOLS)}, or 'package.module:name')")
        try:
            tool = factory(**arguments)
        except TypeError as exc:
            raise ValueError(f"{key}.{name}: {exc}") from None
        if not isinstance(tool, Tool):
            raise PluginError(f"{key}: {name!r} returned a {type(tool).__name__}, not a megatron_rl.envs.tools.Tool")
        tools.append(tool)
    names = [tool.name for tool in tools]
    if len(set(names)) != len(names):
        raise ValueError(f"{key}: two tools share a name ({names})")
    return tools


class ToolEnvironment(Environment):
    """Subclasses give `row`, `prompt` and `grade`; the tools and the parser come from the
    constructor (`tools`, `tool_parser`, `max_turns`: environment_args)."""

    def __init__(self, tools=(), tool_parser: str = "hermes", max_turns: int | None = None):
        self.tools = {tool.name: tool for tool in make_tools(tools)} if tools else {}
        self.parser = make_tool_parser(tool_parser)
        if max_turns is None:
            max_turns = 4 if self.tools else 1
        if max_turns < 1:
            raise ValueError(f"orchestrator.environment_args.max_turns: at least 1, got {max_turns}")
        self.max_turns = max_turns

    def tool_schemas(self) -> list[dict] | None:
        return [tool.schema() for tool in self.tools.values()] or None

    @abstractmethod
    def grade(self, row: dict, answer: str) -> Turn:
        """The final answer's reward (a completion without a tool call)."""

    def _parse(self, completion: str) -> ParsedCompletion | None:
        """The completion's calls, or None when it is the final answer (no call attempted, or the
        environment has no tools: then tags are only text)."""
        if not self.tools:
            return None
        parsed = self.parser.parse(completion)
        return parsed if parsed.attempted else None

    def _run(self, call: ToolCall) -> ToolResult:
        tool = self.tools.get(call.name)
        if tool is None:
            return ToolResult(f"Error: unknown tool {call.name!r} (tools: {sorted(self.tools)})", error=True)
        return tool(call.arguments)

    def _turn(self, completions: list[str], parsed: ParsedCompletion, results: list[ToolResult]) -> Turn:
        errors = len(parsed.errors) + sum(result.error for result in results)
        counts = {"tool_calls": parsed.attempted, "tool_errors": errors, "tool_malformed": len(parsed.errors)}
        if len(completions) >= self.max_turns:  # a call where the answer had to be
            return Turn(reward=0.0, passed=False, **counts)
        messages = [{"role": "tool", "content": f"Error: malformed tool call: {error}"} for error in parsed.errors]
        messages += [{"role": "tool", "name": call.name, "content": result.content}
                     for call, result in zip(parsed.calls, results, strict=True)]  # fmt: skip
        return Turn(observation=messages, done=False, **counts)

    def step(self, row: dict, completions: list[str]) -> Turn:
        parsed = self._parse(completions[-1])
        if parsed is None:
            return self.grade(row, completions[-1])
        last = len(completions) >= self.max_turns
        return self._turn(completions, parsed, [] if last else [self._run(call) for call in parsed.calls])

    async def astep(self, row: dict, completions: list[str]) -> Turn:
        parsed = self._parse(completions[-1])
        if parsed is None:
            return self.grade(row, completions[-1])
        if len(completions) >= self.max_turns:
            return self._turn(completions, parsed, [])
        results = await asyncio.gather(*(asyncio.to_thread(self._run, call) for call in parsed.calls))
        return self._turn(completions, parsed, list(results))
