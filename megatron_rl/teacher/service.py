"""The Megatron teacher's HTTP service (aiohttp, on teacher rank 0, in a background thread).

Endpoints (docs/teacher-api.md):
    POST /logprobs  {"batched_token_ids": [[int, ...], ...], "top_k": int (optional, default 0)}
                    -> {"logprobs": [[null, float, ...], ...]}  (JSON: position 0 is null)
                    with "Accept: application/x-float32-logprobs": float32 bytes, every sequence
                    end to end, position 0 NaN (critic/wire.py `encode_rows`)
                    with top_k K > 0 also "top_ids" [[[int] * K, ...], ...] and "top_logprobs"
                    [[[float] * K, ...], ...] (row 0: ids 0, log-probabilities null); with
                    "Accept: application/x-teacher-top-k" all three as bytes (`encode_top_k`)
    GET  /status    busy flag, phase, counters, model and layout
    GET  /health    {"ok": true}

Everything but the body and the reply is the critic's service (critic/service.py `ModelService`):
requests validated in the service thread (400 naming the problem, with its JSON path), a queue
the teacher's main loop (worker.py) empties into one collective pass of up to
`distillation.teacher.megatron.max_batch_sequences` sequences, merging only requests of the same
`top_k` (one pass scores one K: its rows are then bit for bit those of a request scored alone),
each request answered with its own rows, a failed pass answered 500 for its requests only, the
bearer token (`distillation.teacher.api_key_env`) when one is set.
"""

from __future__ import annotations

import msgspec
import numpy as np
from aiohttp import web

from megatron_rl.critic.service import BadRequest, ModelService, check_batch, decode_request
from megatron_rl.critic.wire import BINARY_LOGPROBS, BINARY_TOP_K, encode_rows, encode_top_k
from megatron_rl.data.types import TeacherTopK


class LogprobsRequest(msgspec.Struct, forbid_unknown_fields=True):
    """The /logprobs body: one list of token ids per sequence; `top_k` > 0 also asks for each
    position's `top_k` most likely tokens and their log-probabilities."""

    batched_token_ids: list[list[int]]
    top_k: int = 0


class TeacherService(ModelService):
    name = "teacher"
    path = "/logprobs"
    key = "distillation.teacher.megatron"
    token_key = "distillation.teacher.api_key_env"

    def parse(self, body: bytes) -> tuple[list[list[int]], bool, int]:
        """(sequences, False, top_k) of a /logprobs body, or BadRequest naming what is wrong."""
        request = decode_request(body, LogprobsRequest)
        check_batch(request.batched_token_ids, self.vocab_size, self.seq_len, self.max_batch_sequences, self.name,
                    f"{self.key}.max_batch_sequences")  # fmt: skip
        if not 0 <= request.top_k <= self.vocab_size:
            raise BadRequest(f"top_k is {request.top_k}; expected 0 (log-probabilities only) up to the teacher's "
                             f"vocabulary size {self.vocab_size}")  # fmt: skip
        return request.batched_token_ids, False, request.top_k

    def reply(self, request, result, legacy: bool) -> web.Response:
        """`result`: this request's rows, [T] float32 each (nan at 0), or TeacherTopK each when it
        asked for a top_k."""
        accept = request.headers.get("Accept", "")
        if result and isinstance(result[0], TeacherTopK):
            if BINARY_TOP_K in accept:
                return web.Response(body=encode_top_k(result), content_type=BINARY_TOP_K)
            # msgspec writes a non-finite float as null: position 0 of every row
            reply = {
                "logprobs": [r.logprobs.tolist() for r in result],
                "top_ids": [r.top_ids.tolist() for r in result],
                "top_logprobs": [r.top_logprobs.tolist() for r in result],
            }
            return web.Response(body=msgspec.json.encode(reply), content_type="application/json")
        if BINARY_LOGPROBS in accept:
            return web.Response(body=encode_rows(result), content_type=BINARY_LOGPROBS)
        reply = {"logprobs": [np.asarray(row).tolist() for row in result]}
        return web.Response(body=msgspec.json.encode(reply), content_type="application/json")
