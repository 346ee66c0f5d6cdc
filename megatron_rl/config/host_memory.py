"""Host memory of the offloaded optimizer (`optimizer.cpu_offload`), as megatron-core 0.16.1 and
torch's pinned-memory allocator take it, per rank and per node.

What megatron does (optimizer/cpu_offloading/hybrid_optimizer.py, optimizer/distrib_optimizer.py):
- `get_megatron_optimizer` first builds a `HybridDeviceOptimizer` over the rank's full
  parameters (optimizer/__init__.py ~336), then the distributed optimizer replaces it by one over
  its shards (distrib_optimizer.py ~602). Each build copies every offloaded parameter with
  `.clone().cpu().pin_memory()` (a pinned copy in the model's dtype) and, for a 16-bit model,
  `.clone().float()` (the fp32 master, pageable); the pinned copy is then dropped, so its block
  goes back to the pinned allocator's cache. The first optimizer is kept alive by a reference
  cycle (its step hooks close over it): only the cyclic garbage collector frees it and its fp32
  copies (trainer/role.py collects right after the optimizer is built).
- The first step allocates, per offloaded shard, a pinned fp32 gradient copy
  (`cpu_copy_map_grad`, `pin_memory=pin_cpu_grads`) and the host Adam moments (pageable).
- Loading a checkpoint first initialises the optimizer state with one zero fp32 gradient buffer
  per device as large as the largest parameter stepped there (trainer/optimizer.py), then runs
  `_init_sub_optimizers` again (the load post-hook): new fp32 copies are made while the old ones
  are still referenced.

What torch does (ATen/core/CachingHostAllocator.h, torch 2.13): every pinned allocation is
rounded up to the next power of two (`PowerOf2Ceil`; `pinned_max_round_threshold` and
`pinned_max_cached_size` are unlimited by default), freed blocks stay cached and are reused only
by a request of the same power-of-two class. So a pinned fp32 gradient of an expert's fc1
(2 x 768 x 2048 elements, 12 MiB) takes 16 MiB.

Estimates: a parameter that the distributed optimizer shards over `g` ranks is counted as 1/g of
a whole tensor (megatron cuts the buffer, not each tensor, so most tensors lie whole in one
rank's range); the checkpoint loader fills the optimizer's own tensors in place (megatron's
`dp_reshardable` format), so it adds nothing of its own here (read, not measured).
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = float(1 << 30)


def pinned_bytes(size: int) -> int:
    """What the pinned (CUDA host caching) allocator takes for a request of `size` bytes: the
    next power of two."""
    if size <= 0:
        raise ValueError(f"pinned_bytes: size must be positive, got {size}")
    return 1 << (size - 1).bit_length()


@dataclass(frozen=True)
class ShardTensor:
    """One trainable tensor of a rank: its elements and the ranks the optimizer shards it over."""

    elements: int
    shards: int


@dataclass(frozen=True)
class HostMemory:
    """One rank's host memory for its offloaded optimizer, in bytes, at three moments."""

    steady: dict[str, float]
    start_up: dict[str, float]
    resume: dict[str, float]

    def peak(self) -> tuple[str, dict[str, float]]:
        """(moment, parts) of the largest of the three."""
        moments = {"steady": self.steady, "start-up": self.start_up, "resume": self.resume}
        return max(moments.items(), key=lambda item: sum(item[1].values()))


def offloaded_host_memory(tensors: list[ShardTensor], dtype_bytes: int, fraction: float) -> HostMemory:
    """Host bytes of one rank whose trainable `tensors` are offloaded at `fraction` (whole tensors
    in megatron's order until the fraction is reached: here, `fraction` of every figure)."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"offload fraction must be within [0, 1], got {fraction}")
    shard_elements = sum(t.elements / t.shards for t in tensors)
    full_elements = sum(t.elements for t in tensors)
    gradients = sum(pinned_bytes(4 * t.elements) / t.shards for t in tensors)
    if dtype_bytes < 4:
        masters = 4 * shard_elements  # `.clone().float()`: pageable, exact
        first_copies = 4 * full_elements
        # the dropped 16-bit pinned copies: one cached block per power-of-two class
        staging = float(sum({pinned_bytes(dtype_bytes * t.elements) for t in tensors}))
    else:  # an fp32 parameter's pinned copy is its master: kept, rounded
        masters = sum(pinned_bytes(4 * t.elements) / t.shards for t in tensors)
        first_copies = float(sum(pinned_bytes(4 * t.elements) for t in tensors))
        staging = 0.0
    steady = {
        "masters": fraction * masters,
        "moments": fraction * 8 * shard_elements,
        "pinned_gradients": fraction * gradients,
        "pinned_cache": staging if fraction else 0.0,
    }
    start_up = {
        "first_optimizer_copies": fraction * first_copies,
        "masters": fraction * masters,
        "pinned_cache": steady["pinned_cache"],
    }
    largest = max((t.elements for t in tensors), default=0)
    # the sub-optimizers and their masters are kept through a load (trainer/optimizer.py)
    resume = {**steady, "state_init_gradient": 4.0 * largest if fraction else 0.0}
    return HostMemory(steady, start_up, resume)
