"""MegatronTeacher: the orchestrator's TeacherScorer over the Megatron teacher's service.

`await teacher.logprobs(batched_token_ids)` splits the sequences into requests of at most
`max_batch_sequences` (`distillation.teacher.megatron.max_batch_sequences`, the service's
limit), sends up to `max_concurrent` of them at once as `POST /logprobs` asking for the binary
reply (critic/wire.py `encode_rows`: 4 bytes a token), and returns one float32 [T] array per
sequence in request order, nan at position 0; `await teacher.top_k(batched_token_ids, k)` the
same with `"top_k": k` (binary reply critic/wire.py `encode_top_k`: 4 (1 + 2k) bytes a token),
one TeacherTopK a sequence. What the critic's client does for it
(critic/client.py `ServiceClient`): connection failures and 503 replies retried with exponential
backoff (`retries`), `timeout_s` a request (TeacherTimeout), a 400 as TeacherRequestError with
the service's message, every error naming the URL. `check_ready` waits for /health (the teacher
may still be loading its weights when the orchestrator starts). `make_teacher(resolved, url)`
is the orchestrator's choice of teacher client: this one with `distillation.teacher.megatron`,
else `VllmTeacher`.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import msgspec
import numpy as np

from megatron_rl.critic.client import ServiceClient
from megatron_rl.critic.wire import BINARY_LOGPROBS, BINARY_TOP_K, decode_rows, decode_top_k
from megatron_rl.data.types import TeacherTopK
from megatron_rl.inference.teacher import TeacherError, TeacherRequestError, TeacherTimeout, VllmTeacher


class MegatronTeacher(ServiceClient):
    what = "teacher service"
    error = TeacherError
    timeout_error = TeacherTimeout
    request_error = TeacherRequestError

    def __init__(self, url: str, timeout_s: float = 600.0, max_concurrent: int = 64, max_batch_sequences: int = 512,
                 token: str | None = None, **options):  # fmt: skip
        super().__init__(url, timeout_s=timeout_s, token=token, **options)
        self.max_concurrent, self.max_batch_sequences = max_concurrent, max_batch_sequences
        self._bound: asyncio.Semaphore | None = None
        self._bound_loop = None
        self.requests = 0

    async def _one(self, batch: list[list[int]], k: int) -> list:
        body = msgspec.json.encode({"batched_token_ids": batch, **({"top_k": k} if k else {})})
        async with self._bound:
            reply = await self._request("POST", "/logprobs", body, accept=BINARY_TOP_K if k else BINARY_LOGPROBS)
        self.requests += 1
        lengths = [len(ids) for ids in batch]
        try:
            if isinstance(reply, httpx.Response):
                return decode_top_k(reply.content, lengths, k) if k else decode_rows(reply.content, lengths)
            rows = [_floats(row) for row in reply["logprobs"]]
            if [len(r) for r in rows] != lengths:
                raise ValueError(f"row lengths {[len(r) for r in rows]} for sequences of {lengths} tokens")
            if not k:
                return rows
            return [TeacherTopK(logprobs=row, top_ids=np.array(ids, dtype=np.int32).reshape(len(row), k),
                                top_logprobs=_floats(top).reshape(len(row), k))
                    for row, ids, top in zip(rows, reply["top_ids"], reply["top_logprobs"], strict=True)]  # fmt: skip
        except (KeyError, TypeError, ValueError) as exc:
            raise TeacherError(f"{self.url}/logprobs: reply does not follow the contract: {exc}") from None

    async def _split(self, batched_token_ids: list[list[int]], k: int) -> list:
        """Requests of at most max_batch_sequences, up to max_concurrent at once; replies in order."""
        loop = asyncio.get_running_loop()
        if self._bound is None or self._bound_loop is not loop:
            self._bound, self._bound_loop = asyncio.Semaphore(self.max_concurrent), loop
        batch = [list(map(int, ids)) for ids in batched_token_ids]
        size = self.max_batch_sequences
        parts = await asyncio.gather(*[self._one(batch[i : i + size], k) for i in range(0, len(batch), size)])
        return [row for part in parts for row in part]

    async def logprobs(self, batched_token_ids: list[list[int]]) -> list[np.ndarray]:
        """[T] float32 per sequence: log p_teacher(token_t | tokens before it), nan at 0."""
        return await self._split(batched_token_ids, 0)

    async def top_k(self, batched_token_ids: list[list[int]], k: int) -> list[TeacherTopK]:
        """A TeacherTopK per sequence: its log-probabilities as `logprobs`, and at every position
        the teacher's `k` most likely next tokens ([T, k] int32, most likely first; row 0: 0) and
        their log-probabilities ([T, k] float32; row 0: nan), from one forward (binary reply)."""
        if int(k) != k or k < 1:
            raise ValueError(f"MegatronTeacher.top_k: k must be an integer >= 1, not {k!r}")
        return await self._split(batched_token_ids, int(k))

    async def check_ready(self, timeout_s: float | None = None, poll_s: float = 0.5) -> dict:
        """Waits until the service answers /health (at most `timeout_s`, default the request
        timeout); returns its /status; a TeacherError naming the URL if it never does."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        while not await self.health():
            if time.monotonic() > deadline:
                raise TeacherError(f"the teacher service at {self.url} (distillation.teacher.megatron) did not answer "
                                   f"/health within {timeout_s:.0f}s")  # fmt: skip
            await asyncio.sleep(poll_s)
        return await self.status()


def _floats(values) -> np.ndarray:
    """A JSON list of floats (null: nan) as float32, any nesting."""
    return np.array(values, dtype=object).astype(float).astype(np.float32) if values else np.empty(0, np.float32)


def make_teacher(resolved, service_url: str | None):
    """The TeacherScorer of `distillation.teacher`: `MegatronTeacher` at the run's Megatron
    teacher service (`megatron`), else `VllmTeacher` at `url` or at the router of the vLLM
    teacher the run serves (`service_url`)."""
    settings = resolved.distillation.teacher
    if settings.megatron is not None:
        return MegatronTeacher(service_url, timeout_s=settings.timeout_s, max_concurrent=settings.max_concurrent,
                               max_batch_sequences=settings.megatron.max_batch_sequences, token=settings.api_key())  # fmt: skip
    return VllmTeacher(settings.url or service_url, settings.served_model_name, settings.api_key(), settings.timeout_s,
                       settings.max_concurrent)  # fmt: skip
