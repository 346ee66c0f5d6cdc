"""Measured allocation for memory tests on CPU: the bytes of every storage the ops inside a
`with AllocationTracker() as tracker:` block create, while they are alive (current and peak);
`ReceivedAllocations` counts only what a weight stream creates (what a receiver holds)."""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class AllocationTracker(TorchDispatchMode):
    """Bytes of the storages every op creates, while alive: current and peak. An op's output that
    shares an input's storage (a view, an in-place op) creates nothing; tensors made before the
    block are not counted."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = self.peak = 0

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            if key in self.live or key in inputs or storage.nbytes() == 0:
                continue
            self.live[key] = storage.nbytes()
            self.current += storage.nbytes()
            self.peak = max(self.peak, self.current)
            weakref.finalize(storage, self._free, key)
        return out


class ReceivedAllocations(AllocationTracker):
    """An AllocationTracker that counts only the storages created while `recording` (inside the
    weights iterator wrapped by `iterate`); frees are counted whenever they happen."""

    def __init__(self):
        super().__init__()
        self.recording = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.recording:
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)

    def iterate(self, weights: Iterable, arrived: list) -> Iterator:
        """`weights`, recording while each item is produced; appends (name, bytes) to `arrived`."""
        iterator = iter(weights)
        while True:
            self.recording = True
            try:
                name, tensor = next(iterator)
            except StopIteration:
                return
            finally:
                self.recording = False
            arrived.append((name, tensor.numel() * tensor.element_size()))
            yield name, tensor
            del tensor  # what vLLM keeps is its own reference
