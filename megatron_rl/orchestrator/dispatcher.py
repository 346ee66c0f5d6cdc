"""The dispatcher: keeps groups in flight and hands out batches, within two separate bounds.

- **Lead gate** (`max_async_level` = L): generation may run ahead of training by at most L
  batches. With s batches shipped and policy version v live, groups may be in flight or waiting
  for at most `batch_size * (v + L + 1 - s)` admitted-or-running groups; so batch n is generated
  (and shipped) only once version >= n - L is live. L = 0 is strictly on-policy.
- **Staleness bound** (`max_off_policy_steps` = S): at shipping time for training step n, a group
  whose oldest generating version v has n - v > S (time spent queued included) is dropped and
  counted.

**Batch order** (`orchestrator.batch_order`). Groups get consecutive ids and dataset rows
(cursor) in order. With `dataset` they are shipped in id order (skipping rejected and stale
ones), so which groups form batch n does not depend on which finished first: a restarted run from
the same cursor sees the same prompts, and a batch waits for its slowest group. With `finish` a
step takes the groups in the order they finished, so no batch waits on the tail; with
`orchestrator.oversample` = O, up to O groups beyond what the lead gate admits generate at once,
and those left over go into later steps, where the staleness bound judges them like any group
(queue time counted). The cursor's meaning is kept as a watermark: `next_to_ship` is the lowest
group id not yet consumed and `consumed_ahead` the ids past it that were; a resumed run starts
again every group at or past the watermark that was not consumed (the ones in flight at the
checkpoint are generated anew, from the same rows) and never a consumed one, so every row is
trained on at most once; which rows form which batch then differs from an uninterrupted run.

**Dynamic sampling** (`orchestrator.dynamic_sampling`, DAPO): rejected and stale groups are
replaced from the stream (replacements start within the lead gate like any group). With a bound
of `max_extra_groups`, one step consumes at most `batch_size + max_extra_groups` groups; past
it `on_limit` "train" ships what was admitted (at least one group), "wait" goes on until the
batch is full, "stop" raises `DynamicSamplingLimit`. After a smaller batch the groups already
in flight would slide into later batches than the gate allowed when they started; from the
first one that could land past its gate (counting every group still in flight as admitted), the
newest groups are cancelled and the cursor rewound to it, so they are started again (same ids,
same rows) once the gate allows. Under finish order nothing is rewound: a group's place in a batch
is not fixed by its id, and the staleness bound drops one that waited too long. The two bounds
on extra groups are separate: `oversample` bounds how many groups generate beyond the gate at
once, `max_extra_groups` how many consumed groups one step may fail to admit (a replacement
starts within the gate plus `oversample` like any group). Every consumed group is counted in its
step's `StepCounts`.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from megatron_rl.config import DynamicSamplingConfig
from megatron_rl.orchestrator.rollouts import Group
from megatron_rl.orchestrator.sink import Verdict

log = logging.getLogger(__name__)


class DynamicSamplingLimit(RuntimeError):
    """`orchestrator.dynamic_sampling.on_limit: stop` and a step passed `max_extra_groups`."""


@dataclass
class StepCounts:
    """What one step consumed from the ordered stream of groups."""

    generated: int = 0  # consumed: admitted + rejected + stale
    admitted: int = 0
    rejected: Counter = field(default_factory=Counter)  # by rule
    stale: int = 0
    members_dropped: Counter = field(default_factory=Counter)  # by reason, over every consumed group
    member_errors: Counter = field(default_factory=Counter)  # failed members by their error's kind, likewise
    limit_hit: bool = False  # more than max_extra_groups consumed groups were not admitted
    partial: bool = False  # shipped fewer than batch_size groups
    restarted: int = 0  # groups in flight cancelled and rewound after a smaller batch (the gate)


class Dispatcher:
    def __init__(
        self,
        start_group: Callable[[int, int], Awaitable[Group]],
        judge: Callable[[Group], Verdict],
        batch_size: int,
        max_async_level: int,
        max_off_policy_steps: int,
        live_version: Callable[[], int],
        next_group_id: int = 0,
        shipped_batches: int = 0,
        dynamic_sampling: DynamicSamplingConfig | None = None,
        batch_order: str = "dataset",
        oversample: int = 0,
        consumed_ahead: tuple[int, ...] = (),
    ):
        """`start_group(group_id, row_index)` runs one group; `judge(group)` gives its Verdict;
        `live_version()` is the policy version the inference servers run; `dynamic_sampling`
        a DynamicSamplingConfig or None (no bound); `batch_order` "dataset" or "finish" with
        `oversample` groups beyond the gate; `consumed_ahead` (finish order, a resume): group ids
        past `next_group_id` that were consumed already."""
        if batch_order not in ("dataset", "finish"):
            raise ValueError(f"orchestrator.batch_order: 'dataset' or 'finish', got {batch_order!r}")
        self.start_group, self.judge = start_group, judge
        self.dynamic_sampling = dynamic_sampling
        self.batch_size, self.lead, self.max_lag = batch_size, max_async_level, max_off_policy_steps
        self.live_version = live_version
        self.next_group_id = next_group_id  # == the dataset cursor: group i uses row i
        self.shipped_batches = shipped_batches
        self.running: dict[int, asyncio.Task] = {}
        self.done: dict[int, Verdict] = {}  # finished: admitted (samples) or rejected (None)
        self._admitted_waiting = 0  # entries of `done` with samples (kept, not recounted per fill)
        self.groups: dict[int, Group] = {}
        self.started_at: dict[int, int] = {}  # group id -> the live version when it started
        self.next_to_ship = next_group_id  # the lowest group id not consumed yet
        self.by_finish, self.oversample = batch_order == "finish", oversample
        self.consumed_ahead: set[int] = set(consumed_ahead)  # finish order: consumed ids past next_to_ship
        self.finished: deque[int] = deque()  # finish order: ids in `done` in the order they finished
        self.stale_dropped = 0
        self.lag_histogram: Counter = Counter()
        self.last_counts = StepCounts()  # of the newest step next_batch worked on
        self._in_batch = 0
        self.failed_streak = 0  # consecutive groups whose every member failed
        self.max_failed_streak = max(8, 2 * batch_size)
        self._changed = asyncio.Event()
        self._error: BaseException | None = None

    # -- bounds --------------------------------------------------------------------------------
    def capacity(self) -> int:
        allowed_batches = self.live_version() + self.lead + 1 - self.shipped_batches
        return max(0, self.batch_size * allowed_batches) + self.oversample

    def occupancy(self) -> int:
        """Groups counted against the gate: running, admitted and waiting, and those already
        taken into the batch being assembled."""
        return len(self.running) + self._admitted_waiting + self._in_batch

    def _set_done(self, group_id: int, verdict: Verdict) -> None:
        self._pop_done(group_id)
        self.done[group_id] = verdict
        self._admitted_waiting += verdict.samples is not None
        if self.by_finish:
            self.finished.append(group_id)

    def _pop_done(self, group_id: int) -> Verdict | None:
        verdict = self.done.pop(group_id, None)
        if verdict is not None and verdict.samples is not None:
            self._admitted_waiting -= 1
        return verdict

    def fill(self) -> None:
        """Starts groups while the lead gate allows."""
        while self.occupancy() < self.capacity():
            group_id = self.next_group_id
            self.next_group_id += 1
            if group_id in self.consumed_ahead:  # a resume under finish order: trained on already
                continue
            self.started_at[group_id] = self.live_version()
            task = asyncio.ensure_future(self.start_group(group_id, group_id))
            self.running[group_id] = task
            task.add_done_callback(lambda t, g=group_id: self._finished(g, t))

    def _finished(self, group_id: int, task: asyncio.Task) -> None:
        if self.running.get(group_id) is not task:  # cancelled by a rewind (maybe started again)
            return
        self.running.pop(group_id)
        if task.cancelled():
            self._set_done(group_id, Verdict(None, "cancelled"))
        elif task.exception() is not None:
            self._error = task.exception()
        else:
            group = task.result()
            self.groups[group_id] = group
            self._set_done(group_id, self.judge(group))
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
        """The admitted groups of training step `step`, in group-id order (finish order: in the
        order they finished), stale ones dropped: `batch_size` of them, or fewer where the
        dynamic-sampling bound says "train". What the step consumed is in `last_counts`."""
        batch: list[tuple[Group, list]] = []
        counts = self.last_counts = StepCounts()
        sampling = self.dynamic_sampling
        most = None if sampling is None else self.batch_size + sampling.max_extra_groups
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        while len(batch) < self.batch_size:
            if self._error is not None:
                raise self._error
            if most is not None and sampling.on_limit == "train" and batch and counts.generated >= most:
                break  # the bound: train on what was admitted
            if (group_id := self._next_done()) is not None:
                self._consume(step, batch, counts, group_id)
                continue
            self.fill()
            self._changed.clear()
            if self._next_done() is not None:
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
                        f"({len(self.running)} running; consumed {counts.generated}, rejected by rule "
                        f"{dict(counts.rejected)}, stale {counts.stale})"
                    ) from None
        self.shipped_batches = step + 1
        self._in_batch = 0
        counts.partial = len(batch) < self.batch_size
        if counts.partial:
            counts.restarted = 0 if self.by_finish else self._rewind_past_the_gate()
            log.warning(
                "step %d: orchestrator.dynamic_sampling.max_extra_groups (%d) reached: training on %d of %d "
                "groups (%d consumed, rejected by rule %s, stale %d; %d in flight restarted for the lead gate)",
                step, sampling.max_extra_groups, len(batch), self.batch_size, counts.generated,
                dict(counts.rejected), counts.stale, counts.restarted,
            )  # fmt: skip
        self.fill()  # the next batch may start generating now
        return batch

    def _next_done(self) -> int | None:
        """The finished group the step takes next: the next in id order (dataset order), or the
        first to finish (finish order); None while it is not there."""
        if self.by_finish:
            return self.finished[0] if self.finished else None
        return self.next_to_ship if self.next_to_ship in self.done else None

    def _consume(self, step: int, batch: list, counts: StepCounts, group_id: int) -> None:
        """Takes finished group `group_id` into the step: admitted, rejected or stale."""
        if self.by_finish:
            self.finished.popleft()
            self.consumed_ahead.add(group_id)
            while self.next_to_ship in self.consumed_ahead:  # the watermark
                self.consumed_ahead.remove(self.next_to_ship)
                self.next_to_ship += 1
        else:
            self.next_to_ship += 1
        verdict = self._pop_done(group_id)
        group = self.groups.pop(group_id, None)
        self.started_at.pop(group_id, None)
        counts.generated += 1
        counts.members_dropped.update(verdict.dropped)
        if group is not None:  # "OpenEnvTimeout: ..." -> OpenEnvTimeout (the exception's name)
            counts.member_errors.update((m.error or "unknown").split(":", 1)[0] for m in group.members
                                        if m.status == "failed")  # fmt: skip
        samples = verdict.samples
        if samples is None:
            counts.rejected[verdict.rule] += 1
        elif (lag := step - min(s.policy_version for s in samples)) > self.max_lag:
            self.stale_dropped += 1
            counts.stale += 1
        else:
            self.lag_histogram[lag] += 1
            batch.append((group, samples))
            self._in_batch = len(batch)
            counts.admitted += 1
        sampling = self.dynamic_sampling
        not_admitted = counts.generated - counts.admitted
        if sampling is None or counts.limit_hit or not_admitted <= sampling.max_extra_groups:
            return
        counts.limit_hit = True  # the batch can no longer fill within the bound
        if sampling.on_limit == "stop":
            raise DynamicSamplingLimit(
                f"step {step}: orchestrator.dynamic_sampling.max_extra_groups ({sampling.max_extra_groups}) "
                f"passed: {counts.generated} groups consumed, {counts.admitted} of {self.batch_size} admitted "
                f"(rejected by rule: {dict(counts.rejected)}, stale: {counts.stale}); raise it, set "
                "orchestrator.dynamic_sampling.on_limit to 'train' or 'wait', or check orchestrator.admission"
            )
        if sampling.on_limit == "wait":
            log.warning(
                "step %d: orchestrator.dynamic_sampling.max_extra_groups (%d) passed with %d of %d groups "
                "admitted; waiting for a full batch (on_limit: wait)",
                step, sampling.max_extra_groups, counts.admitted, self.batch_size,
            )  # fmt: skip

    def _rewind_past_the_gate(self) -> int:
        """After a smaller batch: finds the first group in flight that could land in a batch past
        its lead gate (batch > its starting version + L, every group in flight counted as
        admitted), cancels it and every newer one, and rewinds the cursor to it; returns how
        many were rewound. Afterwards occupancy <= capacity again."""
        position, first = 0, None
        for group_id in range(self.next_to_ship, self.next_group_id):
            verdict = self.done.get(group_id)
            if verdict is not None and verdict.samples is None:
                continue  # rejected: takes no place in a batch
            if self.shipped_batches + position // self.batch_size > self.started_at[group_id] + self.lead:
                first = group_id
                break
            position += 1
        if first is None:
            return 0
        for group_id in range(first, self.next_group_id):
            task = self.running.pop(group_id, None)
            if task is not None:
                task.cancel()
            self._pop_done(group_id)
            self.groups.pop(group_id, None)
            self.started_at.pop(group_id, None)
        rewound, self.next_group_id = self.next_group_id - first, first
        return rewound

    def cancel(self) -> None:
        for task in self.running.values():
            task.cancel()
