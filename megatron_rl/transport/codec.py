"""Wire format for one grid item (a data rank's micro-batches for one step). Never pickle.

Frames: [header, buffer, buffer, ...]. The header is msgpack:
    {"format": "megatron_rl.grid", "version": 1, "step", "data_rank", "num_micro_steps",
     "micro_batches": [{"is_dummy", "arrays": [{"name", "dtype", "shape", "nbytes", "crc32"}]}]}
followed by one raw buffer per array, in header order.
"""

from __future__ import annotations

import zlib

import msgspec
import numpy as np

from megatron_rl.data.types import MicroBatch

FORMAT = "megatron_rl.grid"
VERSION = 1
_ALLOWED_DTYPES = {"int64", "int32", "float32", "float64", "bool"}


class TransportError(RuntimeError):
    """A grid item could not be delivered or decoded; the message names endpoint and step."""


class TransportTimeout(TransportError):
    pass


def encode_grid_item(step: int, data_rank: int, micro_batches: list[MicroBatch]) -> list:
    """Frames for one data rank's micro-batches (buffers are zero-copy views of the arrays)."""
    buffers, header_batches = [], []
    for mb in micro_batches:
        arrays = []
        for name, array in mb.arrays().items():
            array = np.ascontiguousarray(array)
            view = memoryview(array).cast("B")
            arrays.append(
                {
                    "name": name,
                    "dtype": array.dtype.name,
                    "shape": list(array.shape),
                    "nbytes": array.nbytes,
                    "crc32": zlib.crc32(view),
                }
            )
            buffers.append(view)
        header_batches.append({"is_dummy": mb.is_dummy, "arrays": arrays})
    header = {
        "format": FORMAT,
        "version": VERSION,
        "step": step,
        "data_rank": data_rank,
        "num_micro_steps": len(micro_batches),
        "micro_batches": header_batches,
    }
    return [msgspec.msgpack.encode(header), *buffers]


def decode_grid_item(frames: list, where: str, step: int, data_rank: int) -> list[MicroBatch]:
    """Validates and decodes frames; raises TransportError naming `where`, step and what is wrong."""
    context = f"{where}: grid item for step {step}, data rank {data_rank}"
    if not frames:
        raise TransportError(f"{context}: empty message")
    try:
        header = msgspec.msgpack.decode(bytes(frames[0]))
    except msgspec.DecodeError as exc:
        raise TransportError(f"{context}: corrupt header ({exc})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise TransportError(f"{context}: not a {FORMAT} frame")
    if header.get("version") != VERSION:
        raise TransportError(
            f"{context}: wrong format version {header.get('version')!r} (this receiver reads version {VERSION})"
        )
    if header.get("step") != step or header.get("data_rank") != data_rank:
        raise TransportError(
            f"{context}: frame is for step {header.get('step')}, data rank {header.get('data_rank')}"
        )
    batches = header.get("micro_batches", [])
    expected_buffers = sum(len(b["arrays"]) for b in batches)
    if len(batches) != header.get("num_micro_steps") or len(frames) - 1 != expected_buffers:
        raise TransportError(
            f"{context}: truncated message: {len(frames) - 1} buffers for {expected_buffers} arrays "
            f"in {header.get('num_micro_steps')} micro-steps"
        )
    out, position = [], 1
    for index, batch in enumerate(batches):
        fields = {}
        for spec in batch["arrays"]:
            buffer = memoryview(frames[position]).cast("B")
            position += 1
            name = spec["name"]
            if spec["dtype"] not in _ALLOWED_DTYPES:
                raise TransportError(
                    f"{context}: micro-step {index} array {name}: unexpected dtype {spec['dtype']!r}"
                )
            if buffer.nbytes != spec["nbytes"]:
                raise TransportError(
                    f"{context}: micro-step {index} array {name}: {buffer.nbytes} bytes, header says {spec['nbytes']}"
                )
            if zlib.crc32(buffer) != spec["crc32"]:
                raise TransportError(
                    f"{context}: micro-step {index} array {name}: checksum mismatch (corrupt data)"
                )
            fields[name] = np.frombuffer(buffer, dtype=spec["dtype"]).reshape(spec["shape"]).copy()
        try:
            out.append(MicroBatch(**fields, is_dummy=bool(batch["is_dummy"])))
        except TypeError as exc:
            raise TransportError(f"{context}: micro-step {index}: {exc}") from None
    return out
