"""HttpValueScorer: the ValueScorer the orchestrator uses, over the critic's HTTP service; its
base `ServiceClient` is the Megatron teacher's client's too (teacher/client.py).

`await scorer.score(batched_token_ids)` sends one `POST /score` and returns a ScoreResult in
request order (asking for the binary reply of critic/wire.py: 4 bytes a value, not ~20 of JSON). Connection failures (critic still starting, restarting, or briefly unreachable)
and 503 replies are retried (httpx, the package's one HTTP client library) with exponential backoff up to `retries` times; a request that
takes longer than `timeout_s` raises CriticTimeout; a 400 raises CriticRequestError with the
critic's message. Every error names the URL. `transport` (an httpx transport) replaces the
network, e.g. by the simulated critic of megatron_rl/sim/cluster.py.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import msgspec
import numpy as np

from megatron_rl.critic.wire import BINARY_VALUES, STEP_HEADER, decode_values
from megatron_rl.data.types import ScoreResult


class CriticError(RuntimeError):
    """The critic could not be reached or answered unexpectedly."""


class CriticTimeout(CriticError):
    pass


class CriticRequestError(CriticError, ValueError):
    """The critic refused the request (HTTP 400)."""


class ServiceClient:
    """An HTTP client of a model service (the critic's, the Megatron teacher's): retries of
    connection failures and 503 replies with exponential backoff, timeouts, errors that name the
    URL as `what` and raise the subclass's error types; /status and /health."""

    what = "critic service"
    error: type[Exception] = CriticError
    timeout_error: type[Exception] = CriticTimeout
    request_error: type[Exception] = CriticRequestError

    def __init__(
        self,
        url: str,
        timeout_s: float = 600.0,
        connect_timeout_s: float = 10.0,
        retries: int = 8,
        backoff_s: float = 0.25,
        max_backoff_s: float = 8.0,
        token: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ):
        self.url = url.rstrip("/")
        self.transport = transport
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._http = None
        self._http_loop = None

    def _client(self):
        """One httpx.AsyncClient per event loop (a client cannot cross loops)."""
        loop = asyncio.get_running_loop()
        if self._http is None or self._http.is_closed or self._http_loop is not loop:
            self._http = httpx.AsyncClient(
                timeout=httpx.Timeout(self.timeout_s, connect=self.connect_timeout_s),
                transport=self.transport,
            )
            self._http_loop = loop
        return self._http

    async def close(self) -> None:
        if self._http is not None and not self._http.is_closed:
            await self._http.aclose()
        self._http = None

    async def _request(self, method: str, path: str, body: bytes | None = None, accept: str | None = None):
        """The reply (its JSON decoded, or the httpx response when it came as `accept`)."""
        url = f"{self.url}{path}"
        delay = self.backoff_s
        headers = {**self.headers, **({"Content-Type": "application/json"} if body else {})}
        if accept:
            headers["Accept"] = accept
        for attempt in range(self.retries + 1):
            try:
                response = await self._client().request(method, url, content=body, headers=headers)
            except httpx.TimeoutException:
                raise self.timeout_error(f"{self.what} {url}: no reply within {self.timeout_s}s") from None
            except httpx.TransportError as exc:
                if attempt == self.retries:
                    raise self.error(
                        f"{self.what} {url}: unreachable after {self.retries + 1} attempts: {type(exc).__name__}: {exc}"
                    ) from exc
            else:
                payload = response.content
                if response.status_code == 200:
                    if accept and response.headers.get("Content-Type", "").startswith(accept):
                        return response
                    try:
                        return msgspec.json.decode(payload)
                    except msgspec.DecodeError:
                        raise self.error(f"{self.what} {url}: reply is not JSON: {payload[:200]!r}") from None
                message = _error_message(payload)
                if response.status_code == 400:
                    raise self.request_error(f"{self.what} {url}: request refused (400): {message}")
                if response.status_code != 503 or attempt == self.retries:
                    raise self.error(f"{self.what} {url}: HTTP {response.status_code}: {message}")
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.max_backoff_s)
        raise AssertionError("unreachable")

    async def status(self) -> dict:
        return await self._request("GET", "/status")

    async def health(self) -> bool:
        try:
            return bool((await self._request("GET", "/health")).get("ok"))
        except self.error:
            return False


class HttpValueScorer(ServiceClient):
    """The orchestrator's ValueScorer over the critic's /score."""

    async def score(self, batched_token_ids: list[list[int]]) -> ScoreResult:
        """Asks for the binary reply (critic/wire.py); a critic that answers JSON is read too."""
        reply = await self._request(
            "POST", "/score", msgspec.json.encode({"batched_token_ids": batched_token_ids}), accept=BINARY_VALUES
        )
        if isinstance(reply, httpx.Response):
            try:
                step = int(reply.headers[STEP_HEADER])
                return decode_values(reply.content, [len(ids) for ids in batched_token_ids], step)
            except (KeyError, ValueError) as exc:
                raise CriticError(f"{self.url}/score: binary reply does not follow the contract: {exc}") from None
        try:
            values = [np.asarray(v, dtype=np.float32) for v in reply["values"]]
            bootstrap = [float(b) for b in reply["bootstrap_values"]]
            step = int(reply["step"])
        except (KeyError, TypeError, ValueError) as exc:
            raise CriticError(f"{self.url}/score: reply does not follow the contract: {exc}") from None
        return ScoreResult(values=values, bootstrap_values=bootstrap, step=step)

    async def wait_trained(self, step: int, timeout_s: float = 3600.0, poll_s: float = 0.2) -> dict:
        """Polls /status until the critic reports `step` trained; returns that status."""
        return await self._wait(
            lambda s: s["trained_step"] >= step, f"step {step} trained", timeout_s, poll_s
        )

    async def wait_ready(self, timeout_s: float = 3600.0, poll_s: float = 0.5) -> dict:
        """Polls /status until value pretraining (if any) is over."""
        return await self._wait(lambda s: s["phase"] in ("ready", "finished"), "ready", timeout_s, poll_s)

    async def _wait(self, done, what: str, timeout_s: float, poll_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            status = await self.status()
            if done(status):
                return status
            if time.monotonic() > deadline:
                raise CriticTimeout(
                    f"{self.url}/status: not {what} within {timeout_s}s (last status {status})"
                )
            await asyncio.sleep(poll_s)


def _error_message(payload: bytes) -> str:
    try:
        return str(msgspec.json.decode(payload).get("error", payload[:500]))
    except (msgspec.DecodeError, AttributeError):
        return payload[:500].decode(errors="replace")
