"""Environments written for OpenEnv (openenv-core 0.3.0), trained and evaluated unchanged:
`orchestrator.environment: {hub: openenv, url: http://host:port}` names a running environment
server (one the library's `create_app` serves), `orchestrator.environment_args` say how the
model's text becomes an Action and an Observation the next message (`OpenEnvArgs`).

Each rollout is one episode in its own session over the server's `/ws` WebSocket, through the
library's `GenericEnvClient` (the HTTP `/reset` and `/step` are one-shot: a fresh environment per
call): reset (with the row's seed and `reset_args`), then turns of the policy through
`ChatModel.chat` (the conversation: `system_prompt`, the reset's observation as a user message,
each reply as the assistant's, each step's observation as the next message, masked) and steps
with the reply as the Action, until the server says `done`, `max_turns` pass or the token budget
is spent. The rollout's reward is the episode's step rewards combined (`reward`: their sum or the
last); it passes when done with a reward of at least the hub block's `pass_threshold`.

At most `max_concurrent` sessions of one environment are open at once (the server's
`max_concurrent_envs`; 1 by default, as the server's). Before the episode starts (up to the
reset's reply) a refused or dropped connection is retried `retries` times and a full server
(CAPACITY_REACHED, e.g. an evaluation set on the same server) is waited for up to `timeout_s`.
After that a failing server fails the rollout, never the run: an error frame
(`OpenEnvServerError`), an action the server rejects (`OpenEnvActionRejected`), the socket closed
mid-episode (`OpenEnvDisconnected`), no reply within `timeout_s` (`OpenEnvTimeout`), no session
at all (`OpenEnvUnavailable`), a mapping of `environment_args` that does not fit what the server
sent (`OpenEnvAdapterError`). The member is `failed` with that error, counted by kind in the
step's `member_errors`. The session is closed on every path (done, error, cancellation)."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import zlib
from typing import Any, Literal

from openenv.core.client_types import StepResult
from openenv.core.generic_client import GenericEnvClient
from pydantic import Field, ValidationError, model_validator
from websockets.exceptions import ConnectionClosed

from megatron_rl.config.base import Strict
from megatron_rl.config.plugins import load_object
from megatron_rl.envs.base import ChatModel, DrivenEnvironment, Turn

log = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 5.0  # a session's close handshake; past it the connection is dropped
CAPACITY_WAIT_S = (0.05, 1.0)  # first and longest pause before asking a full server again


class OpenEnvArgs(Strict):
    """`orchestrator.environment_args` of an OpenEnv environment."""

    action_field: str = Field(default="message", min_length=1, description="The Action's field the model's reply (its text without reasoning) fills; the Action is `{action_field: text, **action_args}`.")
    action_args: dict[str, Any] = Field(default_factory=dict, description="More fields of every Action, fixed.")
    action_fn: str | None = Field(default=None, description="Instead of action_field: a plug-in 'package.module:function' called as f(text, observation) with the reply's text and the last observation (a dict), returning the Action (a dict).")
    observation_template: str | None = Field(default=None, description="The next message's text from an Observation: a Python format string over its fields ('{prompt}'); null: its only text field.")
    observation_fn: str | None = Field(default=None, description="Instead of observation_template: a plug-in 'package.module:function' called as f(observation) returning the next message's text, or a list of messages ({role, content}).")
    observation_role: Literal["user", "tool"] = Field(default="user", description="The role of an observation's message.")
    system_prompt: str | None = Field(default=None, description="A system message before the first observation.")
    reset_args: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of every reset.")
    seed_resets: bool = Field(default=True, description="Pass each row's seed to reset as `seed` (rows differ by their seed); false: reset_args alone.")
    num_rows: int | None = Field(default=None, ge=1, description="Distinct rows (episode seeds) before they repeat, shuffled each epoch; null: endless.")
    max_turns: int | None = Field(default=None, ge=1, description="Steps of an episode at most; past it the rollout ends unfinished (no reward). null: only the token budget bounds it.")
    reward: Literal["sum", "last"] = Field(default="sum", description="The rollout's reward from its steps' rewards (a step without one counts 0): their sum or the last.")

    @model_validator(mode="after")
    def _one_mapping_each(self) -> OpenEnvArgs:
        if self.action_fn is not None and ("action_field" in self.model_fields_set or self.action_args):
            raise ValueError("action_fn builds the whole Action: give it or action_field/action_args, not both")
        if self.observation_fn is not None and self.observation_template is not None:
            raise ValueError("give observation_fn or observation_template, not both")
        if self.seed_resets and "seed" in self.reset_args:
            raise ValueError("reset_args sets `seed` while seed_resets passes each row's: set seed_resets: false")
        return self


class OpenEnvError(RuntimeError):
    """An episode that failed on the server's side or in the adapter's mapping: its rollout fails."""


class OpenEnvUnavailable(OpenEnvError):
    """No session: the server refused or dropped the connection (after the retries), or stayed full."""


class OpenEnvServerError(OpenEnvError):
    """The server answered with an error frame (its environment raised, or another error code)."""


class OpenEnvActionRejected(OpenEnvError):
    """The server rejected the Action the adapter sent (VALIDATION_ERROR: not the Action's schema)."""


class OpenEnvDisconnected(OpenEnvError):
    """The server closed the socket mid-episode."""


class OpenEnvTimeout(OpenEnvError):
    """No reply within `timeout_s`."""


class OpenEnvAdapterError(OpenEnvError):
    """`environment_args`' mapping does not fit what the server sent (or a plug-in raised)."""


class _ErrorFrame(Exception):
    def __init__(self, data: dict):
        super().__init__(f"{data.get('code', 'UNKNOWN')}: {data.get('message', '')}")
        self.code, self.data = str(data.get("code", "UNKNOWN")), data


class _SessionClient(GenericEnvClient):
    """The library's client, keeping an error frame's code (its own raises a bare RuntimeError)."""

    async def _send_and_receive(self, message: dict[str, Any]) -> dict[str, Any]:
        try:
            await self._send(message)
        except ConnectionClosed:  # a full server sends CAPACITY_REACHED and closes before we ask
            response = await self._buffered()
            if response is None or response.get("type") != "error":
                raise
        else:
            response = await self._receive()
        if response.get("type") == "error":
            raise _ErrorFrame(response.get("data") or {})
        return response

    async def _buffered(self) -> dict[str, Any] | None:
        """A frame the server sent before it closed the connection, if one is still unread."""
        try:
            return json.loads(await asyncio.wait_for(self._ws.recv(), 0.1))
        except Exception:
            return None

    def abort(self) -> None:
        """Drops the connection without a handshake (the server ends the session on its side)."""
        if self._ws is not None:
            self._ws.transport.abort()
            self._ws = None


def episode_seed(seed: int, episode: int) -> int:
    """The reset seed of episode `episode` (deterministic, non-negative, 31 bits)."""
    return zlib.crc32(f"openenv:{seed}:{episode}".encode()) & 0x7FFFFFFF


class OpenEnvEnvironment(DrivenEnvironment):
    """One OpenEnv environment server as an environment of ours (module docstring)."""

    def __init__(self, url: str, name: str, args: OpenEnvArgs, seed: int, key: str, max_concurrent: int = 1,
                 timeout_s: float = 120.0, retries: int = 2, pass_threshold: float = 1.0) -> None:  # fmt: skip
        self.url, self.name, self.args, self.seed, self.key = url, name, args, seed, key
        self.max_concurrent, self.timeout_s, self.retries = max_concurrent, timeout_s, retries
        self.pass_threshold = pass_threshold
        self.max_turns = args.max_turns
        self._action_fn = load_object(args.action_fn, f"{key}_args.action_fn") if args.action_fn else None
        self._observation_fn = (
            load_object(args.observation_fn, f"{key}_args.observation_fn") if args.observation_fn else None
        )
        self._bound: tuple[asyncio.AbstractEventLoop, asyncio.Semaphore] | None = None

    def __len__(self) -> int | None:
        return self.args.num_rows

    def row(self, index: int) -> dict:
        episode = index
        if self.args.num_rows is not None:  # each epoch a fresh seeded permutation of the episodes
            epoch, position = divmod(index, self.args.num_rows)
            order = list(range(self.args.num_rows))
            random.Random(f"openenv:{self.seed}:{epoch}").shuffle(order)
            episode = order[position]
        return {"index": index, "episode": episode, "seed": episode_seed(self.seed, episode)}

    # --- one episode ----------------------------------------------------------------------------
    async def run(self, row: dict, model: ChatModel) -> Turn:
        async with self._semaphore():
            client, result = await self._open(row)
            try:
                return await self._episode(client, result, model)
            finally:
                await self._close(client)

    async def _episode(self, client: _SessionClient, result: StepResult, model: ChatModel) -> Turn:
        if result.done:
            raise OpenEnvServerError(f"{self._where()}: the reset's observation is already done: no turn to take")
        system = [{"role": "system", "content": self.args.system_prompt}] if self.args.system_prompt else []
        first = self._messages(result.observation, "the reset's observation")
        messages = [*system, *[{**m, "role": "user"} if m["role"] == "tool" else m for m in first]]
        rewards: list[float] = []
        for turn in range(1, (self.args.max_turns or 1 << 30) + 1):
            reply = await model.chat(messages)
            if reply.finish_reason == "length" and not reply.token_ids:  # the token budget is spent
                break
            action = self._action(reply.content, result.observation)
            result = await self._call(client.step(action), f"step {turn}")
            rewards.append(float(result.reward or 0.0))
            if result.done:
                reward = sum(rewards) if self.args.reward == "sum" else rewards[-1]
                return Turn(reward=reward, passed=reward >= self.pass_threshold, done=True)
            if turn == self.args.max_turns:
                break
            messages = [*messages, {"role": "assistant", "content": reply.content},
                        *self._messages(result.observation, f"step {turn}'s observation")]  # fmt: skip
        return Turn(reward=0.0, passed=False, done=False)  # unfinished: no reward

    # --- the session ----------------------------------------------------------------------------
    def _semaphore(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if self._bound is None or self._bound[0] is not loop:  # a semaphore belongs to one loop
            self._bound = (loop, asyncio.Semaphore(self.max_concurrent))
        return self._bound[1]

    def _where(self) -> str:
        return f"openenv {self.name!r} ({self.url})"

    async def _open(self, row: dict) -> tuple[_SessionClient, StepResult]:
        """A session reset for `row`: a refused or dropped connection retried `retries` times, a
        full server waited for up to `timeout_s`."""
        reset_args = {**self.args.reset_args, **({"seed": row["seed"]} if self.args.seed_resets else {})}
        loop = asyncio.get_running_loop()
        deadline, pause, failures = loop.time() + self.timeout_s, CAPACITY_WAIT_S[0], 0
        while True:
            client = _SessionClient(self.url, connect_timeout_s=self.timeout_s, message_timeout_s=self.timeout_s)
            try:
                await client.connect()
                result = await self._call(client.reset(**reset_args), "reset")
                return client, result
            except (ConnectionError, OpenEnvDisconnected) as error:  # refused, or dropped before the reset's reply
                await self._close(client)
                failures += 1
                if failures > self.retries:
                    raise OpenEnvUnavailable(
                        f"{self._where()}: no session after {failures} tries ({self.retries} retries): {error}"
                    ) from None
                await asyncio.sleep(min(0.1 * 2 ** (failures - 1), 2.0))
            except OpenEnvServerError as error:
                await self._close(client)
                if getattr(error, "code", None) != "CAPACITY_REACHED":
                    raise
                if loop.time() + pause > deadline:
                    raise OpenEnvUnavailable(
                        f"{self._where()}: the server stayed full ({error.args[0]}) for timeout_s {self.timeout_s} s"
                    ) from None
                await asyncio.sleep(pause)
                pause = min(2 * pause, CAPACITY_WAIT_S[1])
            except BaseException:
                await self._close(client)
                raise

    async def _call(self, request, what: str) -> StepResult:
        """The reply to a reset or step; the server's failures as OpenEnvError naming `what`."""
        try:
            return await request
        except _ErrorFrame as frame:
            kind = OpenEnvActionRejected if frame.code == "VALIDATION_ERROR" and what != "reset" else OpenEnvServerError
            detail = frame.data.get("errors")
            error = kind(f"{self._where()}: {what} answered with an error frame {frame}"
                         + (f" {json.dumps(detail, default=str)[:500]}" if detail else ""))  # fmt: skip
            error.code = frame.code
            raise error from None
        except ConnectionClosed as closed:
            raise OpenEnvDisconnected(f"{self._where()}: the server closed the session during {what} ({closed})") from None
        except TimeoutError:
            raise OpenEnvTimeout(f"{self._where()}: no reply to {what} within timeout_s {self.timeout_s} s") from None

    async def _close(self, client: _SessionClient) -> None:
        """Closes the session (a close message, then the handshake); a close that fails or hangs
        drops the connection instead. Never raises but a cancellation, after dropping it."""
        try:
            await asyncio.wait_for(client.close(), CLOSE_TIMEOUT_S)
        except asyncio.CancelledError:
            client.abort()
            raise
        except Exception as error:  # the session is over either way
            log.debug("%s: closing a session failed (%s): dropped", self._where(), error)
            client.abort()

    # --- the mapping ------------------------------------------------------------------------------
    def _action(self, text: str, observation: dict) -> dict:
        if self._action_fn is None:
            return {**self.args.action_args, self.args.action_field: text}
        try:
            action = self._action_fn(text, observation)
        except Exception as error:
            raise OpenEnvAdapterError(
                f"{self._where()}: {self.key}_args.action_fn {self.args.action_fn!r} raised {type(error).__name__}: {error}"
            ) from error
        if not isinstance(action, dict):
            raise OpenEnvAdapterError(
                f"{self._where()}: {self.key}_args.action_fn {self.args.action_fn!r} returned a "
                f"{type(action).__name__}, not the Action as a dict"
            )
        return action

    def _messages(self, observation: dict, what: str) -> list[dict]:
        """The messages an observation becomes (text of `observation_role`, or observation_fn's)."""
        role, args = self.args.observation_role, self.args
        if self._observation_fn is not None:
            try:
                out = self._observation_fn(observation)
            except Exception as error:
                raise OpenEnvAdapterError(
                    f"{self._where()}: {self.key}_args.observation_fn {args.observation_fn!r} raised on {what}: "
                    f"{type(error).__name__}: {error}"
                ) from error
            if isinstance(out, str):
                return [{"role": role, "content": out}]
            if isinstance(out, list) and all(
                isinstance(m, dict) and m.get("role") in ("user", "tool", "system") and isinstance(m.get("content"), str)
                for m in out
            ):  # fmt: skip
                return [dict(m) for m in out]
            raise OpenEnvAdapterError(
                f"{self._where()}: {self.key}_args.observation_fn {args.observation_fn!r} returned {out!r:.200} on "
                f"{what}: expected a str or a list of messages {{role: user|tool|system, content: str}}"
            )
        if args.observation_template is not None:
            try:
                return [{"role": role, "content": args.observation_template.format_map(observation)}]
            except (KeyError, IndexError, AttributeError) as error:
                raise OpenEnvAdapterError(
                    f"{self._where()}: {self.key}_args.observation_template {args.observation_template!r} needs "
                    f"{error} that {what} lacks (its fields: {sorted(observation)})"
                ) from None
        texts = [name for name, value in observation.items() if isinstance(value, str)]
        if len(texts) != 1:
            raise OpenEnvAdapterError(
                f"{self._where()}: {what} has {len(texts)} text fields ({sorted(observation)}): say which becomes "
                f"the message with {self.key}_args.observation_template (e.g. '{{{texts[0] if texts else 'field'}}}') "
                "or observation_fn"
            )
        return [{"role": role, "content": observation[texts[0]]}]


def make_openenv_environment(spec, dataset: str | None, seed: int, key: str, args: dict) -> OpenEnvEnvironment:
    """The environment server `spec` (config/hubs.py HubEnvironment, hub openenv) names, with
    `args` (`orchestrator.environment_args`, OpenEnvArgs) as its mapping."""
    if dataset is not None:
        raise ValueError(
            f"{key}: an OpenEnv environment's rows are its server's resets (seeded per row); it takes no dataset "
            f"(got {dataset!r}): put reset keyword arguments in {key}_args.reset_args"
        )
    try:
        parsed = OpenEnvArgs(**args)
    except ValidationError as error:
        problems = "; ".join(
            f"{key}_args{''.join(f'.{part}' for part in e['loc'])}: {e['msg']}" for e in error.errors()
        )
        raise ValueError(f"{key}: the OpenEnv adapter's arguments are invalid: {problems}") from None
    if not spec.url.startswith(("http://", "https://", "ws://", "wss://")):
        raise ValueError(f"{key}.url: {spec.url!r} is not an http(s):// or ws(s):// URL of an OpenEnv server")
    return OpenEnvEnvironment(
        spec.url.rstrip("/"), spec.id or spec.url, parsed, seed, key, max_concurrent=spec.max_concurrent or 1,
        timeout_s=spec.timeout_s, retries=spec.retries, pass_threshold=spec.pass_threshold,
    )  # fmt: skip (a plug-in that cannot be loaded: PluginError, a ValueError naming the key)
