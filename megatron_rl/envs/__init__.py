"""Environments and datasets, behind one small interface and a registry.

An `Environment` turns a dataset row into a prompt (text or messages: the orchestrator applies
the chat template once, with our tokenizer, and the tools of `tool_schemas()`) and, for each
turn, takes the completions so far (text decoded from the exact token ids, reasoning removed)
and answers with a `Turn`: a reward, and for a multi-turn environment an observation to append
(text tokenised once, or `tool` messages the template renders: new tokens with loss mask 0) and
whether the rollout is done. Rows come from `row(index)`: deterministic in (seed, index), so a
resumed run sees the same prompts from the same cursor.

    make_environment("procedural", dataset="reverse", seed=0)   # tiny-model tasks, no download
    make_environment("math", dataset="data/math.jsonl")         # {"prompt", "answer"}, math-verify
    make_environment("calculator", dataset=None, seed=0)        # multi-turn tool use
    make_environment("calculator", args={"max_turns": 2})       # constructor keywords
    make_environment("math", dataset="data/math.parquet", args={"tools": ["python"]})
                                                                # tool-integrated: envs/tools.py
    make_environment("arithmetic", seed=0)                      # the python tool, Hermes calls
    make_environment("my_pkg.tasks:Sudoku", dataset=..., seed=0)  # a plug-in: called with
                                                                  # dataset=, seed=; an Environment
    make_environment(VerifiersHub(hub="verifiers", id="my-env"))  # a hub's (envs/hubs/)

`args` (`orchestrator.environment_args`) are more keyword arguments of the constructor; a
keyword it does not take is an error naming the key and the constructor's signature.
"""

from __future__ import annotations

from megatron_rl.config.plugins import PluginError, check_call, is_plugin, load_plugin
from megatron_rl.envs.arithmetic import ArithmeticEnvironment
from megatron_rl.envs.base import ChatModel, ConversationError, DrivenEnvironment, Environment, Reply, Turn
from megatron_rl.envs.calculator import CalculatorEnvironment
from megatron_rl.envs.math import MathEnvironment
from megatron_rl.envs.procedural import ProceduralTask
from megatron_rl.envs.tool_parsers import (
    TOOL_PARSERS,
    ParsedCompletion,
    ToolCall,
    ToolParser,
    make_tool_parser,
)
from megatron_rl.envs.tools import TOOLS, Tool, ToolEnvironment, ToolResult, make_tools

ENVIRONMENTS = {
    "procedural": ProceduralTask, "math": MathEnvironment, "calculator": CalculatorEnvironment,
    "arithmetic": ArithmeticEnvironment,
}  # fmt: skip


def make_environment(
    name, dataset: str | None = None, seed: int = 0, key: str = "orchestrator.environment",
    args: dict | None = None,
) -> Environment:  # fmt: skip
    """The built-in environment `name`, the plug-in "package.module:name" called with
    `dataset=`, `seed=` and `args` (a class or a factory; it must return an `Environment`), or a
    hub's environment (`name` a config/hubs.py block; envs/hubs/)."""
    args = dict(args or {})
    if not isinstance(name, str):  # a hub's block (config/hubs.py)
        from megatron_rl.envs.hubs import make_hub_environment

        environment = make_hub_environment(name, dataset, seed, key, args)
        factory = None
    elif is_plugin(name):
        factory = load_plugin("environment", name, key, tuple(args))
    elif name in ENVIRONMENTS:
        factory = ENVIRONMENTS[name]
        check_call("environment", factory, f"{key}_args", name, tuple(args))
    else:
        raise ValueError(
            f"{key}: unknown environment {name!r} (known: {sorted(ENVIRONMENTS)})"
        )
    if factory is not None:
        environment = factory(dataset=dataset, seed=seed, **args)
    if not isinstance(environment, Environment):
        raise PluginError(
            f"{key}: {name!r} returned a {type(environment).__name__}, not a megatron_rl.envs.Environment"
        )
    return environment


__all__ = [
    "ENVIRONMENTS", "TOOLS", "TOOL_PARSERS", "ChatModel", "ConversationError", "DrivenEnvironment", "Environment",
    "Reply", "ParsedCompletion", "Tool", "ToolCall",
    "ToolEnvironment", "ToolParser", "ToolResult", "Turn", "make_environment", "make_tool_parser", "make_tools",
]  # fmt: skip
