"""An asyncio event loop on a virtual clock, for simulating a cluster with the real orchestrator.

`loop.time()` is virtual: when no callback is ready, the loop jumps its clock to the next timer
instead of sleeping, so `asyncio.sleep(300)` takes no wall time and code that spends CPU takes
no virtual time. `asyncio.to_thread` / `run_in_executor(None, ...)` run the function inline on
the loop's thread (a thread would finish at a wall-clock moment, which would make the event
order depend on the machine). Nothing in the simulated world does real socket I/O through the
loop (HTTP goes through an in-process httpx transport, ZMQ waits block the loop thread outright,
so they take no virtual time), so the order of events depends only on the code and its seeds.

    run_virtual(main())  # -> main's result; VirtualClockLoop.now is the simulated time
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import selectors


class SimulationDeadlock(RuntimeError):
    """Nothing is scheduled and nothing can wake the loop: every task waits on something that
    will never happen."""


class InlineExecutor(concurrent.futures.ThreadPoolExecutor):
    """Runs each submitted call at once, on the caller's thread; returns a finished future."""

    def __init__(self):
        super().__init__(max_workers=1)

    def submit(self, fn, /, *args, **kwargs):
        future: concurrent.futures.Future = concurrent.futures.Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # delivered to the awaiting coroutine
            future.set_exception(exc)
        return future


class _VirtualSelector(selectors.BaseSelector):
    """The real selector for readiness (the loop's self-pipe); a wait of `timeout` seconds with
    nothing ready advances the virtual clock by `timeout` instead of sleeping."""

    def __init__(self, loop: VirtualClockLoop, idle_wall_s: float):
        self._loop, self._real, self._idle_wall_s = loop, selectors.DefaultSelector(), idle_wall_s

    def register(self, fileobj, events, data=None):
        return self._real.register(fileobj, events, data)

    def unregister(self, fileobj):
        return self._real.unregister(fileobj)

    def modify(self, fileobj, events, data=None):
        return self._real.modify(fileobj, events, data)

    def get_map(self):
        return self._real.get_map()

    def close(self) -> None:
        self._real.close()

    def select(self, timeout=None):
        ready = self._real.select(0)
        if ready or timeout == 0:
            return ready
        if timeout is None:  # no timer at all: only an outside event could help
            ready = self._real.select(self._idle_wall_s)
            if not ready:
                raise SimulationDeadlock(
                    f"virtual clock at {self._loop.now:.3f}s: no timer scheduled and nothing ready for "
                    f"{self._idle_wall_s}s of wall time"
                )
            return ready
        self._loop.now += timeout
        return []


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """A SelectorEventLoop whose `time()` is the virtual clock `now` (seconds from 0)."""

    def __init__(self, idle_wall_s: float = 30.0):
        self.now = 0.0
        super().__init__(_VirtualSelector(self, idle_wall_s))
        self.set_default_executor(InlineExecutor())

    def time(self) -> float:
        return self.now


def run_virtual(coroutine, idle_wall_s: float = 30.0):
    """Runs `coroutine` to completion on a fresh VirtualClockLoop; returns its result."""
    loop = VirtualClockLoop(idle_wall_s)
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(coroutine)
    finally:
        try:
            pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for task in pending:
                task.cancel()
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            asyncio.set_event_loop(None)
            loop.close()
