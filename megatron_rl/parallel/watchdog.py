"""Lost-rank detection for the ranks of one role, through heartbeats in the rendezvous store.

A rank killed with SIGKILL (or a node that disappears) leaves the others of its group in a
collective that never completes: NCCL and gloo wait up to the process-group timeout, and a rank
waiting on something else (a ZMQ receive, an HTTP request) waits for ever. So every rank of a
role runs a `PeerWatchdog` thread (started by `parallel.initialize_role`):

- every `interval_s` it adds 1 to its counter `megatron_rl/heartbeat/<attempt>/<rank>` in the store
  torchrun (or rank 0) hosts, and reads every peer's counter (one `multi_get`);
- a peer whose counter has not moved for `deployment.heartbeat_timeout_s` (measured on this
  rank's own clock: no clock agreement between hosts needed) is lost: this rank logs
  "lost rank P" with the silence and exits with status `LOST_PEER_EXIT` at once (`os._exit`:
  a thread stuck in a collective cannot be unwound);
- a store that stops answering for that long is lost too (it lives in torchrun's agent on the
  group's first node, or in rank 0's process without torchrun): named the same way;
- a rank that leaves normally adds `FINISHED` to its counter first, so the others never take a
  clean exit for a loss; a rank that leaves with an exception does not, and its peers name it.

When a collective raises because a peer vanished (gloo sees the closed socket at once),
`destroy()` runs `explain_failure()` before tearing the group down: it watches the counters for
a few intervals and logs which peer went silent, so the error in this rank's log names the lost
rank instead of only "Connection closed by peer".

The process-group timeout (`deployment.collective_timeout_s`) stays the backstop for a peer
that is alive but never enters a collective (its heartbeat keeps going).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

log = logging.getLogger("megatron_rl.parallel")

# Per torchrun restart (TORCHELASTIC_RESTART_COUNT): torchrun's store outlives a restart of its
# workers, and a counter left by the previous attempt (FINISHED, or a silent one) must not speak
# for the new rank.
KEY = "megatron_rl/heartbeat/{attempt}/{rank}"


def heartbeat_key(rank: int) -> str:
    return KEY.format(attempt=os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"), rank=rank)
FINISHED = 1 << 40  # added to a counter by a rank that leaves normally
LOST_PEER_EXIT = 17  # the exit status of a rank that gave up on a lost peer
SILENT_INTERVALS = 3  # after a failed collective: a peer silent this many intervals is the lost one


def heartbeat_interval(timeout_s: float) -> float:
    """Ten beats per timeout, between 0.2 s and 5 s apart."""
    return min(5.0, max(0.2, timeout_s / 10))


class PeerWatchdog:
    def __init__(
        self,
        role: str,
        rank: int,
        world_size: int,
        host: str,
        port: int,
        timeout_s: float,
        store_owner: str,
    ):
        self.role = role
        self.rank = rank
        self.world_size = world_size
        self.where = f"{host}:{port}"
        self.timeout_s = timeout_s
        self.interval_s = heartbeat_interval(timeout_s)
        self.store_owner = store_owner
        self._store = _connect(host, port, timeout_s)
        self._peers = [r for r in range(world_size) if r != rank]
        self._keys = [heartbeat_key(r) for r in self._peers]
        self._key = heartbeat_key(rank)
        now = time.monotonic()
        self._seen = {r: (-1, now) for r in self._peers}  # peer -> (counter, when it last moved)
        self._store_failing_since: float | None = None
        self._store_error = ""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._store.add(self._key, 1)
        self._thread = threading.Thread(
            target=self._run, name=f"PeerWatchdog[{role} rank {rank}]", daemon=True
        )

    def start(self) -> PeerWatchdog:
        self._thread.start()
        return self

    # -- the thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            message = self.beat()
            if message is not None and not self._stop.is_set():
                _exit_lost(message)
                return

    def beat(self, silent_s: float | None = None) -> str | None:
        """One heartbeat and one look at the peers; the loss message when a peer (or the store)
        has been silent for `silent_s` (default: the heartbeat timeout)."""
        silent_s = self.timeout_s if silent_s is None else silent_s
        with self._lock:
            now = time.monotonic()
            try:
                self._store.add(self._key, 1)
                counters = self._read_counters()
            except Exception as exc:  # the store's host is gone, or the network
                if any(count >= FINISHED for count, _ in self._seen.values()):
                    self._stop.set()  # a peer left normally and may have taken the store with it
                    return None
                self._store_error = f"{type(exc).__name__}: {exc}"
                self._store_failing_since = self._store_failing_since or now
            else:
                self._store_failing_since = None
                for peer, count in zip(self._peers, counters, strict=True):
                    if count != self._seen[peer][0]:
                        self._seen[peer] = (count, now)
            return self._diagnose(now, silent_s)

    def _diagnose(self, now: float, silent_s: float) -> str | None:
        reason = (
            f"deployment.heartbeat_timeout_s = {self.timeout_s:g}"
            if silent_s >= self.timeout_s
            else ("noticed after a failed collective")
        )
        if self._store_failing_since is not None:
            failing = now - self._store_failing_since
            if failing < silent_s:
                return None
            store = f"the rendezvous store at {self.where}"
            lost = (
                f"lost rank 0 ({store}, which it hosts,"
                if self.store_owner == RANK0
                else (f"lost {store} ({self.store_owner};")
            )
            message = (
                f"{self._me()}: {lost} gave no answer for {failing:.1f} s: {reason}; {self._store_error})"
            )
            # A peer already silent while the store still answered went first.
            earlier = self._silent(self._store_failing_since, SILENT_INTERVALS * self.interval_s)
            if earlier:
                message += f"; before that, rank {earlier[0]} had stopped its heartbeat"
            return message + ". Exiting non-zero so that no rank waits in a collective."
        lost = self._silent(now, silent_s)
        if not lost:
            return None
        first = lost[0]
        others = f" (then rank(s) {', '.join(map(str, lost[1:]))})" if len(lost) > 1 else ""
        return (
            f"{self._me()}: lost rank {first}{others}: no heartbeat for {now - self._seen[first][1]:.1f} s "
            f"({reason}); its process ended or hangs, see its log. Exiting non-zero so that no rank "
            f"waits for it in a collective."
        )

    def _read_counters(self) -> list[int]:
        # Every counter exists once its rank started; `add(key, 0)` reads one without blocking
        # before that (multi_get would wait for a missing key).
        if all(count >= 0 for count, _ in self._seen.values()) or self._store.check(self._keys):
            return [int(v) for v in self._store.multi_get(self._keys)]
        return [self._store.add(key, 0) for key in self._keys]

    def _silent(self, now: float, seconds: float) -> list[int]:
        return sorted(
            (
                peer
                for peer, (count, moved) in self._seen.items()
                if count < FINISHED and now - moved >= seconds
            ),
            key=lambda peer: self._seen[peer][1],  # the first to go silent first
        )

    def _me(self) -> str:
        return f"{self.role} rank {self.rank} of {self.world_size}"

    # -- the main thread ------------------------------------------------------------------------
    def explain_failure(self) -> str | None:
        """After this rank failed (a collective raised): the peer (or store) that went silent,
        if one does within `SILENT_INTERVALS` heartbeat intervals; None when all keep beating."""
        if self._stop.is_set():
            return None
        deadline = time.monotonic() + (SILENT_INTERVALS + 1) * self.interval_s
        while time.monotonic() < deadline:
            message = self.beat(SILENT_INTERVALS * self.interval_s)
            if message is not None:
                return message
            time.sleep(self.interval_s)
        return None

    def stop(self, finished: bool) -> None:
        """Ends the heartbeat; `finished` marks a normal exit so the peers do not count it lost."""
        self._stop.set()
        self._thread.join(timeout=2 * self.interval_s + 5)
        if finished:
            try:
                self._store.add(self._key, FINISHED)
            except Exception as exc:  # the store's host left first: nobody is left to tell
                log.debug("%s: could not mark the heartbeat finished: %s", self._me(), exc)


def _connect(host: str, port: int, timeout_s: float):
    return dist.TCPStore(
        host, port, is_master=False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
    )


def _exit_lost(message: str) -> None:
    log.critical(message)
    print(message, file=sys.stderr, flush=True)
    for handler in logging.getLogger().handlers:
        handler.flush()
    # os._exit skips the atexit hooks that would stop this process's multiprocessing children
    # (megatron's checkpoint writer keeps a Manager process): stop them here.
    for child in multiprocessing.active_children():
        child.kill()
    os._exit(LOST_PEER_EXIT)


RANK0 = "hosted by rank 0"


def store_owner() -> str:
    """Who hosts the rendezvous store, for messages."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return "hosted by torchrun's agent on the group's first node"
    return RANK0
