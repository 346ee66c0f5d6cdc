"""Weight broadcast in dtype buckets, with metadata as msgpack bytes (never pickle).

Path (b) of weight publishing: policy rank 0 and the inference workers share one process group
(NCCL on GPU; gloo works the same on CPU), a `WeightUpdateGroup` of its own outside either
side's torch.distributed world. The sender broadcasts the plan (names, dtypes, shapes, offsets
per bucket) as a uint8 tensor preceded by its length, then each bucket as one flat tensor of a
single dtype. `receive_weights` rebuilds (name, tensor) pairs as views into the buckets. A
tensor larger than the bucket size travels in a bucket of its own. One weight update is a
stream of such plans (one per decoder layer and owning policy rank, relayed through policy rank
0) ended by an empty plan (`broadcast_end`), read with `receive_weight_stream`, whose tensors
each own their storage: a consumer that keeps some of them (vLLM's layer-wise reload buffers a
module's tensors until it has all of them) keeps those bytes, not their whole buckets, and each
bucket is freed once its last tensor is copied out.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable, Iterator
from datetime import timedelta

import msgspec
import torch
import torch.distributed as dist

from megatron_rl.transport.broadcast import broadcast_bytes

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


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port) only, listening."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(address)
    sock.listen(1024)
    return sock


class WeightUpdateGroup:
    """A process group of its own: a TCPStore at (host, port) hosted by rank 0, and an NCCL
    (GPU) or gloo (CPU) backend built directly on it, independent of torch.distributed's default
    world on either side (the trainer's ranks and the vLLM workers each have their own)."""

    def __init__(
        self,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        backend: str = "nccl",
        timeout_s: float = 600.0,
        device=None,
    ):
        if backend not in ("nccl", "gloo"):
            raise ValueError(f"weight update group: backend must be 'nccl' or 'gloo', got {backend!r}")
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.device = torch.device(device) if device is not None else None
        timeout = timedelta(seconds=timeout_s)
        # torch's TCPStore server listens on every interface unless handed a socket: rank 0
        # binds (host, port) itself, so the store answers only on the configured address.
        self._listener = listening_socket(host, port) if rank == 0 else None
        self.store = dist.TCPStore(
            host, port, world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=True,
            master_listen_fd=self._listener.fileno() if self._listener is not None else None,
        )  # fmt: skip
        if backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(self.store, rank, world_size, options)
        else:
            self.pg = dist.ProcessGroupGloo(self.store, rank, world_size, timeout)

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = src
        options.rootTensor = 0
        self.pg.broadcast([tensor], options).wait()


def _broadcast(tensor: torch.Tensor, group, src: int) -> None:
    if isinstance(group, WeightUpdateGroup):
        group.broadcast(tensor, src)
    else:
        dist.broadcast(tensor, src=src, group=group)


def _broadcaster(group):
    return lambda tensor, src: _broadcast(tensor, group, src)


def broadcast_weights(
    tensors: dict[str, torch.Tensor], group, src: int, bucket_bytes: int = 256 << 20, device=None
) -> Plan:
    """Sender side (rank `src` of `group`: a WeightUpdateGroup, or a torch.distributed group
    with `src` a global rank): plan, then one broadcast per bucket."""
    plan = plan_buckets(((n, t.dtype, tuple(t.shape)) for n, t in tensors.items()), bucket_bytes)
    broadcast_bytes(encode_plan(plan), src, device=device, broadcast=_broadcaster(group))
    for bucket in plan.buckets:
        _broadcast(pack_bucket(bucket, tensors, device), group, src)
    return plan


def broadcast_end(group, src: int, device=None) -> None:
    """Ends a weight-update stream: an empty plan."""
    broadcast_bytes(
        encode_plan(Plan(version=PLAN_VERSION, buckets=[])), src, device=device, broadcast=_broadcaster(group)
    )


def receive_weights(group, src: int, device=None) -> Iterator[tuple[str, torch.Tensor]]:
    """Receiver side of one `broadcast_weights`: yields (name, tensor) as each bucket arrives
    (views into the bucket)."""
    plan = decode_plan(broadcast_bytes(None, src, device=device, broadcast=_broadcaster(group)))
    for bucket in plan.buckets:
        yield from _receive_bucket(bucket, group, src, device)


def receive_weight_stream(group, src: int, device=None) -> Iterator[tuple[str, torch.Tensor]]:
    """Receiver side of a whole update: (name, tensor) over every plan until the empty plan that
    ends the stream. Each tensor owns its storage (a copy out of its bucket, or the bucket itself
    when it holds that tensor alone); a bucket is freed as soon as its last tensor is copied out,
    before that tensor is handed on."""
    while True:
        plan = decode_plan(broadcast_bytes(None, src, device=device, broadcast=_broadcaster(group)))
        if not plan.buckets:
            return
        for bucket in plan.buckets:
            flat = torch.empty(bucket.numel, dtype=_DTYPES[bucket.dtype], device=device)
            _broadcast(flat, group, src)
            alone = len(bucket.entries) == 1
            for index, entry in enumerate(bucket.entries):
                tensor = flat[entry.offset : entry.offset + entry.numel].view(entry.shape)
                if not alone:
                    tensor = tensor.clone()
                if index == len(bucket.entries) - 1:
                    del flat  # only what was copied out (or the lone tensor's view) holds it now
                yield entry.name, tensor
                del tensor  # the consumer keeps its own reference, or lets it go


def _receive_bucket(bucket: Bucket, group, src: int, device) -> Iterator[tuple[str, torch.Tensor]]:
    flat = torch.empty(bucket.numel, dtype=_DTYPES[bucket.dtype], device=device)
    _broadcast(flat, group, src)
    yield from unpack_bucket(bucket, flat)


def send_weights_p2p(
    tensors: dict[str, torch.Tensor], dst: int, bucket_bytes: int = 256 << 20, device=None
) -> None:
    """Sends a plan and its buckets to global rank `dst` of the default world (point to point):
    how a policy rank that owns tensors hands them to policy rank 0 for relaying."""
    plan = plan_buckets(((n, t.dtype, tuple(t.shape)) for n, t in tensors.items()), bucket_bytes)
    data = encode_plan(plan)
    dist.send(torch.tensor([len(data)], dtype=torch.int64, device=device), dst=dst)
    dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device), dst=dst)
    for bucket in plan.buckets:
        dist.send(pack_bucket(bucket, tensors, device), dst=dst)


def relay_weights_p2p(src: int, group, root: int, device=None) -> int:
    """On the relaying rank: receives what global rank `src` sends with `send_weights_p2p` and
    broadcasts it, bucket by bucket, as rank `root` of `group`. Returns the tensor count."""
    length = torch.zeros(1, dtype=torch.int64, device=device)
    dist.recv(length, src=src)
    payload = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    dist.recv(payload, src=src)
    data = bytes(payload.cpu().numpy().tobytes())
    plan = decode_plan(data)
    broadcast_bytes(data, root, device=device, broadcast=_broadcaster(group))
    for bucket in plan.buckets:
        flat = torch.empty(bucket.numel, dtype=_DTYPES[bucket.dtype], device=device)
        dist.recv(flat, src=src)
        _broadcast(flat, group, root)
    return sum(len(b.entries) for b in plan.buckets)
