"""The binary /score reply (docs/critic-api.md): what the orchestrator's client asks for with
`Accept: application/x-float32-values` instead of JSON; and the Megatron teacher's binary
/logprobs reply (`Accept: application/x-float32-logprobs`, docs/teacher-api.md): every
sequence's log-probabilities end to end, float32 little-endian (`encode_rows`, `decode_rows`);
and its reply with a request's `top_k` (`Accept: application/x-teacher-top-k`: `encode_top_k`,
`decode_top_k`): for the whole reply, every sequence end to end, the log-probabilities float32
[sum T], then the top ids int32 [sum T, K], then their log-probabilities float32 [sum T, K],
all little-endian: 4 (1 + 2K) bytes a token.

The body is little-endian float32: first the bootstrap value of each sequence, then the values
of every sequence end to end, in request order (the client knows the lengths: they are its own
request's). The last critic step trained is in the `X-Critic-Step` header. Four bytes a value
against about twenty in JSON, and no float parsing: the values are float32 on the critic's
side, so both encodings carry exactly the same numbers.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from megatron_rl.data.types import ScoreResult, TeacherTopK

BINARY_VALUES = "application/x-float32-values"
STEP_HEADER = "X-Critic-Step"
BINARY_LOGPROBS = "application/x-float32-logprobs"
BINARY_TOP_K = "application/x-teacher-top-k"


def encode_rows(rows: Sequence[np.ndarray]) -> bytes:
    """Every row's float32 values end to end, little-endian."""
    return np.concatenate([np.asarray(r, dtype="<f4") for r in rows] or [np.empty(0, "<f4")]).tobytes()


def decode_rows(payload: bytes, lengths: Sequence[int]) -> list[np.ndarray]:
    """Rows of `lengths` float32 values from `encode_rows`' bytes; ValueError naming the sizes
    when the body does not hold exactly that many."""
    total = int(sum(lengths))
    if len(payload) != 4 * total:
        raise ValueError(
            f"binary reply of {len(payload)} bytes; {len(lengths)} sequences of {total} tokens need {4 * total} "
            "(4 bytes a token)"
        )
    flat = np.frombuffer(payload, dtype="<f4").astype(np.float32)  # one writable copy
    return list(np.split(flat, np.cumsum(lengths)[:-1])) if len(lengths) else []


def encode_top_k(results: Sequence[TeacherTopK]) -> bytes:
    """The binary top-k body of `results` (one K for all): every sequence's log-probabilities,
    then every sequence's top ids, then every sequence's top log-probabilities."""
    logprobs = [np.asarray(r.logprobs, dtype="<f4") for r in results]
    ids = [np.asarray(r.top_ids, dtype="<i4").reshape(-1) for r in results]
    top = [np.asarray(r.top_logprobs, dtype="<f4").reshape(-1) for r in results]
    return b"".join(np.concatenate(part or [np.empty(0, "<f4")]).tobytes() for part in (logprobs, ids, top))


def decode_top_k(payload: bytes, lengths: Sequence[int], k: int) -> list[TeacherTopK]:
    """TeacherTopK of sequences of `lengths` tokens with `k` tokens a position from
    `encode_top_k`'s bytes; ValueError naming the sizes when the body does not hold exactly that
    many values."""
    total = int(sum(lengths))
    expected = 4 * total * (1 + 2 * k)
    if len(payload) != expected:
        raise ValueError(
            f"binary top-k reply of {len(payload)} bytes; {len(lengths)} sequences of {total} tokens with top_k {k} "
            f"need {expected} (4 * (1 + 2 * {k}) bytes a token)"
        )
    if not lengths:
        return []
    logprobs = np.frombuffer(payload, dtype="<f4", count=total).astype(np.float32)
    ids = np.frombuffer(payload, dtype="<i4", count=total * k, offset=4 * total).astype(np.int32).reshape(total, k)
    top = np.frombuffer(payload, dtype="<f4", count=total * k, offset=4 * total * (1 + k)).astype(np.float32)
    top = top.reshape(total, k)
    splits = np.cumsum(lengths)[:-1]
    return [TeacherTopK(logprobs=a, top_ids=b, top_logprobs=c)
            for a, b, c in zip(np.split(logprobs, splits), np.split(ids, splits), np.split(top, splits))]  # fmt: skip


def encode_values(result: ScoreResult) -> bytes:
    """The binary body of `result` (bootstrap values, then every sequence's values)."""
    parts = [np.asarray(result.bootstrap_values, dtype="<f4")]
    parts += [np.asarray(v, dtype="<f4") for v in result.values]
    return np.concatenate(parts).tobytes()


def decode_values(payload: bytes, lengths: Sequence[int], step: int) -> ScoreResult:
    """A ScoreResult from a binary body for sequences of `lengths` tokens; ValueError naming
    the sizes when the body does not hold exactly that many values."""
    count, total = len(lengths), int(sum(lengths))
    expected = 4 * (count + total)
    if len(payload) != expected:
        raise ValueError(
            f"binary reply of {len(payload)} bytes; {count} sequences of {total} tokens need {expected} "
            f"(4 bytes for each bootstrap value and each value)"
        )
    flat = np.frombuffer(payload, dtype="<f4").astype(np.float32)  # one writable copy
    bootstrap = flat[:count].tolist()
    values = np.split(flat[count:], np.cumsum(lengths)[:-1]) if count else []
    return ScoreResult(values=list(values), bootstrap_values=bootstrap, step=step)
