"""The binary /score reply (docs/critic-api.md): what the orchestrator's client asks for with
`Accept: application/x-float32-values` instead of JSON; and the Megatron teacher's binary
/logprobs reply (`Accept: application/x-float32-logprobs`, docs/teacher-api.md): every
sequence's log-probabilities end to end, float32 little-endian (`encode_rows`, `decode_rows`).

The body is little-endian float32: first the bootstrap value of each sequence, then the values
of every sequence end to end, in request order (the client knows the lengths: they are its own
request's). The last critic step trained is in the `X-Critic-Step` header. Four bytes a value
against about twenty in JSON, and no float parsing: the values are float32 on the critic's
side, so both encodings carry exactly the same numbers.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from megatron_rl.data.types import ScoreResult

BINARY_VALUES = "application/x-float32-values"
STEP_HEADER = "X-Critic-Step"
BINARY_LOGPROBS = "application/x-float32-logprobs"


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
