"""Environments written with verifiers 0.4 (`import verifiers.v1 as vf`), trained and evaluated
unchanged: `orchestrator.environment: {hub: verifiers, id: NAME}`, `orchestrator.environment_args`
the environment config's own fields (`taskset: {...}`, `agent: {...}`, an `Env`'s own knobs).

- **Loading.** `vf.load_environment` on the config `vf.resolve_env_config` validates, exactly as
  `vf-eval` loads it: `id` names the taskset's installed module (`owner/name@version` -> `name`),
  which may bring its own `Env` (an `Env.run(task, agents)` protocol: several turns, user
  messages, `finalize`) and `Harness`. Rows are the taskset's tasks, shuffled once by `seed`
  (the library's own `Taskset.shuffle`).
- **The model.** In 0.4 the environment drives the turns: its harness program sends chat
  completions to the library's interception server, which hands each to a `vf.Client`. Ours,
  `PolicyClient`, passes the request's messages and tools to the rollout's `ChatModel`
  (orchestrator/rollouts.py `RolloutSession`): the first request is rendered once by our chat
  template, every later one must extend the rollout (the sampled assistant turn, then new messages
  rendered after the exact sampled tokens, masked), and the turn is sampled through
  `RolloutClient.complete` (per-token versions, resumed requests, routing replay as for any
  rollout). It answers with the sampled turn's `TurnTokens`; tool calls are read by our parser
  registry (envs/tool_parsers.py, `tool_parser`). Requests reach the rollout by their session id
  (the trace's id); the sampling knobs a request carries are ignored: the run's sampling applies.
- **The harness.** The agent turns are run by the library's own chat program (the `null` and
  `bash` harnesses: `harnesses/utils/launch.py`'s `CHAT_PROGRAM_SOURCE` through
  `launch_chat_program`), in the local `subprocess` runtime. The library prepares that program with
  `uv` at run time (it installs uv, then the script's dependencies: impossible on a machine that
  reaches only the package registry); verifiers 0.4.0 already depends on everything the program
  imports, so we prepare it with this venv's interpreter instead, in the runtime's own cache of
  prepared scripts, and nothing is installed at run time. A seat whose harness is unpinned runs
  `null` (the tool-less chat loop, with the task's toolsets over MCP) where the library would pick
  `bash`, whose commands would run on the training host; pin `agent.harness.id: bash` for it.
  Harnesses that install third-party agents or need containers are not supported here.
- **Rewards.** The library scores each rollout when it closes (`task.score(trace)`: rewards and
  judges run concurrently); the reward is the trace's weighted sum (weights read off the trace),
  `passed` is `pass_signal`'s value (a named reward's score or a metric; default the total)
  at least `pass_threshold`, and every named reward and metric becomes a step metric
  (`env/reward/NAME_mean`, `env/metric/NAME_mean`). A reward that raises fails that rollout as a
  `VerifiersScoringError`; an episode that fails (its `Env.run` raises, its harness or tool server
  fails) as a `VerifiersRolloutError`: counted by the orchestrator, never a crashed step.
  `max_concurrent` bounds the rollouts in flight (their turns, tools and scoring), `timeout_s` each.
- **One conversation per rollout.** The tokens trained on are one conversation; an episode whose
  second conversation reaches the policy (best-of-n, several trainable seats) fails with a
  `ConversationError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import verifiers.v1 as vf
from pydantic import ValidationError
from verifiers.v1.clients.train import serialize_completion
from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE
from verifiers.v1.interception import InterceptionServer
from verifiers.v1.runtimes.subprocess import SubprocessRuntime

from megatron_rl.envs.base import ChatModel, ConversationError, DrivenEnvironment, Turn
from megatron_rl.envs.tool_parsers import make_tool_parser

POLICY_MODEL = "megatron-rl-policy"  # the model name the harness program asks for
# The policy's endpoint as verifiers sees it: a train client (streamed requests reach
# `get_response`), never dialed: the interception server uses `PolicyClient` for it.
POLICY_CLIENT = vf.TrainClientConfig(base_url="http://megatron-rl.invalid/v1", api_key_var="MEGATRON_RL_NO_KEY")


class VerifiersRolloutError(RuntimeError):
    """An episode that failed: its `Env.run` or `finalize` raised, its harness or a tool server
    failed, or it ran past `timeout_s`."""


class VerifiersScoringError(RuntimeError):
    """A reward, metric or judge of the task raised (or the pass signal is missing)."""


@dataclass
class _Rollout:
    """What `PolicyClient` knows of one rollout: its model and what passed through it."""

    model: ChatModel
    traces: list = field(default_factory=list)  # every trace its episode minted
    served: set[str] = field(default_factory=set)  # ids of the traces whose turns were sampled
    error: BaseException | None = None  # the first failure of a turn (raised after the episode)
    tool_calls: int = 0
    tool_malformed: int = 0
    exhausted: bool = False  # a turn was asked for with the token budget spent


def _text(content, where: str) -> str:
    """A message's content as text: a string, or text parts joined (images are refused)."""
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(f"{where}: a {kind!r} content part; only text reaches the policy")
        parts.append(part.get("text", ""))
    return "".join(parts)


def chat_message(raw: dict, index: int) -> dict:
    """A chat request's message as our template renders it and as `ChatModel.chat` compares turns:
    role and text content, a tool message's call id and name, an assistant message's calls. The
    same message sent by a relaunched harness program (rebuilt from the trace) compares equal."""
    role = raw.get("role")
    message = {"role": role, "content": _text(raw.get("content"), f"message {index} ({role})")}
    if role == "tool":
        message["tool_call_id"] = raw.get("tool_call_id", "")
        if raw.get("name"):
            message["name"] = raw["name"]
    if role == "assistant" and raw.get("tool_calls"):
        message["tool_calls"] = [
            {"id": call.get("id"), "type": "function",
             "function": {"name": call["function"]["name"], "arguments": call["function"].get("arguments")}}
            for call in raw["tool_calls"]
        ]  # fmt: skip
    return message


class PolicyClient(vf.Client):
    """The policy as a verifiers client: each request goes to its rollout's `ChatModel`."""

    def __init__(self, parser) -> None:
        self.parser = parser
        self.rollouts: dict[str, _Rollout] = {}  # trace id -> its rollout

    async def get_response(self, dialect, body, sampling, session_id=None, turn=None, headers=None) -> vf.Response:
        rollout = self.rollouts.get(session_id or "")
        if rollout is None:
            raise vf.ProviderError(f"no megatron-rl rollout has session {session_id!r}", status_code=400)
        if rollout.error is not None:  # the program retried after a failed turn: refuse again
            raise vf.ProviderError(f"the rollout already failed: {rollout.error}", status_code=400)
        try:
            messages = [chat_message(m, i) for i, m in enumerate(body.get("messages") or [])]
            reply = await rollout.model.chat(messages, body.get("tools") or None)
        except Exception as error:  # kept and raised by the rollout; 400: the program must not retry
            rollout.error = error
            raise vf.ProviderError(f"{type(error).__name__}: {error}", status_code=400) from error
        rollout.served.add(session_id)
        rollout.exhausted |= reply.finish_reason == "length" and not reply.token_ids
        parsed = self.parser.parse(reply.content)
        calls = [
            vf.ToolCall(id=f"call_{len(rollout.served)}_{rollout.tool_calls + i}", name=call.name,
                        arguments=json.dumps(call.arguments))
            for i, call in enumerate(parsed.calls)
        ]  # fmt: skip
        rollout.tool_calls += len(calls)
        rollout.tool_malformed += len(parsed.errors)
        finish = "length" if reply.finish_reason == "length" else ("tool_calls" if calls else "stop")
        response = vf.Response(
            id=f"{session_id}-{len(reply.prompt_ids)}", created=int(time.time()), model=POLICY_MODEL,
            message=vf.AssistantMessage(content=(parsed.content if calls else reply.content) or None,
                                        tool_calls=calls or None),
            finish_reason=finish,
            usage=vf.Usage(prompt_tokens=len(reply.prompt_ids), completion_tokens=len(reply.token_ids)),
            tokens=vf.TurnTokens(prompt_ids=reply.prompt_ids, completion_ids=reply.token_ids,
                                 completion_logprobs=reply.logprobs),
        )  # fmt: skip
        response.raw = serialize_completion(response, POLICY_MODEL)
        return response


def prepare_chat_program() -> None:
    """The library's chat program, prepared for the subprocess runtime with this interpreter
    (where the runtime would run `uv sync --script`): written where the runtime keeps prepared
    scripts and entered in its cache of prepared interpreters, which it consults first."""
    data = CHAT_PROGRAM_SOURCE.encode()
    path = Path(SubprocessRuntime.scripts_dir) / f"{hashlib.sha256(data).hexdigest()}.py"
    if SubprocessRuntime._interpreters.get(str(path)) == sys.executable and path.is_file():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    partial.write_bytes(data)
    os.replace(partial, path)
    SubprocessRuntime._interpreters[str(path)] = sys.executable


def _rollout_error(errors, where: str) -> Exception:
    """The library's recorded errors as one of ours: a scoring failure or a failed episode."""
    error = errors[-1]
    text = f"{where}: {error.type}: {error.message}"
    if error.type == "TaskError" and "scoring" in error.message.split(":", 1)[0]:
        return VerifiersScoringError(text)
    return VerifiersRolloutError(text)


class VerifiersEnvironment(DrivenEnvironment):
    """A loaded verifiers `Env` as an environment of ours (module docstring)."""

    def __init__(self, env: vf.Env, tasks: list, spec, key: str) -> None:
        self.env, self.tasks, self.spec, self.key = env, tasks, spec, key
        self.parser = make_tool_parser(spec.tool_parser, f"{key}.tool_parser")
        self.client = PolicyClient(self.parser)
        self.context = vf.ModelContext(model=POLICY_MODEL, client=POLICY_CLIENT)
        self._loop = None  # the event loop the environment serves on, and what it holds there
        self._serving: contextlib.AsyncExitStack | None = None
        self._lock: asyncio.Lock | None = None
        self._bound: asyncio.Semaphore | None = None

    def __len__(self) -> int:
        return len(self.tasks)

    def row(self, index: int) -> dict:
        task = self.tasks[index % len(self.tasks)]
        return {"index": index % len(self.tasks), "idx": task.data.idx, "key": task.key}

    async def _serve(self) -> None:
        """The environment's serving resources (the interception server with our client, shared
        tool servers) on this event loop: entered once, kept until `aclose`."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # first use, or a new loop (the old one's resources died with it)
            self._loop, self._serving = loop, None
            self._lock = asyncio.Lock()
            self._bound = asyncio.Semaphore(self.spec.max_concurrent) if self.spec.max_concurrent else None
        async with self._lock:
            if self._serving is not None:
                return
            prepare_chat_program()
            stack = contextlib.AsyncExitStack()
            await stack.enter_async_context(self.env.serving())
            interception = self.env._interception
            if not isinstance(interception, InterceptionServer):
                await stack.aclose()
                raise VerifiersRolloutError(f"{self.key}: the environment serves through {type(interception).__name__}, "
                                            "not one InterceptionServer")  # fmt: skip
            # The server's client for the policy's endpoint config: ours (it builds one per config).
            interception.clients[POLICY_CLIENT.model_dump_json()] = self.client
            self._serving = stack

    async def aclose(self) -> None:
        """Stops the serving resources (the interception server, shared tool servers)."""
        if self._serving is not None and self._loop is asyncio.get_running_loop():
            stack, self._serving = self._serving, None
            await stack.aclose()

    async def run(self, row: dict, model: ChatModel) -> Turn:
        task = self.tasks[row["index"]]
        await self._serve()
        rollout = _Rollout(model)

        def minted(trace) -> None:
            rollout.traces.append(trace)
            self.client.rollouts[trace.id] = rollout

        try:
            async with self._bound or contextlib.nullcontext():  # the time limit starts with the rollout
                async with asyncio.timeout(self.spec.timeout_s):
                    episode = await self.env.run_episode(task, self.context, on_trace=minted)
        except TimeoutError:
            raise VerifiersRolloutError(
                f"{self.key}: task {task.data.idx} ran past timeout_s ({self.spec.timeout_s:g} s)"
            ) from None
        finally:
            for trace in rollout.traces:
                self.client.rollouts.pop(trace.id, None)
        return self._turn(task, episode, rollout)

    def _turn(self, task, episode, rollout: _Rollout) -> Turn:
        """The rollout's Turn from its finished episode (the one trace the policy played)."""
        where = f"{self.key} ({self.spec.id}, task {task.data.idx})"
        if rollout.error is not None:
            raise rollout.error
        served = [trace for trace in episode.traces if trace.id in rollout.served]
        if len(served) > 1:
            raise ConversationError(f"{where}: the episode held {len(served)} conversations with the policy; "
                                    "a rollout trains one")  # fmt: skip
        if episode.errors:
            raise _rollout_error(episode.errors, where)
        if not served:  # run_member names an environment that never sampled
            return Turn(reward=0.0, done=False)
        (trace,) = served
        if not trace.ok:
            raise _rollout_error(trace.errors, where)
        rewards = {name: reward for name, reward in trace.rewards.items() if reward is not None}
        scores = {f"reward/{name}": reward.score for name, reward in rewards.items()}
        scores |= {f"metric/{name}": value for name, value in trace.metrics.items() if value is not None}
        signal = self.spec.pass_signal
        if signal is None:
            value = trace.reward
        elif f"reward/{signal}" in scores or f"metric/{signal}" in scores:
            value = scores.get(f"reward/{signal}", scores.get(f"metric/{signal}"))
        else:
            raise VerifiersScoringError(f"{where}: {self.key}.pass_signal {signal!r} is neither a reward nor a "
                                        f"metric of the rollout (it has {sorted(scores)})")  # fmt: skip
        tool_errors = sum(1 for message in trace.tool_messages
                          if _text_of(message.content).lstrip().lower().startswith("error"))  # fmt: skip
        return Turn(
            reward=float(trace.reward), done=not rollout.exhausted, passed=value >= self.spec.pass_threshold,
            tool_calls=rollout.tool_calls + rollout.tool_malformed, tool_errors=tool_errors + rollout.tool_malformed,
            tool_malformed=rollout.tool_malformed, scores=scores,
        )  # fmt: skip


def _text_of(content) -> str:
    if isinstance(content, str) or content is None:
        return content or ""
    return "".join(getattr(part, "text", "") or "" for part in content)


def _env_config(spec, args: dict, args_key: str, key: str):
    """The environment config `args` describe, validated by the library (errors name the key)."""
    raw = json.loads(json.dumps(args))
    taskset = raw.get("taskset", {})
    if not isinstance(taskset, dict):
        raise ValueError(f"{args_key}.taskset: the taskset's config fields (a mapping), got {taskset!r}")
    if taskset.get("id", spec.id) != spec.id:
        raise ValueError(f"{args_key}.taskset.id: the taskset is {key}.id ({spec.id!r}); leave it out")
    raw["taskset"] = {**taskset, "id": spec.id}
    try:
        vf.import_taskset(spec.id)
    except ModuleNotFoundError as error:
        raise ValueError(f"{key}.id: verifiers cannot load {spec.id!r}: {error}") from None
    try:
        config_type = vf.env_config_type(spec.id, raw.get("id") or "")
    except (ModuleNotFoundError, TypeError, AttributeError, ValueError) as error:
        raise ValueError(f"{args_key}.id: verifiers cannot load the environment {raw.get('id')!r}: {error}") from None
    interception = raw.setdefault("interception", {"type": "server"})
    if not isinstance(interception, dict) or interception.get("type") != "server":
        raise ValueError(f"{args_key}.interception: the policy is served through one interception server "
                         "(type: server); leave it out")  # fmt: skip
    library_default = vf.default_harness_id(spec.id) == "bash"  # the taskset ships no harness of its own
    for seat, info in config_type.model_fields.items():
        if not isinstance(info.default, vf.AgentConfig):
            continue
        agent = raw.setdefault(seat, {})
        if not isinstance(agent, dict):
            raise ValueError(f"{args_key}.{seat}: the seat's agent config (a mapping), got {agent!r}")
        runtime = agent.setdefault("runtime", {"type": "subprocess"})
        if not isinstance(runtime, dict) or runtime.get("type") != "subprocess":
            raise ValueError(f"{args_key}.{seat}.runtime: only the local subprocess runtime is supported "
                             f"(type: subprocess), got {runtime!r}")  # fmt: skip
        if "harness" not in agent and info.default.harness is None and library_default:
            agent["harness"] = {"id": "null"}
    try:
        return vf.resolve_env_config(raw)
    except ValidationError as error:
        problems = [f"{args_key}.{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in error.errors()]
        raise ValueError("; ".join(problems)) from None


def make_verifiers_environment(spec, dataset: str | None = None, seed: int = 0,
                               key: str = "orchestrator.environment", args: dict | None = None) -> VerifiersEnvironment:  # fmt: skip
    """The verifiers environment `spec` names (config/hubs.py), configured by `args`
    (`orchestrator.environment_args`: the environment config's fields), its tasks shuffled by
    `seed`."""
    base = key.removesuffix("environment")
    if dataset is not None:
        raise ValueError(f"{base}dataset: a verifiers environment loads its own rows "
                         f"(its taskset's config, {base}environment_args.taskset); leave it unset")  # fmt: skip
    config = _env_config(spec, dict(args or {}), f"{base}environment_args", key)
    try:
        env = vf.load_environment(config)
    except Exception as error:
        raise ValueError(f"{key}: verifiers could not load {spec.id!r}: {type(error).__name__}: {error}") from error
    if not env.taskset.bounded:
        raise ValueError(f"{key}: {spec.id!r} is an endless taskset; bound it in its config to train on it")
    tasks = list(env.taskset.shuffle(seed=seed))
    if not tasks:
        raise ValueError(f"{key}: {spec.id!r} has no tasks (its config: {base}environment_args.taskset)")
    return VerifiersEnvironment(env, tasks, spec, key)
