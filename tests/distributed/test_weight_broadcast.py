"""Weight broadcast over a process group (gloo here; NCCL on GPU): byte-exact on every receiver."""

from __future__ import annotations

import gc
import time

import torch
import torch.distributed as dist

from megatron_rl.transport.weight_buckets import encode_plan, plan_buckets
from tests.support.memory import ReceivedAllocations
from tests.support.spawn import run_ranks
from tests.support.tensors import named_tensors


def exchange(rank, world_size, bucket_bytes):
    from megatron_rl.transport.weight_buckets import broadcast_weights, receive_weights

    group = dist.new_group(list(range(world_size)))
    if rank == 0:
        plan = broadcast_weights(named_tensors(), group, src=0, bucket_bytes=bucket_bytes)
        return len(plan.buckets)
    return {name: tensor.clone() for name, tensor in receive_weights(group, src=0)}


def test_broadcast_reaches_every_receiver_byte_exact():
    expected = named_tensors()
    for bucket_bytes in (64, 1 << 20):
        results = run_ranks(exchange, 3, bucket_bytes)
        assert results[0] >= 2  # mixed dtypes always give more than one bucket
        for received in results[1:]:
            plan = plan_buckets(((n, t.dtype, tuple(t.shape)) for n, t in expected.items()), bucket_bytes)
            assert list(received) == [e.name for b in plan.buckets for e in b.entries]  # the plan's order
            assert sorted(received) == sorted(expected)
            for name, tensor in expected.items():
                assert received[name].dtype == tensor.dtype and torch.equal(received[name], tensor), name


def stream_keeping_half(rank, world_size, bucket_bytes):
    """Rank 0 streams named_tensors() as two plans and ends the stream; a receiver keeps every
    other tensor (as vLLM's layer-wise reload buffers some) and reports what it held, measured
    from outside the stream (ReceivedAllocations: every storage the stream creates, while alive)."""
    from megatron_rl.transport.weight_buckets import broadcast_end, broadcast_weights, receive_weight_stream

    group = dist.new_group(list(range(world_size)))
    tensors = named_tensors()
    names = list(tensors)
    if rank == 0:
        broadcast_weights({n: tensors[n] for n in names[:2]}, group, src=0, bucket_bytes=bucket_bytes)
        broadcast_weights({n: tensors[n] for n in names[2:]}, group, src=0, bucket_bytes=bucket_bytes)
        broadcast_end(group, src=0)
        return None
    kept, order, arrived = {}, [], []
    with ReceivedAllocations() as held:
        for index, (name, tensor) in enumerate(held.iterate(receive_weight_stream(group, src=0), arrived)):
            order.append(name)
            if index % 2 == 0:
                kept[name] = tensor
    storages = {n: t.untyped_storage().nbytes() for n, t in kept.items()}
    values = {n: t.clone() for n, t in kept.items()}
    deadline = time.monotonic() + 5.0
    while held.current > sum(storages.values()) and time.monotonic() < deadline:
        # gloo's worker thread lets go of the last broadcast's tensor a moment after the
        # broadcast returns (it resets its work slot after marking the work done): on a busy
        # machine it can outlive our own references by a few milliseconds.
        gc.collect()
        time.sleep(0.01)
    after_stream = held.current
    del kept, tensor
    while held.current and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)
    return order, values, storages, after_stream, held.current, held.peak, arrived


def test_a_stream_hands_on_tensors_that_do_not_keep_their_buckets():
    """receive_weight_stream over several plans: byte-exact tensors in plan order, each with its
    own storage (a receiver that keeps some keeps their bytes, not their buckets: views of whole
    buckets before), and what the stream's allocations hold, measured from outside, is the kept
    tensors plus at most one bucket (and the plan in flight) at any time, and nothing at the end."""
    tensors = named_tensors()
    sizes = {n: t.numel() * t.element_size() for n, t in tensors.items()}
    for bucket_bytes in (64, 1 << 20):
        for result in run_ranks(stream_keeping_half, 3, bucket_bytes)[1:]:
            order, values, storages, after_stream, at_end, peak, arrived = result
            names = list(tensors)
            plans = [plan_buckets(((n, tensors[n].dtype, tuple(tensors[n].shape)) for n in part), bucket_bytes)
                     for part in (names[:2], names[2:])]  # fmt: skip
            buckets = [b for plan in plans for b in plan.buckets]
            assert order == [e.name for b in buckets for e in b.entries] and len(arrived) == len(tensors)
            assert arrived == [(name, sizes[name]) for name in order]
            assert sorted(values) == order[::2]
            for name, value in values.items():
                assert value.dtype == tensors[name].dtype and torch.equal(value, tensors[name]), name
                assert storages[name] == sizes[name], (bucket_bytes, name, storages[name])
            bucket_sizes = [b.numel * tensors[b.entries[0].name].element_size() for b in buckets]
            plan_bytes = max(len(encode_plan(plan)) for plan in plans) + 8  # the payload and its length
            kept_bytes = sum(sizes[n] for n in values)
            assert after_stream == kept_bytes and at_end == 0
            bound = kept_bytes + max(bucket_sizes) + plan_bytes
            assert peak <= bound, (bucket_bytes, peak, kept_bytes, bucket_sizes, plan_bytes)
