"""GridSender (orchestrator side, one per model) and GridReceiver (one per trainer rank).

Pull-based: a receiver says HELLO, then GETs the step it wants for its data rank and ACKs it
after decoding. The sender serves from a background thread and keeps each step's items until
every receiver of every data rank has acknowledged them, so a receiver that connects late, or
that got a corrupt delivery and asks again, loses nothing. All TP/CP/PP ranks of one data
replica receive the same item. Messages: [kind, msgpack payload, *frames].
"""

from __future__ import annotations

import logging
import queue
import threading
import time

import msgspec
import zmq

from megatron_rl.data.types import Grid, MicroBatch
from megatron_rl.transport.codec import TransportError, TransportTimeout, decode_grid_item, encode_grid_item

log = logging.getLogger(__name__)
_pack, _unpack = msgspec.msgpack.encode, msgspec.msgpack.decode
MAX_REQUEST_BYTES = 64 * 1024  # requests are a few small integers; ZMQ drops larger messages


class _Request(msgspec.Struct, forbid_unknown_fields=True):
    """A receiver's HELLO / GET / ACK payload (GET and ACK name a step)."""

    data_rank: int
    receiver_id: int
    step: int | None = None


class GridSender:
    """Publishes one grid per step; `grid[data_rank]` goes to every receiver of that data rank."""

    def __init__(
        self,
        host: str,
        port: int,
        data_parallel_size: int,
        receivers_per_data_rank: int = 1,
        name: str = "grid",
        max_pending_steps: int = 2,
    ):
        self.endpoint = f"tcp://{host}:{port}"
        self.name = name
        self.dp = data_parallel_size
        self.receivers_per_data_rank = receivers_per_data_rank
        self.max_pending_steps = max_pending_steps
        self._context = zmq.Context.instance()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._socket.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
        self._socket.bind(self.endpoint)
        self._inbox: queue.Queue = queue.Queue()
        self._state = threading.Condition()
        self._items: dict[int, list[list]] = {}  # step -> frames per data rank
        self._acks: dict[int, set[tuple[int, int]]] = {}
        self._receivers: dict[tuple[int, int], bytes] = {}  # (data_rank, receiver_id) -> identity
        self._released: set[int] = set()
        self._waiting: dict[int, list[tuple[bytes, int]]] = {}  # step -> [(identity, data_rank)]
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, name=f"GridSender[{name}]", daemon=True)
        self._thread.start()

    # -- caller side ------------------------------------------------------------------------
    def publish(self, step: int, grid: Grid, timeout_s: float = 600.0) -> None:
        """Queues `grid` for `step`; blocks while `max_pending_steps` steps await delivery."""
        if len(grid) != self.dp:
            raise ValueError(f"{self.name} sender: grid has {len(grid)} data ranks, expected {self.dp}")
        frames = [encode_grid_item(step, rank, micro_batches) for rank, micro_batches in enumerate(grid)]
        deadline = time.monotonic() + timeout_s
        with self._state:
            if step in self._items or step in self._released:
                raise ValueError(f"{self.name} sender: step {step} was already published")
            while len(self._items) >= self.max_pending_steps:
                self._raise_if_failed()
                if not self._state.wait(timeout=max(0.0, deadline - time.monotonic())):
                    raise TransportTimeout(
                        f"{self.endpoint} ({self.name}): step {step} not published: steps "
                        f"{sorted(self._items)} still undelivered after {timeout_s}s"
                    )
            self._items[step] = frames
            self._acks[step] = set()
        self._inbox.put(step)

    def wait_delivered(self, step: int, timeout_s: float = 600.0) -> None:
        """Blocks until every receiver acknowledged `step`; the error names who is missing."""
        deadline = time.monotonic() + timeout_s
        with self._state:
            while step not in self._released:
                self._raise_if_failed()
                if not self._state.wait(timeout=max(0.0, deadline - time.monotonic())):
                    acked = self._acks.get(step, set())
                    missing = [
                        (d, r)
                        for d in range(self.dp)
                        for r in range(self.receivers_per_data_rank)
                        if (d, r) not in acked
                    ]
                    raise TransportTimeout(
                        f"{self.endpoint} ({self.name}): step {step} not acknowledged within {timeout_s}s by "
                        f"(data rank, receiver) {missing[:8]}"
                    )

    def wait_for_receivers(self, timeout_s: float = 120.0) -> None:
        """The readiness handshake: blocks until all dp * receivers_per_data_rank said HELLO."""
        expected = self.dp * self.receivers_per_data_rank
        deadline = time.monotonic() + timeout_s
        with self._state:
            while len(self._receivers) < expected:
                self._raise_if_failed()
                if not self._state.wait(timeout=max(0.0, deadline - time.monotonic())):
                    raise TransportTimeout(
                        f"{self.endpoint} ({self.name}): {len(self._receivers)} of {expected} receivers "
                        f"connected within {timeout_s}s"
                    )

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        with self._state:
            undelivered = sorted(self._items)
        if undelivered:
            log.warning("%s (%s): closing with undelivered steps %s", self.endpoint, self.name, undelivered)
        self._socket.close(linger=0)

    def __enter__(self) -> GridSender:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise TransportError(f"{self.endpoint} ({self.name}): sender thread failed: {self._error}")

    # -- server thread ----------------------------------------------------------------------
    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                while not self._inbox.empty():
                    self._serve_waiting(self._inbox.get())
                if poller.poll(20):
                    message = self._socket.recv_multipart(copy=True)
                    try:
                        self._handle(message)
                    except Exception as exc:  # one bad request never ends the sender
                        peer = message[0].hex() if message else "?"
                        log.warning("%s (%s): request from peer %s dropped: %r", self.endpoint, self.name, peer, exc)
        except BaseException as exc:  # surfaced to callers by _raise_if_failed
            self._error = exc
            with self._state:
                self._state.notify_all()

    def _reply(self, identity: bytes, kind: bytes, payload: dict, frames: list = ()) -> None:
        try:
            self._socket.send_multipart([identity, kind, _pack(payload), *frames], copy=False)
        except zmq.ZMQError as exc:  # the receiver went away; it will ask again when it is back
            log.warning("%s (%s): reply %s not sent: %s", self.endpoint, self.name, kind.decode(), exc)

    def _serve_waiting(self, step: int) -> None:
        for identity, data_rank in self._waiting.pop(step, []):
            self._send_item(identity, step, data_rank)

    def _send_item(self, identity: bytes, step: int, data_rank: int) -> None:
        with self._state:
            frames = self._items.get(step)
        if frames is None:
            self._reply(identity, b"ERROR", {"message": f"step {step} was already delivered and released"})
        else:
            self._reply(identity, b"DATA", {"step": step, "data_rank": data_rank}, frames[data_rank])

    def _handle(self, message: list[bytes]) -> None:
        if len(message) != 3:
            log.warning(
                "%s (%s): ignoring malformed request with %d frames", self.endpoint, self.name, len(message)
            )
            return
        identity, kind, payload = message
        if kind not in (b"HELLO", b"GET", b"ACK"):
            log.warning("%s (%s): unknown request kind %r from peer %s", self.endpoint, self.name, kind[:32],
                        identity.hex())  # fmt: skip
            self._reply(identity, b"ERROR", {"message": f"unknown request kind {kind[:32]!r}"})
            return
        try:
            request = _unpack(payload, type=_Request)
            if kind != b"HELLO" and request.step is None:
                raise ValueError(f"{kind.decode()} without a step")
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
            log.warning("%s (%s): malformed %s request from peer %s: %s", self.endpoint, self.name, kind.decode(),
                        identity.hex(), exc)  # fmt: skip
            self._reply(identity, b"ERROR", {"message": f"malformed {kind.decode()} request: {exc}"})
            return
        data_rank, receiver, step = request.data_rank, request.receiver_id, request.step
        if not (0 <= data_rank < self.dp and 0 <= receiver < self.receivers_per_data_rank):
            self._reply(
                identity,
                b"ERROR",
                {
                    "message": f"data rank {data_rank} / receiver {receiver} outside this sender's layout "
                    f"(dp {self.dp}, {self.receivers_per_data_rank} receivers per data rank)"
                },
            )
            return
        if kind == b"HELLO":
            with self._state:
                self._receivers[(data_rank, receiver)] = identity
                self._state.notify_all()
            self._reply(identity, b"WELCOME", {"name": self.name, "data_parallel_size": self.dp})
        elif kind == b"GET":
            with self._state:
                published = step in self._items or step in self._released
            if published:
                self._send_item(identity, step, data_rank)
            else:
                self._waiting.setdefault(step, []).append((identity, data_rank))
        elif kind == b"ACK":
            with self._state:
                if step in self._acks:
                    self._acks[step].add((data_rank, receiver))
                    if len(self._acks[step]) == self.dp * self.receivers_per_data_rank:
                        del self._items[step], self._acks[step]
                        self._released.add(step)
                self._state.notify_all()


class GridReceiver:
    """Trainer side: fetches this data rank's micro-batches for a step."""

    def __init__(
        self,
        host: str,
        port: int,
        data_rank: int,
        receiver_id: int = 0,
        timeout_s: float = 600.0,
        handshake_timeout_s: float | None = 120.0,
        vocab_size: int | None = None,
        num_experts: int | None = None,
    ):
        """`handshake_timeout_s=None` does not wait for the sender here: the handshake then
        completes inside the first `poll`/`receive` (a critic serves requests before the
        orchestrator's sender exists). With `vocab_size`, a frame with a token id outside the
        vocabulary is refused like any other invalid frame."""
        self.endpoint = f"tcp://{host}:{port}"
        self.vocab_size, self.num_experts = vocab_size, num_experts
        self.data_rank = data_rank
        self.receiver_id = receiver_id
        self.timeout_s = timeout_s
        self._socket = zmq.Context.instance().socket(zmq.DEALER)
        # Give a final ACK time to leave when the receiver closes right after receive().
        self._socket.setsockopt(zmq.LINGER, 2000)
        self._socket.connect(self.endpoint)
        self._who = {"data_rank": data_rank, "receiver_id": receiver_id}
        self.sender_name: str | None = None
        self._pending_step: int | None = None  # a GET sent and not yet answered
        self._socket.send_multipart([b"HELLO", _pack(self._who)])
        if handshake_timeout_s is not None:
            try:
                if not self._finish_handshake(handshake_timeout_s):
                    raise TransportTimeout(
                        f"{self.endpoint}: no answer to handshake for data rank {self.data_rank} "
                        f"within {handshake_timeout_s}s"
                    )
            except BaseException:
                self._socket.close(linger=0)  # drop the queued HELLO: this receiver gave up
                raise

    def _finish_handshake(self, timeout_s: float) -> bool:
        """True once the sender's WELCOME arrived (waits up to `timeout_s`)."""
        if self.sender_name is not None:
            return True
        if not self._socket.poll(int(timeout_s * 1000)):
            return False
        kind, payload, _ = self._read_reply("the handshake")
        if kind != b"WELCOME":
            raise TransportError(f"{self.endpoint}: handshake refused: {payload.get('message', payload)}")
        self.sender_name = payload["name"]
        return True

    def _read_reply(self, what: str):
        """(kind, payload, data frames) of the waiting reply."""
        frames = self._socket.recv_multipart(copy=False)
        try:
            payload = _unpack(frames[1].bytes) if len(frames) > 1 else {}
        except msgspec.DecodeError:
            raise TransportError(f"{self.endpoint}: corrupt reply to {what}") from None
        return frames[0].bytes, payload, frames[2:]

    def receive(self, step: int, timeout_s: float | None = None) -> list[MicroBatch]:
        """This data rank's micro-batches for `step`. A decode error raises TransportError and
        sends no ACK, so the sender keeps the item and `receive(step)` can be called again."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        micro_batches = self.poll(step, timeout_s)
        if micro_batches is None:
            raise TransportTimeout(
                f"{self.endpoint}: no answer to step {step} for data rank {self.data_rank} within {timeout_s}s"
            )
        return micro_batches

    def poll(self, step: int, timeout_s: float = 0.0) -> list[MicroBatch] | None:
        """Like `receive`, but returns None when the step has not arrived within `timeout_s`.
        The request stays open: a later `poll(step)` or `receive(step)` waits for the same
        delivery (asking for a different step meanwhile is an error)."""
        began = time.monotonic()
        if not self._finish_handshake(timeout_s):
            return None
        timeout_s = max(0.0, timeout_s - (time.monotonic() - began))
        if self._pending_step is None:
            self._socket.send_multipart([b"GET", _pack({"step": step, **self._who})])
            self._pending_step = step
        elif self._pending_step != step:
            raise TransportError(
                f"{self.endpoint}: step {step} requested while step {self._pending_step} is still awaited"
            )
        if not self._socket.poll(int(timeout_s * 1000)):
            return None
        self._pending_step = None
        kind, payload, frames = self._read_reply(f"step {step}")
        if kind == b"ERROR":
            raise TransportError(
                f"{self.endpoint}: step {step}, data rank {self.data_rank}: {payload.get('message')}"
            )
        if kind != b"DATA":
            raise TransportError(f"{self.endpoint}: step {step}: unexpected reply {kind!r}")
        micro_batches = decode_grid_item(
            [f.buffer for f in frames], self.endpoint, step, self.data_rank, self.vocab_size, self.num_experts
        )
        self._socket.send_multipart([b"ACK", _pack({"step": step, **self._who})])
        return micro_batches

    def close(self) -> None:
        self._socket.close()

    def __enter__(self) -> GridReceiver:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
