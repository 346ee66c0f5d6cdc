"""Bytes from one rank to every rank of a group, in tensors (no pickle). Imports only torch:
vLLM workers load it through weight_buckets.py."""

from __future__ import annotations

import torch
import torch.distributed as dist


def broadcast_bytes(data: bytes | None, src: int, group=None, device=None, broadcast=None) -> bytes:
    """Rank `src`'s `data` on every rank of `group`: its length (int64), then its bytes (uint8),
    in tensors on `device` (CPU by default; CUDA for NCCL groups), never pickle; the other ranks
    pass None. `broadcast(tensor, src)` stands in for torch.distributed.broadcast on groups of our own
    (a WeightUpdateGroup)."""
    send = broadcast or (lambda tensor, root: dist.broadcast(tensor, src=root, group=group))
    length = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64, device=device)
    send(length, src)
    size = int(length.item())
    if data is not None and size:
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    else:
        payload = torch.empty(size, dtype=torch.uint8, device=device)
    if size:
        send(payload, src)
    return bytes(payload.cpu().numpy().tobytes())
