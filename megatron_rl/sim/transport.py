"""The simulated trainers' side of the real ZMQ transport: a GridLink is one model's real
GridSender (what the orchestrator publishes with, as in run.py) and one real GridReceiver per
data rank on loopback, each in its own thread, decoding and checksumming every item.

`send(step, grid)` publishes like run.py (`asyncio.to_thread(sender.publish, ...)`), waits
(blocking the loop: no simulated time passes) until every data rank acknowledged the step, and
starts the model's training task after the grid's modelled time on the wire (its bytes /
`wire_bytes_per_s`). The receivers' CPU is the stand-ins' (the cluster's CpuLedger); the
sender's thread is the orchestrator's.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass

import numpy as np

from megatron_rl.parallel import free_port
from megatron_rl.transport import GridReceiver, GridSender


@dataclass
class ReceivedItem:
    """What one data rank received for one step."""

    data_rank: int
    micro_steps: int
    sequence_lengths: list[int]  # of every real sequence in its micro-batches
    nbytes: int  # array bytes of its frames
    tokens: int = 0  # packed tokens of its real micro-batches (padding included)


class GridLink:
    def __init__(self, cluster, name: str, data_parallel_size: int, train, timeout_s: float = 300.0):
        """`train(step, items)` is the model's training coroutine, started once `step` arrived."""
        self.cluster, self.name, self.dp, self.train, self.timeout_s = (
            cluster,
            name,
            data_parallel_size,
            train,
            timeout_s,
        )
        self.port = free_port()
        self.bytes, self.tokens, self.wall_s = 0, 0, 0.0
        self.micro_steps: dict[int, list[int]] = {}  # step -> micro-steps of each data rank
        self.version_at_send: dict[int, int] = {}
        self._received: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._tasks: list[asyncio.Task] = []
        self.sender: GridSender | None = None

    def start(self) -> None:
        self.sender = GridSender("127.0.0.1", self.port, self.dp, receivers_per_data_rank=1, name=self.name)
        for rank in range(self.dp):
            thread = threading.Thread(
                target=self._receive, args=(rank,), name=f"sim-{self.name}-{rank}", daemon=True
            )
            thread.start()
            self._threads.append(thread)

    def _receive(self, rank: int) -> None:
        ledger, step, spent = self.cluster.ledger, 0, time.thread_time()
        receiver = GridReceiver(
            "127.0.0.1", self.port, rank, timeout_s=self.timeout_s, handshake_timeout_s=None
        )
        try:
            while not self._stop.is_set():
                micro_batches = receiver.poll(step, 0.05)
                if micro_batches is not None:
                    lengths = [
                        int(n) for mb in micro_batches if not mb.is_dummy for n in np.diff(mb.cu_seqlens)
                    ]
                    nbytes = sum(a.nbytes for mb in micro_batches for a in mb.arrays().values())
                    tokens = sum(mb.num_tokens for mb in micro_batches if not mb.is_dummy)
                    self._received.put((step, ReceivedItem(rank, len(micro_batches), lengths, nbytes, tokens)))
                    step += 1
                now = time.thread_time()
                ledger.add(now - spent)
                spent = now
        finally:
            receiver.close()

    async def send(self, step: int, grid) -> None:
        self.version_at_send[step] = self.cluster.follower.version()
        began = time.perf_counter()
        await asyncio.to_thread(self.sender.publish, step, grid, self.timeout_s)
        with self.cluster.ledger:
            self.sender.wait_delivered(step, self.timeout_s)
            items = [self._received.get(timeout=self.timeout_s) for _ in range(self.dp)]
        self.wall_s += time.perf_counter() - began
        if any(s != step for s, _ in items):
            raise RuntimeError(
                f"{self.name} link: step {step} delivered items of steps {[s for s, _ in items]}"
            )
        items = sorted((item for _, item in items), key=lambda item: item.data_rank)
        nbytes = sum(item.nbytes for item in items)
        self.bytes += nbytes
        self.tokens += sum(item.tokens for item in items)
        self.micro_steps[step] = [item.micro_steps for item in items]
        previous = self._tasks[-1] if self._tasks else None
        task = asyncio.ensure_future(self._after_the_wire(step, items, nbytes, previous))
        task.add_done_callback(self._check)
        self._tasks.append(task)

    def _check(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            self.cluster.fail(task.exception())

    async def _after_the_wire(self, step: int, items, nbytes: int, previous: asyncio.Task | None) -> None:
        """The grid's time on the wire, then its training once the previous step's is done: a
        trainer takes its steps in order (a smaller grid sent right after a bigger one arrives
        first, and must not be trained first)."""
        await asyncio.sleep(nbytes / self.cluster.model.wire_bytes_per_s)
        if previous is not None:
            await asyncio.shield(previous)
        await self.train(step, items)

    def close(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=5)
        if self.sender is not None:
            self.sender.close()
