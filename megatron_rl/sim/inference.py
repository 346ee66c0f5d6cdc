"""The inference servers' stand-in of the simulated cluster (megatron_rl/sim/cluster.py): the
rollout client's place, `SimInference.complete`, over `Server`s that spend simulated time.

A request: the router's session hash picks a server (a resumed part goes to the same one, as the
router's consistent hash sends it); at most `concurrency_per_server` requests hold a slot, the
rest queue in order. A request prefills its prompt (prompt tokens / prefill rate) and decodes its
completion (tokens / decode rate); its length is drawn from a lognormal seeded by the request's
seed and cut at its budget (finish "length"). The client behaves as path (a)'s: it sends nothing
while a weight update is in progress and stamps each request (each part) with the version the
servers run when it is sent.

A weight update (the policy's broadcast, `SimInference.pause`) pauses every server for its
length; what it does to the requests on them is `inference.update_mode`'s:

- `keep` (vLLM's pause mode keep with clear_cache): a running request is preempted, its KV
  freed; after the pause it prefills again its prompt and the tokens it generated so far (those
  tokens / prefill rate) before decoding on. Queued requests wait. A completion carries one
  version, the one it was sent under.
- `interrupt` (mode abort): a running request ends with the tokens decoded so far (whole
  tokens of its elapsed decode time); a queued one ends with none. The client resends each,
  once the new version is live, with the prompt and the tokens so far as its prompt and the
  rest of its budget (the same re-prefill), and joins the parts as RolloutClient does: each
  token with the version that sampled it (`token_versions`), `interruptions`,
  `reprefilled_tokens`, `policy_version` the oldest.

Accounting, per server: `busy_s` is the time at least one request was generating (its first
prefill or decoding), `slot_s` requests generating x time; neither counts a pause nor a
re-prefill of tokens whose KV an update dropped. `reprefilled_tokens` counts those tokens, by
the version whose update dropped them.
"""

from __future__ import annotations

import asyncio
import zlib
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from megatron_rl.data.types import padding_routes, route_dtype
from megatron_rl.inference.rollout import Completion, joined_parts
from megatron_rl.sim.models import group_of

GENERATE, REPREFILL = "generate", "reprefill"


def _now() -> float:
    return asyncio.get_running_loop().time()


def _wake(future: asyncio.Future, paused: bool) -> None:
    if not future.done():
        future.set_result(paused)


class Server:
    """One inference server: its slots and queue, pauses for weight updates, and time integrals
    of the requests generating on it."""

    def __init__(self, index: int, concurrency: int):
        self.index, self.free = index, concurrency
        self.waiting: deque[asyncio.Future] = deque()  # queued requests, in order
        self.paused_until = float("-inf")
        # The work segments running now, in order (a set would order them by id: not reproducible).
        self._working: dict[asyncio.Future, None] = {}
        self.generating, self.reprefilling, self.since = 0, 0, 0.0
        self.busy_s = 0.0  # time with at least one request generating
        self.slot_s = 0.0  # requests generating x time
        self.reprefill_s = 0.0  # time with at least one request re-prefilling

    def account(self) -> None:
        """Brings the time integrals up to now."""
        now = _now()
        if self.generating:
            self.busy_s += now - self.since
            self.slot_s += self.generating * (now - self.since)
        if self.reprefilling:
            self.reprefill_s += now - self.since
        self.since = now

    def pause(self, end: float, abort_queued: bool) -> None:
        """A weight update from now to `end`: every running work segment stops now; with
        `abort_queued` the queued requests end too (acquire returns False)."""
        self.paused_until = end
        for future in list(self._working):
            _wake(future, True)
        while abort_queued and self.waiting:
            _wake(self.waiting.popleft(), False)

    async def wait_unpaused(self) -> None:
        while _now() < self.paused_until:
            await asyncio.sleep(self.paused_until - _now())

    async def acquire(self) -> bool:
        """Takes a slot, queueing in order; False when an update aborted the request queued."""
        if self.free > 0 and not self.waiting:
            self.free -= 1
            return True
        future = asyncio.get_running_loop().create_future()
        self.waiting.append(future)
        try:
            return await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled() and future.result():
                self.release()  # handed a slot as it was cancelled
            elif future in self.waiting:
                self.waiting.remove(future)
            raise

    def release(self) -> None:
        self.free += 1
        while self.free > 0 and self.waiting:
            future = self.waiting.popleft()
            if not future.done():
                self.free -= 1
                future.set_result(True)

    async def work(self, seconds: float, kind: str) -> tuple[float, bool]:
        """`seconds` of `kind` (GENERATE or REPREFILL) work unless an update pauses the server
        first; returns (seconds done, whether a pause stopped it)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        timer = loop.call_later(seconds, _wake, future, False)
        self._working[future] = None
        self.account()
        began = loop.time()
        if kind == GENERATE:
            self.generating += 1
        else:
            self.reprefilling += 1
        try:
            paused = await future
        finally:
            timer.cancel()
            self._working.pop(future, None)
            self.account()
            if kind == GENERATE:
                self.generating -= 1
            else:
                self.reprefilling -= 1
        return loop.time() - began, paused


@dataclass
class _Request:
    """One completion's progress across preemptions and parts (token counts)."""

    prompt: int
    total: int  # the completion's length
    done: int = 0  # tokens decoded so far
    computed: float = 0.0  # tokens of prompt + completion whose KV was computed at some point
    chunks: list[tuple[int, int]] = field(default_factory=list)  # (tokens, version that decoded them)


@dataclass
class Update:
    """One weight update: the servers pause over [start, end); `version` is live from `end`."""

    start: float
    end: float
    version: int


class SimInference:
    """The rollout client's stand-in (`complete`, like RolloutClient's), over `num_servers`
    servers; `update_mode` is `inference.update_mode` ("keep" or "interrupt")."""

    def __init__(self, cluster, num_servers: int, update_mode: str):
        if update_mode not in ("keep", "interrupt"):
            raise ValueError(f"inference.update_mode: 'keep' or 'interrupt', got {update_mode!r}")
        self.cluster, self.interrupt = cluster, update_mode == "interrupt"
        self.servers = [Server(k, cluster.model.concurrency_per_server) for k in range(num_servers)]
        self.updates: list[Update] = []
        self.completion_tokens: list[int] = []
        self.reprefilled_tokens: dict[int, float] = {}  # update's version -> tokens prefilled again
        self.tokens_by_group: dict[int, int] = {}  # completion tokens of each group's finished members
        self.true_span_by_group: dict[int, int] = {}  # newest - oldest version that decoded its tokens
        # Every part a server ran: (group, version stamped, first decode s, last decode s, tokens)
        self.parts: list[tuple[int, int, float, float, int]] = []

    def version_at(self, time: float) -> int:
        """The version the servers run at `time` (the newest whose update ended by then)."""
        return max((u.version for u in self.updates if u.end <= time), default=0)

    def pause(self, start: float, seconds: float, version: int) -> None:
        """A weight update installing `version`: every server pauses from `start` (now) for
        `seconds`."""
        self.updates.append(Update(start, start + seconds, version))
        for server in self.servers:
            server.pause(start + seconds, abort_queued=self.interrupt)

    async def complete(
        self, prompt_ids, sampling, session_id, max_tokens=None, seed=None, stop=None, routes_start=0
    ):
        m, c = self.cluster.model, self.cluster
        limit = max_tokens or sampling.max_tokens
        with c.ledger:
            draw = seed if seed is not None else zlib.crc32(session_id.encode())
            rng = np.random.default_rng([c.seed, draw])
            n = int(
                max(
                    m.completion_min_tokens,
                    rng.lognormal(np.log(m.completion_median_tokens), m.completion_sigma),
                )
            )
            n = min(n, limit)
            server = self.servers[zlib.crc32(session_id.encode()) % len(self.servers)]
        group = group_of(prompt_ids)
        c.event("request", group, server.index)
        request = _Request(len(prompt_ids), n)
        parts = []  # (tokens, version) of each part
        while True:
            await server.wait_unpaused()  # the client sends nothing while an update is in progress
            version, before = self.version_at(_now()), request.done
            finished = False
            if await server.acquire():
                try:
                    finished = await self._run(server, request, group, version)
                finally:
                    server.release()
            parts.append((request.done - before, version))
            if finished or not self.interrupt:
                break
        with c.ledger:
            tokens = rng.integers(1, c.vocab_size, n).tolist()
            logprobs = (-3.0 * rng.random(n)).tolist()
            self.completion_tokens.append(n)
            self.tokens_by_group[group] = self.tokens_by_group.get(group, 0) + n
            decoded_by = [v for tokens_of, v in request.chunks if tokens_of]
            span = max(decoded_by) - min(decoded_by) if decoded_by else 0
            self.true_span_by_group[group] = max(span, self.true_span_by_group.get(group, 0))
            routes = None
            if sampling.routed_experts:  # what vLLM returns under routing replay: its size, not its choice
                arch = c.resolved.layout.policy_architecture
                routes = padding_routes(len(prompt_ids) + n - 1 - routes_start, arch.num_layers,
                                        arch.num_experts_per_tok, route_dtype(sampling.routed_experts))  # fmt: skip
            finish = "length" if n >= limit else "stop"
            worker = f"sim-server-{server.index}"
            if len(parts) == 1:
                return Completion(
                    tokens, logprobs, finish, policy_version=parts[0][1], worker=worker, routes=routes
                )
            pieces, start = [], 0
            for count, version in parts:  # the parts as RolloutClient receives them, joined as it joins them
                pieces.append(Completion(tokens[start:start + count], logprobs[start:start + count], "abort",
                                         policy_version=version, worker=worker))  # fmt: skip
                start += count
            pieces[-1].finish_reason = finish
            joined = joined_parts(pieces, len(prompt_ids))
            joined.routes = routes
            return joined

    async def _run(self, server: Server, request: _Request, group: int, version: int) -> bool:
        """Runs `request` on `server` (holding a slot) from where it is: prefill what its KV
        lacks, then decode. Under keep a pause preempts it (KV dropped; after the pause it
        prefills again); under interrupt a pause ends the part. Returns True once every token is
        decoded, False when interrupted."""
        m = self.cluster.model
        cached = 0.0  # tokens in the KV cache now
        first_decode = None
        while True:
            await server.wait_unpaused()
            context = request.prompt + request.done
            again = max(0.0, min(context, request.computed) - cached)  # dropped by an update
            fresh = context - cached - again
            stopped = False
            for tokens, kind in ((again, REPREFILL), (fresh, GENERATE)):
                if tokens <= 0:
                    continue
                elapsed, paused = await server.work(tokens / m.prefill_tokens_per_s, kind)
                progress = min(tokens, elapsed * m.prefill_tokens_per_s)
                if kind == REPREFILL:
                    update = self.version_at(_now() - elapsed)
                    self.reprefilled_tokens[update] = self.reprefilled_tokens.get(update, 0.0) + progress
                request.computed = max(request.computed, cached + progress)
                if paused and progress < tokens - 1e-6:
                    stopped = True
                    break
                cached += tokens
            if not stopped:
                remaining = request.total - request.done
                decoding_since = _now()
                elapsed, paused = await server.work(remaining / m.decode_tokens_per_s, GENERATE)
                decoded = remaining if not paused else int(elapsed * m.decode_tokens_per_s + 1e-6)
                decoded = min(remaining, decoded)
                if decoded:
                    first_decode = decoding_since if first_decode is None else first_decode
                    request.chunks.append((decoded, self.version_at(decoding_since)))
                request.done += decoded
                request.computed = max(request.computed, request.prompt + request.done)
                if request.done >= request.total:
                    break
            cached = 0.0  # preempted: vLLM freed its KV
            if self.interrupt:
                break
        if first_decode is not None and self.interrupt:
            self.parts.append((group, version, first_decode, _now(), request.chunks[-1][0]))
        return request.done >= request.total
