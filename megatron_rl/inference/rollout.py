"""Token-in/token-out rollouts through the router (async, httpx).

`await client.complete(prompt_ids, sampling, session_id)` sends one `POST /v1/completions` with
the prompt as token ids (the chat template was applied once, by our tokenizer) and
`return_token_ids` + `logprobs`, and returns a `Completion`: the generated token ids, the
sampler's log-probability of each sampled token, the finish reason (`stop` / `length`) and the
policy version of each token. Text is never re-tokenised: a multi-turn rollout
(`TokenTrajectory`) extends the exact token sequence it holds.

**Partial rollouts.** A request that a weight update interrupts (`inference.update_mode:
interrupt`: the update pauses the servers in vLLM's mode `abort`, which ends every request in
flight with finish reason `abort` and the tokens it sampled so far) is resumed by the client:
once the update is over (`update_in_progress()` false, and the pool's version moved), it is sent
again, to any server, with the tokens so far appended to its prompt and the rest of its budget,
and the parts are joined token for token. Each part is stamped with the version the pool ran
when it was sent, and no request is sent while an update is in progress; a part that ended
normally although an update began or ended while it was in flight (it may have reached a paused
server, which holds it and samples it with the new weights after the resume) is sent again; so
every token knows the version that sampled it (`Completion.token_versions`) exactly where the orchestrator runs the
updates (path (a)); under path (b), where the policy pauses the servers, a request sent while a
broadcast's pause is in progress is stamped with the version before it (a lower bound). With
`update_mode: keep` (vLLM's mode `keep`: requests in flight are preempted and finish under the
new weights) a completion carries one version, the one it was sent under: a lower bound on the
versions that produced its tokens.

With `SamplingParams.routed_experts` (a MoE policy under `algorithm.routing_replay`), every
request also asks for the experts vLLM routed each token to (`routed_experts_prompt_start`: the
first prompt position whose routes the trajectory does not hold yet) and the reply's
`routed_experts` (base64 of an `np.save` array, [tokens - 1 - prompt start, moe_layers, top_k]:
vLLM routes every token it runs through the model, so not the last sampled one) becomes the
completion's `routes`. A multi-turn `TokenTrajectory` joins them: turn n + 1 asks from turn n's
last sampled token on, so the trajectory holds the routes of every token but its last.

Every request carries the `x-session-id` header, so the router's consistent hash sends every
turn of one session to the same worker. A request the router could not deliver (HTTP 5xx: the
worker died or refused before answering) is retried once, straight on another worker of the pool,
and the session stays there for its later turns; otherwise the error names the worker (the
router's message carries its URL) or the router.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import re
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import msgspec
import numpy as np

from megatron_rl.config import OrchestratorConfig
from megatron_rl.data.types import route_dtype
from megatron_rl.inference.prompt_logprobs import PositionEntries, token_logprobs, top_k
from megatron_rl.inference.router import SESSION_HEADER


class RolloutError(RuntimeError):
    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status  # the HTTP status of the reply that failed; None: no reply, or a bad one


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 64
    seed: int | None = None
    prompt_logprobs: bool = False  # also return the log-probability of every prompt token
    prompt_top_k: int = 0  # > 0: also the prompt_top_k most likely tokens at every prompt position (implies prompt_logprobs)
    routed_experts: int = 0  # > 0: return the routes of a MoE policy with this many experts

    @classmethod
    def from_config(cls, orchestrator: OrchestratorConfig, routed_experts: int = 0) -> SamplingParams:
        return cls(
            temperature=orchestrator.temperature,
            top_p=orchestrator.top_p,
            max_tokens=orchestrator.max_completion_tokens,
            seed=orchestrator.seed,
            prompt_logprobs=orchestrator.train_on_observations,
            routed_experts=routed_experts,
        )


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]  # the sampler's log-probability of each token in token_ids
    finish_reason: str  # "stop" (EOS or a stop token) or "length"
    policy_version: int  # the oldest version behind its tokens
    worker: str  # the worker that answered, or the router's URL when the router chose it
    prompt_logprobs: list[float] | None = None  # with SamplingParams.prompt_logprobs (nan at 0)
    # With SamplingParams.prompt_top_k K: [prompt tokens, K] the K most likely tokens at each prompt
    # position given the tokens before it, most likely first (int32; row 0: 0), and their
    # log-probabilities at temperature 1 (float32; row 0: nan).
    prompt_top_ids: np.ndarray | None = None
    prompt_top_logprobs: np.ndarray | None = None
    # With SamplingParams.routed_experts: [rows, moe_layers, top_k] the experts of the request's
    # tokens from its routes start to the second-to-last sampled token (uint8 / uint16).
    routes: np.ndarray | None = None
    token_versions: list[int] | None = None  # the version that sampled each token; None: policy_version
    interruptions: int = 0  # times a weight update interrupted it (each resumed)
    reprefilled_tokens: int = 0  # tokens sent again as the prompt of its resumed parts

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"

    def versions(self) -> list[int]:
        """The version that sampled each token."""
        return list(self.token_versions) if self.token_versions is not None else [self.policy_version] * len(self.token_ids)


class _Logprobs(msgspec.Struct):
    token_logprobs: list[float | None]


class _Choice(msgspec.Struct):
    token_ids: list[int] | None = None
    logprobs: _Logprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: list[PositionEntries | None] | None = None
    routed_experts: str | None = None


class _CompletionReply(msgspec.Struct):
    choices: list[_Choice]


_WORKER_URL = re.compile(r"https?://[\w.\-\[\]:]+")


class RolloutClient:
    def __init__(
        self,
        router_url: str,
        model: str,
        worker_urls: list[str] | tuple[str, ...] = (),
        timeout_s: float = 3600.0,
        api_key: str | None = None,
        version_source: Callable[[], int] | None = None,
        on_worker_failure: Callable[[str], None] | None = None,
        model_source: Callable[[], str] | None = None,
        update_in_progress: Callable[[], bool] | None = None,
        max_interruptions: int = 64,
        version_wait_s: float = 30.0,
        interrupting: Callable[[], bool] | None = None,
    ):
        """`update_in_progress()`: True while a weight update the orchestrator runs is in
        progress (no request is sent then); `interrupting()`: True when updates interrupt the
        requests in flight (inference.update_mode interrupt): then a part that ended normally
        although an update began or ended while it was in flight is sent again, since vLLM holds
        a request that reaches a paused server and samples it with the new weights after the
        resume, under the old stamp (`resent` counts them); `max_interruptions`: how often one completion may be
        interrupted and resumed before it fails, naming its session; `version_wait_s`: how long
        a resumed part waits for the pool's version to move after an interruption (path (b):
        the follower learns it from the servers) before it is sent under the version it has."""
        self.router_url = router_url.rstrip("/")
        self.model = model
        # The model name of each request, when it changes during the run (a LoRA policy's
        # adapter, served under its own name once the first version is installed).
        self.model_source = model_source or (lambda: self.model)
        self.worker_urls = [u.rstrip("/") for u in worker_urls]
        self.version_source = version_source or (lambda: 0)
        self.update_in_progress = update_in_progress or (lambda: False)
        self.interrupting = interrupting or (lambda: False)
        self.max_interruptions, self.version_wait_s = max_interruptions, version_wait_s
        self.interruptions = 0  # completions' parts ended by a weight update (resumed)
        self.resent = 0  # parts sent again: an update overlapped them and their stamp was unsure
        self.on_worker_failure = on_worker_failure
        self.session_workers: dict[str, str] = {}  # sessions moved off a failed worker
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s, connect=30.0),
            headers=headers,
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
        )
        self.retries = 0  # requests that were retried on another worker

    async def close(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> RolloutClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def _body(
        self, prompt_ids: list[int], sampling: SamplingParams, max_tokens: int | None, seed, stop,
        routes_start: int = 0,
    ) -> dict:
        body = {
            "model": self.model_source(),
            "prompt": [int(t) for t in prompt_ids],
            "max_tokens": int(max_tokens if max_tokens is not None else sampling.max_tokens),
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "logprobs": 1,
            "return_token_ids": True,
        }
        seed = sampling.seed if seed is None else seed
        if seed is not None:
            body["seed"] = int(seed)
        if sampling.prompt_logprobs or sampling.prompt_top_k:  # vLLM: 0 = the prompt token's own only
            body["prompt_logprobs"] = int(sampling.prompt_top_k)
        if sampling.routed_experts:
            body["routed_experts_prompt_start"] = int(routes_start)
        if stop:  # e.g. the end of a tool call; the stop string stays in the tokens
            body["stop"] = list(stop)
            body["include_stop_str_in_output"] = True
        return body

    async def _post(self, base_url: str, body: dict, session_id: str) -> httpx.Response:
        try:
            return await self._http.post(
                f"{base_url}/v1/completions", json=body, headers={SESSION_HEADER: session_id}
            )
        except httpx.HTTPError as exc:
            raise RolloutError(f"{base_url}/v1/completions: {type(exc).__name__}: {exc}") from None

    async def complete(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        session_id: str,
        max_tokens: int | None = None,
        seed: int | None = None,
        stop: list[str] | None = None,
        routes_start: int = 0,
    ) -> Completion:
        """One completion of `prompt_ids` (token ids); `max_tokens` overrides the sampling's
        (a multi-turn rollout's remaining budget), `seed` its seed, `stop` ends the turn at a
        string (kept in the output); `routes_start`: the first prompt position whose routes to
        return (with `sampling.routed_experts`). A part interrupted by a weight update is resumed
        (see the module docstring) and the parts joined."""
        budget = int(max_tokens if max_tokens is not None else sampling.max_tokens)
        seed = sampling.seed if seed is None else seed
        parts: list[Completion] = []
        resends = 0
        while True:
            await self._wait_for_update()
            done = sum(len(part.token_ids) for part in parts)
            part_seed = None if seed is None else (seed + 7919 * len(parts)) & 0x7FFFFFFF  # a fresh stream per part
            part = await self._complete_once(
                [*prompt_ids, *(t for part in parts for t in part.token_ids)], sampling, session_id, budget - done,
                part_seed, stop, routes_start + sum(0 if p.routes is None else len(p.routes) for p in parts),
            )  # fmt: skip
            overlapped = self.update_in_progress() or self.version_source() != part.policy_version
            if part.finish_reason != "abort" and overlapped and self.interrupting():
                self.resent += 1  # maybe held through the update: its tokens the new weights', its stamp the old
                resends += 1
                if resends > self.max_interruptions:
                    raise RolloutError(
                        f"completion for session {session_id!r}: {resends} sends overlapped a weight update; more "
                        f"than the client's max_interruptions ({self.max_interruptions})"
                    )
                continue
            parts.append(part)
            if part.finish_reason != "abort":
                break
            if budget - done - len(part.token_ids) <= 0:
                part.finish_reason = "length"  # interrupted as its budget ran out
                break
            self.interruptions += 1
            if len(parts) > self.max_interruptions:
                raise RolloutError(
                    f"completion for session {session_id!r} was interrupted {len(parts)} times "
                    f"(ended with finish reason 'abort'); more than the client's max_interruptions "
                    f"({self.max_interruptions})"
                )
            await self._wait_for_newer(part.policy_version)
        return parts[0] if len(parts) == 1 else joined_parts(parts, len(prompt_ids))

    async def _wait_for_update(self) -> None:
        while self.update_in_progress():
            await asyncio.sleep(0.005)

    async def _wait_for_newer(self, version: int) -> None:
        """After an interruption: until the update is over and the pool's version moved past
        `version`, or `version_wait_s` passed (an abort no update caused)."""
        deadline = time.monotonic() + self.version_wait_s
        while self.update_in_progress() or (self.version_source() <= version and time.monotonic() < deadline):
            await asyncio.sleep(0.005)

    async def _complete_once(self, prompt_ids, sampling, session_id, max_tokens, seed, stop, routes_start) -> Completion:
        version = self.version_source()
        body = self._body(prompt_ids, sampling, max_tokens, seed, stop, routes_start)
        target = self.session_workers.get(session_id, self.router_url)
        response = await self._post(target, body, session_id)
        if response.status_code >= 500 and self.worker_urls:
            failed = self._failed_worker(response.text, target)
            alternative = self._another_worker(session_id, failed)
            if alternative is not None:
                if failed and self.on_worker_failure is not None:
                    self.on_worker_failure(failed)
                self.retries += 1
                self.session_workers[session_id] = alternative
                target = alternative
                response = await self._post(alternative, body, session_id)
        if response.status_code != 200:
            who = self._failed_worker(response.text, target) or target
            raise RolloutError(
                f"completion for session {session_id!r} failed on {who}: HTTP {response.status_code}: "
                f"{response.text[:500]}", status=response.status_code,
            )  # fmt: skip
        routes = (len(prompt_ids) - routes_start, sampling.routed_experts) if sampling.routed_experts else None
        scored = sampling.prompt_logprobs or sampling.prompt_top_k
        return self._parse(response.content, version, target, prompt_ids if scored else None, routes, sampling.prompt_top_k)

    def _failed_worker(self, message: str, target: str) -> str | None:
        if target != self.router_url:
            return target
        for url in _WORKER_URL.findall(message):
            base = url.rstrip("/")
            for worker in self.worker_urls:
                if base.startswith(worker):
                    return worker
        return None

    def _another_worker(self, session_id: str, failed: str | None) -> str | None:
        candidates = [w for w in self.worker_urls if w != failed]
        if not candidates:
            return None
        return candidates[zlib.crc32(session_id.encode()) % len(candidates)]

    def _parse(
        self, payload: bytes, version: int, target: str, prompt_ids: list[int] | None = None,
        routes: tuple[int, int] | None = None, prompt_top_k: int = 0,
    ) -> Completion:
        """The reply as a Completion; `prompt_ids`: read the prompt's log-probabilities too (and
        with `prompt_top_k` > 0 its top k at every position); `routes` (prompt tokens from the
        routes start, experts): decode its routed_experts too."""
        try:
            reply = msgspec.json.decode(payload, type=_CompletionReply)
        except msgspec.ValidationError as exc:
            raise RolloutError(f"{target}: unexpected completion reply ({exc}): {payload[:300]!r}") from None
        if len(reply.choices) != 1:
            raise RolloutError(f"{target}: expected one choice, got {len(reply.choices)}")
        choice = reply.choices[0]
        if choice.token_ids is None or choice.logprobs is None:
            raise RolloutError(
                f"{target}: the reply has no token_ids/logprobs (the server must support return_token_ids)"
            )
        logprobs = [float("nan") if lp is None else float(lp) for lp in choice.logprobs.token_logprobs]
        if len(logprobs) != len(choice.token_ids):
            raise RolloutError(
                f"{target}: {len(choice.token_ids)} token ids but {len(logprobs)} log-probabilities"
            )
        prompt = (None, None, None) if prompt_ids is None else _prompt_scores(choice, prompt_ids, prompt_top_k, target)
        return Completion(
            token_ids=list(choice.token_ids),
            logprobs=logprobs,
            finish_reason=choice.finish_reason or "stop",
            policy_version=version,
            worker=target,
            prompt_logprobs=prompt[0],
            prompt_top_ids=prompt[1],
            prompt_top_logprobs=prompt[2],
            routes=None if routes is None or (choice.finish_reason == "abort" and choice.routed_experts is None)
            else _routes(choice, routes[0] + len(choice.token_ids) - 1, routes[1], target),  # an interrupted part may have none
        )


def joined_parts(parts: list[Completion], prompt_tokens: int) -> Completion:
    """The parts of one interrupted completion as one: tokens, log-probabilities, each token's
    version and routes in order; the last part's finish reason and worker; the prompt's
    log-probabilities and top k of the first part (the later parts' prompts hold sampled tokens)."""
    routes = [p.routes for p in parts if p.routes is not None]
    return Completion(
        token_ids=[t for p in parts for t in p.token_ids],
        logprobs=[x for p in parts for x in p.logprobs],
        finish_reason=parts[-1].finish_reason,
        policy_version=min(p.policy_version for p in parts),
        worker=parts[-1].worker,
        prompt_logprobs=parts[0].prompt_logprobs,
        prompt_top_ids=parts[0].prompt_top_ids,
        prompt_top_logprobs=parts[0].prompt_top_logprobs,
        routes=np.concatenate(routes) if routes else None,  # each part's from where the last one's ended
        token_versions=[v for p in parts for v in p.versions()],
        interruptions=len(parts) - 1,
        reprefilled_tokens=sum(prompt_tokens + sum(len(q.token_ids) for q in parts[:i]) for i in range(1, len(parts))),
    )


def _routes(choice: _Choice, rows: int, num_experts: int, target: str) -> np.ndarray:
    """The reply's `routed_experts` as [rows, moe_layers, top_k] of `route_dtype(num_experts)`;
    RolloutError when it is missing or cannot be the routes of the request's tokens."""
    if choice.routed_experts is None:
        raise RolloutError(
            f"{target}: the reply has no routed_experts (routing replay needs vLLM started with "
            "--enable-return-routed-experts, which the inference pool does when algorithm.routing_replay is on)"
        )
    try:
        routes = np.load(io.BytesIO(base64.b64decode(choice.routed_experts, validate=True)), allow_pickle=False)
    except (ValueError, binascii.Error, OSError) as exc:
        raise RolloutError(f"{target}: routed_experts is not a base64 .npy array ({exc})") from None
    if routes.ndim != 3 or len(routes) != rows or routes.dtype.kind not in "iu":
        raise RolloutError(
            f"{target}: routed_experts of shape {routes.shape} and dtype {routes.dtype}; expected integer "
            f"experts of {rows} tokens (prompt and completion from the routes start, but the last token) "
            "x moe_layers x top_k"
        )
    if routes.size and (routes.min() < 0 or routes.max() >= num_experts):
        raise RolloutError(
            f"{target}: routed_experts names experts {int(routes.min())}..{int(routes.max())}; the policy has {num_experts}"
        )
    return routes.astype(route_dtype(num_experts), copy=False)


def _prompt_scores(
    choice: _Choice, prompt_ids: list[int], k: int, target: str
) -> tuple[list[float], np.ndarray | None, np.ndarray | None]:
    """The log-probability of each prompt token (nan for the first, which has no context), and
    with `k` > 0 the top k at each position (inference/prompt_logprobs.py `top_k`); a
    RolloutError naming `target` and the position when the reply does not hold them."""
    entries = choice.prompt_logprobs
    if entries is None:
        raise RolloutError(f"{target}: asked for prompt_logprobs of {len(prompt_ids)} tokens, got none")
    try:
        return token_logprobs(entries, prompt_ids), *(top_k(entries, k) if k > 0 else (None, None))
    except ValueError as exc:
        raise RolloutError(f"{target}: {exc}") from None


@dataclass
class TokenTrajectory:
    """The exact token sequence of one (multi-turn) rollout: prompt, then completions and
    observations in order. `loss_mask` is True on completion tokens only; `logprobs` holds the
    sampler's log-probability on completion tokens and 0 elsewhere."""

    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    policy_versions: list[int] = field(default_factory=list)  # of every completion's parts
    token_versions: list[int] = field(default_factory=list)  # per token; -1 off the completions
    finish_reason: str = ""
    observation_spans: list[tuple[int, int]] = field(default_factory=list)  # [start, end) of each
    route_chunks: list[np.ndarray] = field(default_factory=list)  # each completion's routes, in order
    routed_tokens: int = 0  # the positions 0..routed_tokens - 1 have routes (the next request's start)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_ids)
            self.loss_mask = [False] * len(self.prompt_ids)
            self.logprobs = [0.0] * len(self.prompt_ids)
            self.token_versions = [-1] * len(self.prompt_ids)

    def add_completion(self, completion: Completion) -> None:
        versions = completion.versions()
        self.token_ids += completion.token_ids
        self.loss_mask += [True] * len(completion.token_ids)
        self.logprobs += completion.logprobs
        self.token_versions += versions
        self.policy_versions += sorted(set(versions)) or [completion.policy_version]
        self.finish_reason = completion.finish_reason
        if completion.routes is not None:
            self.route_chunks.append(completion.routes)
            self.routed_tokens += len(completion.routes)

    def routes(self) -> np.ndarray | None:
        """[routed_tokens, moe_layers, top_k]: the routes of every token but the last, or None
        when the completions carried none."""
        return np.concatenate(self.route_chunks) if self.route_chunks else None

    def add_observation(self, token_ids: list[int]) -> None:
        self.observation_spans.append((len(self.token_ids), len(self.token_ids) + len(token_ids)))
        self.token_ids += [int(t) for t in token_ids]
        self.loss_mask += [False] * len(token_ids)
        self.logprobs += [0.0] * len(token_ids)
        self.token_versions += [-1] * len(token_ids)

    def observation_as_action(self, span: tuple[int, int], logprobs: list[float]) -> None:
        """Ablation (`orchestrator.train_on_observations`): the observation tokens of `span`
        become actions with the sampler's log-probabilities `logprobs` of them."""
        start, end = span
        if len(logprobs) != end - start:
            raise ValueError(f"observation tokens {start}:{end}: {len(logprobs)} log-probabilities")
        self.loss_mask[start:end] = [True] * (end - start)
        self.logprobs[start:end] = [float(x) for x in logprobs]

    @property
    def policy_version(self) -> int:
        """The oldest version that produced any of its tokens."""
        return min(self.policy_versions) if self.policy_versions else -1

    def versions(self) -> np.ndarray:
        """[T] int64: the version that sampled each token; the prompt's and observations' tokens
        (sampled by no policy), and tokens appended without add_completion, get the oldest."""
        missing = len(self.token_ids) - len(self.token_versions)
        versions = np.asarray(self.token_versions + [-1] * missing, dtype=np.int64)
        versions[versions < 0] = max(self.policy_version, 0)
        return versions
