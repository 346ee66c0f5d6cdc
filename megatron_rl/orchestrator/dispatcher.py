"""The dispatcher: keeps groups in flight and hands out batches, within two separate bounds.

- **Lead gate** (`max_async_level` = L): generation may run ahead of training by at most L
  batches. With s batches shipped and policy version v live, groups may be in flight or waiting
  for at most `batch_size * (v + L + 1 - s)` admitted-or-running groups; so batch n is generated
  (and shipped) only once version >= n - L is live. L = 0 is strictly on-policy.
- **Staleness bound** (`max_off_policy_steps` = S): at shipping time for training step n, a group
  whose oldest generating version v has n - v > S (time spent queued included) is dropped and
  counted.

Groups get consecutive ids and dataset rows (cursor) in order and are shipped in id order
(skipping rejected and stale ones), so which groups form batch n does not depend on which
finished first: a restarted run from the same cursor sees the same prompts.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable

from megatron_rl.orchestrator.rollouts import Group


class Dispatcher:
    def __init__(
        self,
        start_group: Callable[[int, int], Awaitable[Group]],
        admit: Callable[[Group], list | None],
        batch_size: int,
        max_async_level: int,
        max_off_policy_steps: int,
        live_version: Callable[[], int],
        next_group_id: int = 0,
        shipped_batches: int = 0,
    ):
        """`start_group(group_id, row_index)` runs one group; `admit(group)` gives its samples or
        None; `live_version()` is the policy version the inference servers run."""
        self.start_group, self.admit = start_group, admit
        self.batch_size, self.lead, self.max_lag = batch_size, max_async_level, max_off_policy_steps
        self.live_version = live_version
        self.next_group_id = next_group_id  # == the dataset cursor: group i uses row i
        self.shipped_batches = shipped_batches
        self.running: dict[int, asyncio.Task] = {}
        self.done: dict[int, list | None] = {}  # finished, admitted (samples) or rejected (None)
        self.groups: dict[int, Group] = {}
        self.next_to_ship = next_group_id
        self.stale_dropped = 0
        self.lag_histogram: Counter = Counter()
        self._in_batch = 0
        self.failed_streak = 0  # consecutive groups whose every member failed
        self.max_failed_streak = max(8, 2 * batch_size)
        self._changed = asyncio.Event()
        self._error: BaseException | None = None

    # -- bounds --------------------------------------------------------------------------------
    def capacity(self) -> int:
        allowed_batches = self.live_version() + self.lead + 1 - self.shipped_batches
        return max(0, self.batch_size * allowed_batches)

    def occupancy(self) -> int:
        """Groups counted against the gate: running, admitted and waiting, and those already
        taken into the batch being assembled."""
        admitted_waiting = sum(1 for samples in self.done.values() if samples is not None)
        return len(self.running) + admitted_waiting + self._in_batch

    def fill(self) -> None:
        """Starts groups while the lead gate allows."""
        while self.occupancy() < self.capacity():
            group_id = self.next_group_id
            self.next_group_id += 1
            task = asyncio.ensure_future(self.start_group(group_id, group_id))
            self.running[group_id] = task
            task.add_done_callback(lambda t, g=group_id: self._finished(g, t))

    def _finished(self, group_id: int, task: asyncio.Task) -> None:
        self.running.pop(group_id, None)
        if task.cancelled():
            self.done[group_id] = None
        elif task.exception() is not None:
            self._error = task.exception()
        else:
            group = task.result()
            self.groups[group_id] = group
            self.done[group_id] = self.admit(group)
            errors = [m.error for m in group.members if m.status == "failed"]
            self.failed_streak = self.failed_streak + 1 if len(errors) == len(group.members) else 0
            if self.failed_streak >= self.max_failed_streak:  # inference unreachable: say so, stop
                self._error = RuntimeError(
                    f"{self.failed_streak} consecutive groups failed every rollout; last error: {errors[-1]}"
                )
        self._changed.set()

    def notify(self) -> None:
        """Call when the live version changed (the gate may open)."""
        self._changed.set()

    # -- shipping ------------------------------------------------------------------------------
    async def next_batch(self, step: int, timeout_s: float | None = None) -> list[tuple[Group, list]]:
        """The admitted groups of training step `step`, in group-id order, stale ones dropped."""
        batch: list[tuple[Group, list]] = []
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        while len(batch) < self.batch_size:
            if self._error is not None:
                raise self._error
            if self.next_to_ship in self.done:
                group_id = self.next_to_ship
                self.next_to_ship += 1
                samples = self.done.pop(group_id)
                group = self.groups.pop(group_id, None)
                if samples is None:
                    continue
                lag = step - min(s.policy_version for s in samples)
                if lag > self.max_lag:
                    self.stale_dropped += 1
                    continue
                self.lag_histogram[lag] += 1
                batch.append((group, samples))
                self._in_batch = len(batch)
                continue
            self.fill()
            self._changed.clear()
            if self.next_to_ship in self.done:
                continue
            remaining = None if deadline is None else max(0.0, deadline - loop.time())
            try:
                await asyncio.wait_for(
                    self._changed.wait(), timeout=remaining if remaining is None else max(remaining, 0.05)
                )
            except TimeoutError:
                if deadline is not None and loop.time() >= deadline:
                    raise TimeoutError(
                        f"step {step}: only {len(batch)} of {self.batch_size} groups admitted within {timeout_s}s "
                        f"({len(self.running)} running)"
                    ) from None
        self.shipped_batches = step + 1
        self._in_batch = 0
        self.fill()  # the next batch may start generating now
        return batch

    def cancel(self) -> None:
        for task in self.running.values():
            task.cancel()
