"""Weight broadcast in dtype buckets, with metadata as msgpack bytes (never pickle).

Path (b) of weight publishing: policy rank 0 and the inference workers share one process group
(NCCL on GPU; gloo works the same on CPU). The sender broadcasts the plan (names, dtypes,
shapes, offsets per bucket) as a uint8 tensor preceded by its length, then each bucket as one
flat tensor of a single dtype. Receivers rebuild (name, tensor) pairs from views into the
buckets. A tensor larger than the bucket size travels in a bucket of its own.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import msgspec
import torch
import torch.distributed as dist

PLAN_VERSION = 1
_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float32,
        torch.bfloat16,
        torch.float16,
        torch.float64,
        torch.int64,
        torch.int32,
        torch.uint8,
        torch.bool,
    )
}


class TensorEntry(msgspec.Struct, array_like=True):
    name: str
    shape: list[int]
    offset: int  # in elements within the bucket
    numel: int


class Bucket(msgspec.Struct):
    dtype: str
    numel: int
    entries: list[TensorEntry]


class Plan(msgspec.Struct):
    version: int
    buckets: list[Bucket]


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"weight broadcast: unsupported dtype {dtype}")
    return name


def plan_buckets(named: Iterable[tuple[str, torch.dtype, tuple[int, ...]]], bucket_bytes: int) -> Plan:
    """Groups tensors by dtype (in order of first appearance) into buckets of at most
    `bucket_bytes` (a larger tensor gets its own bucket)."""
    open_buckets: dict[str, Bucket] = {}
    done: list[Bucket] = []
    for name, dtype, shape in named:
        key = dtype_name(dtype)
        numel = 1
        for size in shape:
            numel *= int(size)
        itemsize = torch.empty((), dtype=_DTYPES[key]).element_size()
        bucket = open_buckets.get(key)
        if bucket is not None and bucket.entries and (bucket.numel + numel) * itemsize > bucket_bytes:
            done.append(bucket)
            bucket = None
        if bucket is None:
            bucket = open_buckets[key] = Bucket(dtype=key, numel=0, entries=[])
        bucket.entries.append(
            TensorEntry(name=name, shape=[int(s) for s in shape], offset=bucket.numel, numel=numel)
        )
        bucket.numel += numel
    done.extend(b for b in open_buckets.values() if b.entries)
    return Plan(version=PLAN_VERSION, buckets=done)


def encode_plan(plan: Plan) -> bytes:
    return msgspec.msgpack.encode(plan)


def decode_plan(data: bytes) -> Plan:
    plan = msgspec.msgpack.decode(data, type=Plan)
    if plan.version != PLAN_VERSION:
        raise ValueError(f"weight broadcast plan version {plan.version}, this receiver reads {PLAN_VERSION}")
    return plan


def pack_bucket(bucket: Bucket, tensors: dict[str, torch.Tensor], device=None) -> torch.Tensor:
    flat = torch.empty(bucket.numel, dtype=_DTYPES[bucket.dtype], device=device)
    for entry in bucket.entries:
        flat[entry.offset : entry.offset + entry.numel].copy_(tensors[entry.name].reshape(-1))
    return flat


def unpack_bucket(bucket: Bucket, flat: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    for entry in bucket.entries:
        yield entry.name, flat[entry.offset : entry.offset + entry.numel].view(entry.shape)


def broadcast_weights(
    tensors: dict[str, torch.Tensor], group, src: int, bucket_bytes: int = 256 << 20, device=None
) -> Plan:
    """Sender side (global rank `src`): plan, then one broadcast per bucket."""
    plan = plan_buckets(((n, t.dtype, tuple(t.shape)) for n, t in tensors.items()), bucket_bytes)
    _broadcast_bytes(encode_plan(plan), group, src, device)
    for bucket in plan.buckets:
        dist.broadcast(pack_bucket(bucket, tensors, device), src=src, group=group)
    return plan


def receive_weights(group, src: int, device=None) -> Iterator[tuple[str, torch.Tensor]]:
    """Receiver side: yields (name, tensor) as each bucket arrives (views into the bucket)."""
    plan = decode_plan(_broadcast_bytes(None, group, src, device))
    for bucket in plan.buckets:
        flat = torch.empty(bucket.numel, dtype=_DTYPES[bucket.dtype], device=device)
        dist.broadcast(flat, src=src, group=group)
        yield from unpack_bucket(bucket, flat)


def _broadcast_bytes(data: bytes | None, group, src: int, device=None) -> bytes:
    length = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64, device=device)
    dist.broadcast(length, src=src, group=group)
    if data is not None:
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    else:
        payload = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    dist.broadcast(payload, src=src, group=group)
    return bytes(payload.cpu().numpy().tobytes())
