"""Peak anonymous memory of this process while a block runs (Linux /proc), for memory tests and
benchmarks of whole procedures (a conversion, a load) rather than single ops (for those:
testing/memory.py's AllocationTracker).

Anonymous memory (`RssAnon`) is what a process allocates for itself: tensors, Python objects.
File-backed pages (`RssFile`: memory-mapped safetensors, the page cache) are not counted: the
kernel can drop and re-read them. A thread samples /proc/self/status every `interval_s`; a peak
that lasts less than that can be missed, so measure allocations that live at least a few
milliseconds (a model's tensors do). Child processes (megatron's checkpoint writers) are not
counted.

glibc keeps freed heap memory resident, and after a large block is freed it serves later large
blocks from the heap too (its mmap threshold rises): RssAnon would then count memory freed before
the block as in use, and hide the block's own allocations. So the block starts with glibc's
threshold fixed at 64 KiB (large tensors are mmapped and return to the system when freed) and
its free memory trimmed. This changes how the process allocates from then on: use it in a test
rank or a measuring child process, not in a long-lived one.
"""

from __future__ import annotations

import ctypes
import threading
import time
from dataclasses import dataclass

_M_MMAP_THRESHOLD = -3  # glibc mallopt parameter


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field} (not Linux?)")


def release_freed_memory() -> None:
    """Large allocations mmapped from now on (so freeing returns them), free heap trimmed."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(_M_MMAP_THRESHOLD, 64 * 1024)
    libc.malloc_trim(0)


def anonymous_bytes() -> int:
    """RssAnon of this process now, in bytes."""
    return _status_bytes("RssAnon")


@dataclass
class PeakMemory:
    baseline: int = 0  # RssAnon when the block started, bytes
    peak: int = 0  # the largest RssAnon sampled while it ran, bytes

    @property
    def extra(self) -> int:
        """Peak anonymous memory above the baseline, bytes."""
        return max(self.peak - self.baseline, 0)


class peak_anonymous_memory:
    """`with peak_anonymous_memory() as memory: ...`, then `memory.extra` (bytes)."""

    def __init__(self, interval_s: float = 0.001):
        self.interval_s = interval_s
        self.memory = PeakMemory()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.memory.peak = max(self.memory.peak, anonymous_bytes())
            time.sleep(self.interval_s)

    def __enter__(self) -> PeakMemory:
        release_freed_memory()
        self.memory.baseline = self.memory.peak = anonymous_bytes()
        self._thread.start()
        return self.memory

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.memory.peak = max(self.memory.peak, anonymous_bytes())
