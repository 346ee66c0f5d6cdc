"""Weight broadcast over a process group (gloo here; NCCL on GPU): byte-exact on every receiver."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_rl.testing.spawn import run_ranks
from megatron_rl.testing.tensors import named_tensors
from megatron_rl.transport.weight_buckets import plan_buckets


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
