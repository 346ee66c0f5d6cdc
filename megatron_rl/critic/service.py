"""The critic's HTTP scoring service (aiohttp, on critic rank 0, in a background thread), and
what it shares with the Megatron teacher's (megatron_rl/teacher/service.py): request parsing,
the queue of waiting requests, answering merged requests with their own rows, the state /status
serves, and the aiohttp app (`ModelService`: its endpoint, /status, /health, the bearer token,
timeouts and failures; a subclass writes the reply).

Endpoints (docs/critic-api.md):
    POST /score   {"batched_token_ids": [[int, ...], ...]}
                  -> {"values": [[float, ...], ...], "bootstrap_values": [float, ...], "step": int}
                  with "Accept: application/x-float32-values": float32 bytes (critic/wire.py)
                  legacy {"token_ids": [int, ...]}
                  -> {"values": [float, ...], "bootstrap_value": float, "step": int}
    GET  /status  last trained step, busy flag, phase, counters, model and layout
    GET  /health  {"ok": true}

Requests are validated here, in the service thread, before anything reaches the critic ranks:
a bad request gets 400 and a message and never touches the collective. Valid requests wait in a
queue; the critic's main loop (worker.py) takes every queued request at once (up to
`value.service.max_batch_sequences` sequences), scores them in one collective pass and answers
each request with exactly its own rows, so concurrent requests may be merged but never mixed up.
`step` in a reply is the last critic step trained when the request was scored (-1 before any).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import logging
import threading
from collections import deque
from dataclasses import dataclass, field

import msgspec
import numpy as np
from aiohttp import web

from megatron_rl.critic.wire import BINARY_VALUES, STEP_HEADER, encode_values
from megatron_rl.data.types import ScoreResult

log = logging.getLogger("megatron_rl.critic.service")


class BadRequest(ValueError):
    """A scoring request that does not satisfy the contract (answered with HTTP 400)."""


class ScoreRequest(msgspec.Struct, forbid_unknown_fields=True):
    """The /score body: `batched_token_ids` (one list of token ids per sequence), or the legacy
    single sequence `token_ids`; exactly one of them."""

    batched_token_ids: list[list[int]] | None = None
    token_ids: list[int] | None = None


def _check_tokens(ids: list[int], what: str, vocab_size: int, seq_len: int, who: str) -> None:
    if not ids:
        raise BadRequest(f"{what} is empty")
    if len(ids) > seq_len:
        raise BadRequest(f"{what} has {len(ids)} tokens; the {who}'s seq_len is {seq_len}")
    low, high = min(ids), max(ids)
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise BadRequest(f"{what} holds token id {bad} outside the vocabulary 0..{vocab_size - 1}")


def decode_request(body: bytes, request_type: type):
    """`body` decoded as the msgspec Struct `request_type`, or BadRequest naming what is wrong
    (with its JSON path, e.g. "Expected `int`, got `float` - at `$.batched_token_ids[0][1]`")."""
    try:
        return msgspec.json.decode(body, type=request_type)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"invalid request: {exc}") from None
    except msgspec.DecodeError as exc:
        raise BadRequest(f"malformed JSON: {exc}") from None


def check_batch(batch: list[list[int]], vocab_size: int, seq_len: int, max_batch_sequences: int, who: str,
                limit_key: str) -> None:  # fmt: skip
    """BadRequest unless `batch` holds 1..max_batch_sequences sequences of 1..seq_len ids in the
    vocabulary; `who` and `limit_key` name the service in messages."""
    if not batch:
        raise BadRequest("batched_token_ids is empty")
    if len(batch) > max_batch_sequences:
        raise BadRequest(
            f"batched_token_ids has {len(batch)} sequences; this {who} takes at most "
            f"{max_batch_sequences} per request ({limit_key})"
        )
    for i, ids in enumerate(batch):
        _check_tokens(ids, f"batched_token_ids[{i}]", vocab_size, seq_len, who)


def parse_score_request(
    body: bytes,
    vocab_size: int,
    seq_len: int,
    max_batch_sequences: int,
    who: str = "critic",
    limit_key: str = "value.service.max_batch_sequences",
) -> tuple[list[list[int]], bool]:
    """(sequences, legacy) of a /score body, or BadRequest naming what is wrong (with its JSON
    path). `who` and `limit_key` name the service in messages."""
    request = decode_request(body, ScoreRequest)
    if (request.batched_token_ids is None) == (request.token_ids is None):
        raise BadRequest("expected exactly one key, 'batched_token_ids' or 'token_ids' (legacy)")
    if request.token_ids is not None:
        _check_tokens(request.token_ids, "token_ids", vocab_size, seq_len, who)
        return [request.token_ids], True
    check_batch(request.batched_token_ids, vocab_size, seq_len, max_batch_sequences, who, limit_key)
    return request.batched_token_ids, False


@dataclass
class PendingRequest:
    """A valid request waiting for the service's ranks. `option`: the one integer parameter of
    the request that the scoring pass reads (the teacher's `top_k`; always 0 for the critic)."""

    sequences: list[list[int]]
    option: int = 0
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


class ScoreQueue:
    """Valid requests waiting for the critic ranks (thread-safe). Requests merge into one pass only
    with requests of the same `option` (one pass computes one kind of output)."""

    def __init__(self):
        self._items: deque[PendingRequest] = deque()
        self._ready = threading.Condition()

    def submit(self, sequences: list[list[int]], option: int = 0) -> concurrent.futures.Future:
        item = PendingRequest(sequences, option)
        with self._ready:
            self._items.append(item)
            self._ready.notify_all()
        return item.future

    def __len__(self) -> int:
        with self._ready:
            return len(self._items)

    def wait(self, timeout_s: float) -> bool:
        """True when a request is waiting (returns at once if one is)."""
        with self._ready:
            return bool(self._items) or self._ready.wait_for(lambda: bool(self._items), timeout=timeout_s)

    def take(self, max_sequences: int) -> list[PendingRequest]:
        """The oldest waiting requests, as many as fit in `max_sequences` (at least one), up to
        the first of another `option` than the oldest's."""
        taken, total = [], 0
        with self._ready:
            while self._items and (
                not taken
                or (total + len(self._items[0].sequences) <= max_sequences and self._items[0].option == taken[0].option)
            ):
                item = self._items.popleft()
                if item.future.set_running_or_notify_cancel():
                    taken.append(item)
                    total += len(item.sequences)
        return taken

    def fail_all(self, exc: BaseException) -> None:
        with self._ready:
            items, self._items = list(self._items), deque()
        for item in items:
            if item.future.set_running_or_notify_cancel():
                item.future.set_exception(exc)


def score_rows(result: ScoreResult, start: int, end: int) -> ScoreResult:
    """Rows start..end of a merged ScoreResult."""
    return ScoreResult(
        values=result.values[start:end], bootstrap_values=result.bootstrap_values[start:end], step=result.step
    )


def answer(requests: list[PendingRequest], result, rows=score_rows) -> None:
    """Hands each request its own rows of a merged result (`rows(result, start, end)`; a list's
    slice for a list of rows), in its own order."""
    start = 0
    for item in requests:
        end = start + len(item.sequences)
        item.future.set_result(rows(result, start, end))
        start = end


class ScoringFailed(RuntimeError):
    """Scoring a merged batch raised on some rank of the service: its requests get HTTP 500 (the
    ranks agreed on it and keep serving)."""


class ServiceState:
    """What /status reports; written by the service's main loop, read by the service thread."""

    def __init__(self, info: dict):
        self._lock = threading.Lock()
        self._state = {
            "busy": False,
            "phase": "starting",
            "scoring_passes": 0,  # collective passes, each over the requests merged into it
            "requests_scored": 0,
            "sequences_scored": 0,
            "tokens_scored": 0,
            **info,
        }

    def update(self, **changes) -> None:
        with self._lock:
            self._state.update(changes)

    def add(self, **increments) -> None:
        with self._lock:
            for key, value in increments.items():
                self._state[key] += value

    def snapshot(self) -> dict:
        with self._lock:
            return dict(self._state)


class CriticState(ServiceState):
    """The critic's /status: the service's counters plus the last step trained and pretrained."""

    def __init__(self, info: dict):
        super().__init__({"trained_step": -1, "pretrain_step": -1, **info})


class ModelService:
    """The aiohttp app in its own thread; `start()` returns once it listens. A subclass names its
    endpoint and config section, reads its request body (`parse`: the critic's by default) and
    writes the reply of a scored request (`reply`)."""

    name = "critic"  # in messages and the thread's name
    path = "/score"
    key = "value.service"  # the config section of the limits named in messages
    token_key = "value.service.token_env"

    def __init__(
        self,
        host: str,
        port: int,
        queue: ScoreQueue,
        state: CriticState,
        vocab_size: int,
        seq_len: int,
        max_batch_sequences: int,
        request_timeout_s: float,
        token: str | None = None,
    ):
        self.token = token
        self.host, self.port = host, port
        self.queue, self.state = queue, state
        self.vocab_size, self.seq_len = vocab_size, seq_len
        self.max_batch_sequences = max_batch_sequences
        self.request_timeout_s = request_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None

    @property
    def max_body_bytes(self) -> int:
        """Room for the largest valid request: every token id up to 7 digits plus ", ", and 1 MiB."""
        return self.max_batch_sequences * self.seq_len * 9 + (1 << 20)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # -- handlers -------------------------------------------------------------------------------
    @property
    def _authorize(self):
        expected = f"Bearer {self.token}".encode() if self.token else None

        @web.middleware
        async def authorize(request, handler):
            if expected is not None:
                given = request.headers.get("Authorization", "").encode()
                if not hmac.compare_digest(given, expected):
                    return web.json_response(
                        {"error": f"missing or wrong 'Authorization: Bearer' token ({self.token_key})"},
                        status=401,
                    )
            return await handler(request)

        return authorize

    async def _score(self, request):

        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return web.json_response(
                {"error": f"request body of {request.content_length} bytes is over this {self.name}'s limit of "
                 f"{self.max_body_bytes} bytes (room for {self.key}.max_batch_sequences "
                 f"{self.max_batch_sequences} sequences of seq_len {self.seq_len} tokens): split it"},
                status=413,
            )  # fmt: skip
        try:
            sequences, legacy, option = self.parse(body)
        except BadRequest as exc:
            return web.json_response({"error": str(exc)}, status=400)
        future = self.queue.submit(sequences, option)
        try:
            result = await asyncio.wait_for(asyncio.wrap_future(future), timeout=self.request_timeout_s)
        except TimeoutError:
            future.cancel()
            return web.json_response(
                {"error": f"not scored within {self.request_timeout_s}s ({self.key}.request_timeout_s)"},
                status=504,
            )
        except Exception as exc:
            if isinstance(exc, ScoringFailed):  # this request's batch raised: not worth a retry
                return web.json_response({"error": str(exc)}, status=500)
            # the service failed or is shutting down
            return web.json_response({"error": f"scoring failed: {exc}"}, status=503)
        return self.reply(request, result, legacy)

    def parse(self, body: bytes) -> tuple[list[list[int]], bool, int]:
        """(sequences, legacy, option) of a request body (`parse_score_request`; option 0), or
        BadRequest; a service with a request parameter reads it here."""
        sequences, legacy = parse_score_request(
            body, self.vocab_size, self.seq_len, self.max_batch_sequences, self.name, f"{self.key}.max_batch_sequences"
        )  # fmt: skip
        return sequences, legacy, 0

    def reply(self, request, result, legacy: bool) -> web.Response:
        """The HTTP reply of a request scored as `result` (its own rows)."""
        raise NotImplementedError  # abstract: each service defines its reply (ScoringService, teacher/service.py)


    async def _status(self, request):

        state = self.state.snapshot()
        state["queued_requests"] = len(self.queue)
        return web.json_response(state)

    async def _health(self, request):

        return web.json_response({"ok": True})

    # -- lifecycle ------------------------------------------------------------------------------
    def _app(self):
        app = web.Application(client_max_size=self.max_body_bytes, middlewares=[self._authorize])
        app.router.add_post(self.path, self._score)
        app.router.add_get("/status", self._status)
        app.router.add_get("/health", self._health)
        return app

    def _serve(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        try:
            self._runner = web.AppRunner(self._app(), access_log=None)
            loop.run_until_complete(self._runner.setup())
            site = web.TCPSite(self._runner, self.host, self.port, reuse_address=True)
            loop.run_until_complete(site.start())
        except BaseException as exc:
            self._error = exc
            self._started.set()
            return
        self._started.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(self._runner.cleanup())
            loop.close()

    def start(self, timeout_s: float = 60.0) -> None:
        self._thread = threading.Thread(target=self._serve, name=f"{self.name}-service", daemon=True)
        self._thread.start()
        if not self._started.wait(timeout_s):
            raise RuntimeError(f"{self.name} service on {self.url} did not start within {timeout_s}s")
        if self._error is not None:
            raise RuntimeError(f"{self.name} service cannot listen on {self.url}: {self._error}") from self._error
        log.info("%s service listening on %s", self.name, self.url)

    def stop(self) -> None:
        self.queue.fail_all(RuntimeError(f"the {self.name} is shutting down"))
        if self._loop is not None and self._thread is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)


class ScoringService(ModelService):
    """The critic's service: POST /score answered with values and bootstrap values."""

    def reply(self, request, result: ScoreResult, legacy: bool) -> web.Response:
        if not legacy and BINARY_VALUES in request.headers.get("Accept", ""):
            return web.Response(
                body=encode_values(result), content_type=BINARY_VALUES, headers={STEP_HEADER: str(result.step)}
            )
        if legacy:
            reply = {
                "values": np.asarray(result.values[0]).tolist(),
                "bootstrap_value": float(result.bootstrap_values[0]),
                "step": result.step,
            }
        else:
            reply = {
                "values": [np.asarray(v).tolist() for v in result.values],
                "bootstrap_values": [float(b) for b in result.bootstrap_values],
                "step": result.step,
            }
        return web.Response(body=msgspec.json.encode(reply), content_type="application/json")
