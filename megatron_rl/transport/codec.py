"""Wire format for one grid item (a data rank's micro-batches for one step). Never pickle.

Frames: [header, buffer, buffer, ...]. The header is msgpack:
    {"format": "megatron_rl.grid", "version": 5, "step", "data_rank", "num_micro_steps",
     "micro_batches": [{"is_dummy", "minibatch", "arrays": [{"name", "dtype", "shape", "nbytes", "crc32"}]}]}
followed by one raw buffer per array, in header order. Every array is one-dimensional except a
policy grid's `routes` under routing replay ([N, moe_layers, top_k] uint8 or uint16, sent with
`routed`, [N] bool). Under on-policy distillation's kl_penalty the policy's micro-batches (not
the dummies) also carry `teacher_logprobs` ([N] float32, finite); under top_k_kl
`teacher_top_ids` ([N, K] int32, in the vocabulary) and `teacher_top_logprobs` ([N, K] float32,
finite, <= 0), both or neither.
"""

from __future__ import annotations

import zlib

import msgspec
import numpy as np

from megatron_rl.data.types import MicroBatch

FORMAT = "megatron_rl.grid"
# 2: micro-batches carry their policy mini-batch; 3: and may carry routes; 4: teacher log-probs; 5: teacher top k
VERSION = 5
_ALLOWED_DTYPES = {"int64", "int32", "float32", "float64", "bool", "uint8", "uint16"}


class TransportError(RuntimeError):
    """A grid item could not be delivered or decoded; the message names endpoint and step."""


class TransportTimeout(TransportError):
    pass


class _ArraySpec(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    dtype: str
    shape: list[int]
    nbytes: int
    crc32: int


class _BatchSpec(msgspec.Struct, forbid_unknown_fields=True):
    is_dummy: bool
    minibatch: int
    arrays: list[_ArraySpec]


class _Header(msgspec.Struct, forbid_unknown_fields=True):
    format: str
    version: int
    step: int
    data_rank: int
    num_micro_steps: int
    micro_batches: list[_BatchSpec]


def encode_grid_item(step: int, data_rank: int, micro_batches: list[MicroBatch]) -> list:
    """Frames for one data rank's micro-batches (buffers are zero-copy views of the arrays)."""
    buffers, specs = [], []
    for mb in micro_batches:
        arrays = []
        for name, array in mb.arrays().items():
            array = np.ascontiguousarray(array)
            view = memoryview(array.reshape(-1)).cast("B")  # flat first: a cast refuses a 0 in a shape of 2+ dims
            arrays.append(_ArraySpec(name, array.dtype.name, list(array.shape), array.nbytes, zlib.crc32(view)))
            buffers.append(view)
        specs.append(_BatchSpec(mb.is_dummy, mb.minibatch, arrays))
    header = _Header(FORMAT, VERSION, step, data_rank, len(micro_batches), specs)
    return [msgspec.msgpack.encode(header), *buffers]


# Every MicroBatch array, its dtype; all are one-dimensional, cu_seqlens [S + 1], the rest [N].
ARRAY_DTYPES = {
    "input_ids": "int64", "position_ids": "int64", "cu_seqlens": "int32", "loss_mask": "bool",
    "advantages": "float32", "returns": "float32", "old_values": "float32", "inference_logprobs": "float32",
    "sample_index": "int64",
}  # fmt: skip
# The arrays a policy grid under routing replay adds (both or neither), their dtypes.
ROUTE_ARRAYS = {"routes": ("uint8", "uint16"), "routed": ("bool",)}
# What a policy grid under distillation's kl_penalty adds.
TEACHER_ARRAYS = {"teacher_logprobs": ("float32",)}
# What a policy grid under distillation's top_k_kl adds (both or neither; [N, K] each).
TEACHER_TOP_K_ARRAYS = {"teacher_top_ids": ("int32",), "teacher_top_logprobs": ("float32",)}
# A teacher's log-probability above this (float rounding of log 1) is refused.
MAX_TEACHER_LOGPROB = 1e-4
# The number of dimensions of every array that is not one-dimensional.
ARRAY_DIMS = {"routes": 3, "teacher_top_ids": 2, "teacher_top_logprobs": 2}


def decode_grid_item(
    frames: list, where: str, step: int, data_rank: int, vocab_size: int | None = None,
    num_experts: int | None = None,
) -> list[MicroBatch]:
    """Validates and decodes frames; raises TransportError naming `where`, step and what is wrong.

    Besides the header, byte counts, checksums and dtypes, every micro-batch must be a possible
    packed row: all nine arrays, one-dimensional, the per-token ones of one length; `cu_seqlens`
    starts at 0, increases and ends inside the row; positions restart at 0 for every sequence;
    padding after the last sequence is masked; the mask is 0/1; float arrays are finite; token
    ids lie in the vocabulary (when `vocab_size` is given); routes, when sent, are [N, layers, k]
    with distinct experts per token and layer, below `num_experts` when given; the teacher's top
    k, when sent, as `_check_teacher_top_k`. Nothing invalid reaches a model."""
    context = f"{where}: grid item for step {step}, data rank {data_rank}"
    if not frames:
        raise TransportError(f"{context}: empty message")
    try:
        header = msgspec.msgpack.decode(bytes(frames[0]), type=_Header)
    except msgspec.ValidationError as exc:
        raw = _loose_header(frames[0])
        if isinstance(raw, dict) and raw.get("format") == FORMAT and raw.get("version") != VERSION:
            raise TransportError(
                f"{context}: wrong format version {raw.get('version')!r} (this receiver reads version {VERSION})"
            ) from None
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise TransportError(f"{context}: not a {FORMAT} frame") from None
        raise TransportError(f"{context}: malformed header ({exc})") from None
    except msgspec.DecodeError as exc:
        raise TransportError(f"{context}: corrupt header ({exc})") from None
    if header.format != FORMAT:
        raise TransportError(f"{context}: not a {FORMAT} frame")
    if header.version != VERSION:
        raise TransportError(
            f"{context}: wrong format version {header.version!r} (this receiver reads version {VERSION})"
        )
    if header.step != step or header.data_rank != data_rank:
        raise TransportError(f"{context}: frame is for step {header.step}, data rank {header.data_rank}")
    batches = header.micro_batches
    expected_buffers = sum(len(b.arrays) for b in batches)
    if len(batches) != header.num_micro_steps or len(frames) - 1 != expected_buffers:
        raise TransportError(
            f"{context}: truncated message: {len(frames) - 1} buffers for {expected_buffers} arrays "
            f"in {header.num_micro_steps} micro-steps"
        )
    out, position = [], 1
    for index, batch in enumerate(batches):
        where_mb = f"{context}: micro-step {index}"
        if batch.minibatch < 0 or (index and batch.minibatch < batches[index - 1].minibatch):
            raise TransportError(
                f"{where_mb}: mini-batch {batch.minibatch} after {batches[index - 1].minibatch if index else 'none'} "
                "(mini-batches are numbered from 0 and come in order)"
            )
        names = [spec.name for spec in batch.arrays]
        expected = sorted(ARRAY_DTYPES) + (sorted(ROUTE_ARRAYS) if set(ROUTE_ARRAYS) & set(names) else [])
        expected += sorted(TEACHER_ARRAYS) if set(TEACHER_ARRAYS) & set(names) else []
        expected += sorted(TEACHER_TOP_K_ARRAYS) if set(TEACHER_TOP_K_ARRAYS) & set(names) else []
        if sorted(names) != sorted(expected):
            missing, extra = sorted(set(expected) - set(names)), sorted(set(names) - set(expected))
            raise TransportError(f"{where_mb}: arrays missing {missing}, unexpected {extra}, repeated "
                                 f"{sorted({n for n in names if names.count(n) > 1})}")  # fmt: skip
        fields = {}
        for spec in batch.arrays:
            buffer = memoryview(frames[position]).cast("B")
            position += 1
            name = spec.name
            allowed = (ROUTE_ARRAYS.get(name) or TEACHER_ARRAYS.get(name) or TEACHER_TOP_K_ARRAYS.get(name)
                       or (ARRAY_DTYPES.get(name),))  # fmt: skip
            if spec.dtype not in _ALLOWED_DTYPES or spec.dtype not in allowed:
                raise TransportError(
                    f"{where_mb} array {name}: unexpected dtype {spec.dtype!r} (expected {' or '.join(allowed)})"
                )
            if buffer.nbytes != spec.nbytes:
                raise TransportError(f"{where_mb} array {name}: {buffer.nbytes} bytes, header says {spec.nbytes}")
            dims = ARRAY_DIMS.get(name, 1)
            if (len(spec.shape) != dims or min(spec.shape) < 0
                    or int(np.prod(spec.shape)) * np.dtype(spec.dtype).itemsize != spec.nbytes):  # fmt: skip
                raise TransportError(
                    f"{where_mb} array {name}: impossible shape {spec.shape} for {spec.nbytes} bytes of {spec.dtype}"
                )
            if zlib.crc32(buffer) != spec.crc32:
                raise TransportError(f"{where_mb} array {name}: checksum mismatch (corrupt data)")
            fields[name] = np.frombuffer(buffer, dtype=spec.dtype).reshape(spec.shape).copy()
        _check_row(fields, batch.is_dummy, vocab_size, where_mb)
        if "routes" in fields:
            _check_routes(fields["routes"], fields["routed"], num_experts, where_mb)
        if "teacher_top_ids" in fields:
            _check_teacher_top_k(fields["teacher_top_ids"], fields["teacher_top_logprobs"], vocab_size, where_mb)
        out.append(MicroBatch(**fields, is_dummy=batch.is_dummy, minibatch=batch.minibatch))
    return out


def _check_routes(routes: np.ndarray, routed: np.ndarray, num_experts: int | None, where: str) -> None:
    """Raises TransportError unless every token's experts in every layer are distinct (replay
    dispatches each token to k experts) and below `num_experts`, and `routed` is 0/1. A layer
    whose k entries are all 0 has no routes: a dense layer (DeepSeek-V3's and GLM-4.5's first
    layers), which vLLM's capture leaves 0 and replay skips."""
    if np.any(routed.view(np.uint8) > 1):
        raise TransportError(f"{where} array routed: values other than 0/1")
    if not routes.size:
        return
    if num_experts is not None and int(routes.max()) >= num_experts:
        raise TransportError(f"{where} array routes: expert {int(routes.max())} of a model with {num_experts} experts")
    ordered = np.sort(routes, axis=-1)
    unrouted = ~ordered.any(axis=-1)  # [tokens, layers]: a dense layer's zeros
    repeated = ((ordered[..., 1:] == ordered[..., :-1]).any(axis=-1) & ~unrouted).any(axis=1)  # per token
    if repeated.any():
        token = int(np.flatnonzero(repeated)[0])
        raise TransportError(f"{where} array routes: token {token} repeats an expert within a layer")


def _check_teacher_top_k(top_ids: np.ndarray, top_logprobs: np.ndarray, vocab_size: int | None, where: str) -> None:
    """Raises TransportError naming the array unless both are [N, K] with one K >= 1, the ids lie
    in the vocabulary (0..vocab_size - 1 when given) and the log-probabilities are finite and at
    most MAX_TEACHER_LOGPROB (log 1 plus rounding)."""
    k = top_ids.shape[1]
    if k < 1 or top_logprobs.shape[1] != k:
        raise TransportError(
            f"{where} array teacher_top_logprobs: {top_logprobs.shape[1]} columns, teacher_top_ids has {k} "
            "(both [N, K], K >= 1)"
        )
    if top_ids.size and (top_ids.min() < 0 or (vocab_size is not None and top_ids.max() >= vocab_size)):
        vocabulary = f"0..{vocab_size - 1}" if vocab_size is not None else "ids >= 0"
        raise TransportError(
            f"{where} array teacher_top_ids: ids {int(top_ids.min())}..{int(top_ids.max())} outside the vocabulary "
            f"{vocabulary}"
        )
    if not np.isfinite(top_logprobs).all():
        raise TransportError(f"{where} array teacher_top_logprobs: non-finite values")
    if top_logprobs.size and top_logprobs.max() > MAX_TEACHER_LOGPROB:
        raise TransportError(
            f"{where} array teacher_top_logprobs: log-probability {float(top_logprobs.max()):.3g} above 0 (at most {MAX_TEACHER_LOGPROB})"
        )


def _loose_header(frame):
    try:
        return msgspec.msgpack.decode(bytes(frame))
    except msgspec.DecodeError:
        return None


def _check_row(fields: dict, is_dummy: bool, vocab_size: int | None, where: str) -> None:
    """Raises TransportError naming the array when `fields` cannot be a packed row."""
    n = len(fields["input_ids"])
    for name, array in fields.items():
        if name != "cu_seqlens" and len(array) != n:
            raise TransportError(f"{where} array {name}: {len(array)} entries, input_ids has {n}")
    cu = fields["cu_seqlens"].astype(np.int64)
    if len(cu) < 1 or cu[0] != 0 or np.any(np.diff(cu) <= 0) or cu[-1] > n:
        raise TransportError(
            f"{where} array cu_seqlens: {cu.tolist()[:12]} must start at 0, increase and end within the row ({n} tokens)"
        )
    expected = np.zeros(n, dtype=np.int64)
    for start, end in zip(cu[:-1], cu[1:]):
        expected[start:end] = np.arange(end - start)
    positions = fields["position_ids"]
    if not np.array_equal(positions[: cu[-1]], expected[: cu[-1]]):
        bad = int(np.flatnonzero(positions[: cu[-1]] != expected[: cu[-1]])[0])
        raise TransportError(f"{where} array position_ids: token {bad} has position {positions[bad]}, "
                             f"expected {expected[bad]} (positions restart at 0 for every sequence)")  # fmt: skip
    mask_bytes = fields["loss_mask"].view(np.uint8)
    if np.any(mask_bytes > 1):
        raise TransportError(f"{where} array loss_mask: values other than 0/1")
    if fields["loss_mask"][cu[-1] :].any() or (is_dummy and fields["loss_mask"].any()):
        raise TransportError(f"{where} array loss_mask: padding{' of a dummy micro-batch' if is_dummy else ''} is unmasked")
    ids = fields["input_ids"]
    if n and (ids.min() < 0 or (vocab_size is not None and ids.max() >= vocab_size)):
        raise TransportError(
            f"{where} array input_ids: ids {int(ids.min())}..{int(ids.max())} outside the vocabulary 0..{(vocab_size or 0) - 1}"
            if vocab_size is not None else f"{where} array input_ids: negative id {int(ids.min())}"
        )  # fmt: skip
    if n and fields["sample_index"].min() < -1:
        raise TransportError(f"{where} array sample_index: {int(fields['sample_index'].min())} below -1")
    for name in ("advantages", "returns", "old_values", "inference_logprobs", *TEACHER_ARRAYS):
        if name in fields and not np.isfinite(fields[name]).all():
            raise TransportError(f"{where} array {name}: non-finite values")
