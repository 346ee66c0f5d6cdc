"""Generative reward models: an LLM judge reads the prompt and the answer and its verdict is the
reward (`orchestrator.judge`).

`Judge` asks an OpenAI-compatible `/v1/chat/completions` endpoint (a vLLM server or router of
the user's, or any such service) with the config's template filled with the prompt, the answer
(the last completion, reasoning removed) and the row's reference answer, at temperature 0; with
`structured` it passes vLLM's structured outputs (`regex` for a score, `choice` for choices), so a
vLLM judge can only emit a verdict the parser reads. The verdict is parsed:

- `score`: the first group of `pattern` as a number, clipped to `score_range` and mapped to [0, 1];
- `choice`: the reply (stripped) must be one of `choices`, whose value is the verdict.

A verdict the parser cannot read raises `JudgeVerdictError` carrying the reply's text: that
member fails, counted (`members_dropped: failed`, `judge_unparsable`), never a silent 0. A
request that fails (connection, timeout, HTTP 5xx) is retried `retries` times; after that, or on
any other HTTP error, `JudgeUnavailable` names the judge and fails the step. At most
`max_concurrent` requests are in flight.

`JudgedEnvironment(inner, judge)` wraps any environment: its turns are the inner one's, and when
the rollout is done its reward is `rule_weight` x the inner reward + `weight` x the verdict
(`passed`: the verdict >= `pass_threshold`).
"""

from __future__ import annotations

import asyncio
import re

import httpx

from megatron_rl.envs.base import DrivenEnvironment, Environment, Turn


class JudgeVerdictError(RuntimeError):
    """The judge answered something the verdict parser cannot read (its text kept)."""


class JudgeUnavailable(RuntimeError):
    """The judge could not be reached or refused the request (after its retries): the step fails."""


class Judge:
    def __init__(self, config, transport: httpx.AsyncBaseTransport | None = None, backoff_s: float = 0.5,
                 url: str | None = None):  # fmt: skip
        """`config`: an `orchestrator.judge` JudgeConfig; `transport`: an httpx transport (an in-process server) in place of the network;
        `backoff_s`: the first retry's wait (doubling, at most 5 s); `url`: where the judge is
        served when the run serves it (its router, from the layout), else `config.url`."""
        self.config, self.backoff_s = config, backoff_s
        if (url or config.url) is None:
            raise ValueError("orchestrator.judge: no url, and no served judge's address was given")
        self.url = (url or config.url).rstrip("/")
        key = config.api_key()
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(config.timeout_s, connect=30.0), transport=transport,
                                       headers={"Authorization": f"Bearer {key}"} if key else {})  # fmt: skip
        self._bound: asyncio.Semaphore | None = None
        self.calls = self.retried = self.unparsable = 0
        self.pattern = re.compile(config.pattern) if config.verdict == "score" else None

    def messages(self, prompt: str, answer: str, reference: str | None) -> list[dict]:
        content = self.config.template.format(prompt=prompt, answer=answer, reference=reference or "")
        system = [{"role": "system", "content": self.config.system}] if self.config.system else []
        return [*system, {"role": "user", "content": content}]

    def body(self, prompt: str, answer: str, reference: str | None) -> dict:
        c = self.config
        body = {"model": c.model, "messages": self.messages(prompt, answer, reference), "temperature": 0.0,
                "max_tokens": c.max_tokens}  # fmt: skip
        if c.structured:  # vLLM's structured outputs: only a parseable verdict can be sampled
            body["structured_outputs"] = {"regex": c.pattern} if c.verdict == "score" else {"choice": list(c.choices)}
        return body

    def parse(self, text: str) -> float:
        """The verdict's value; JudgeVerdictError (with the text) when it cannot be read."""
        c = self.config
        if c.verdict == "choice":
            value = c.choices.get(text.strip())
            if value is None:
                raise JudgeVerdictError(f"judge verdict {text[:200]!r} is none of {sorted(c.choices)}")
            return float(value)
        match = self.pattern.search(text)
        try:
            score = float(match.group(1)) if match else None
        except (ValueError, IndexError):
            score = None
        if score is None:
            raise JudgeVerdictError(f"judge verdict {text[:200]!r} has no score matching {c.pattern!r}")
        low, high = c.score_range
        return (min(max(score, low), high) - low) / (high - low)

    async def verdict(self, prompt: str, answer: str, reference: str | None = None) -> float:
        self._bound = self._bound or asyncio.Semaphore(self.config.max_concurrent)
        body = self.body(prompt, answer, reference)
        async with self._bound:
            text = await self._ask(body)
        self.calls += 1
        try:
            return self.parse(text)
        except JudgeVerdictError:
            self.unparsable += 1
            raise

    async def _ask(self, body: dict) -> str:
        endpoint = f"{self.url}/v1/chat/completions"
        error = ""
        for attempt in range(self.config.retries + 1):
            if attempt:
                self.retried += 1
                await asyncio.sleep(min(self.backoff_s * 2 ** (attempt - 1), 5.0))
            try:
                response = await self._http.post(endpoint, json=body)
            except httpx.HTTPError as exc:
                error = f"{type(exc).__name__}: {exc}"
                continue
            if response.status_code >= 500:
                error = f"HTTP {response.status_code}: {response.text[:300]}"
                continue
            if response.status_code != 200:
                raise JudgeUnavailable(f"judge {endpoint} refused the request: HTTP {response.status_code}: "
                                       f"{response.text[:300]} (orchestrator.judge)")  # fmt: skip
            try:
                return str(response.json()["choices"][0]["message"]["content"] or "")
            except (ValueError, KeyError, IndexError, TypeError):
                raise JudgeUnavailable(f"judge {endpoint}: not a chat completion: {response.text[:300]}") from None
        raise JudgeUnavailable(
            f"judge {endpoint} failed {self.config.retries + 1} times (orchestrator.judge.retries "
            f"{self.config.retries}); last: {error}"
        )

    async def close(self) -> None:
        await self._http.aclose()


def prompt_text(prompt: str | list[dict]) -> str:
    """The prompt as the judge reads it: the text, or the last user message's content."""
    if isinstance(prompt, str):
        return prompt
    users = [m.get("content", "") for m in prompt if m.get("role") == "user"]
    return str(users[-1]) if users else ""


class JudgedEnvironment(Environment):
    """`inner`'s rollouts, rewarded by `judge` when done (see the module docstring)."""

    def __init__(self, inner: Environment, judge: Judge):
        if isinstance(inner, DrivenEnvironment):
            raise ValueError(
                f"orchestrator.judge: {type(inner).__name__} drives its own turns and scores its own rollouts; "
                "a hub environment's judge belongs in its own rewards (verifiers: a judge in the taskset's rubric)"
            )
        self.inner, self.judge = inner, judge
        self.max_turns, self.stop = inner.max_turns, inner.stop

    async def aclose(self) -> None:
        await self.inner.aclose()

    def row(self, index: int) -> dict:
        return self.inner.row(index)

    def __len__(self) -> int | None:
        return self.inner.__len__()

    def prompt(self, row: dict) -> str | list[dict]:
        return self.inner.prompt(row)

    def tool_schemas(self) -> list[dict] | None:
        return self.inner.tool_schemas()

    def demonstration(self, row: dict):
        return self.inner.demonstration(row)

    def step(self, row: dict, completions: list[str]) -> Turn:
        raise TypeError("a judged environment is asynchronous: call astep")

    async def astep(self, row: dict, completions: list[str]) -> Turn:
        turn = await self.inner.astep(row, completions)
        if not turn.done:
            return turn
        c = self.judge.config
        reference = row.get("answer")
        value = await self.judge.verdict(prompt_text(self.inner.prompt(row)), completions[-1] if completions else "",
                                         None if reference is None else str(reference))  # fmt: skip
        turn.reward = c.rule_weight * turn.reward + c.weight * value
        turn.passed = value >= c.pass_threshold
        turn.judge_score = value
        return turn
