"""The Megatron teacher's HTTP service (aiohttp, on teacher rank 0, in a background thread).

Endpoints (docs/teacher-api.md):
    POST /logprobs  {"batched_token_ids": [[int, ...], ...]}
                    -> {"logprobs": [[null, float, ...], ...]}  (JSON: position 0 is null)
                    with "Accept: application/x-float32-logprobs": float32 bytes, every sequence
                    end to end, position 0 NaN (critic/wire.py `encode_rows`)
    GET  /status    busy flag, phase, counters, model and layout
    GET  /health    {"ok": true}

Everything but the reply is the critic's service (critic/service.py `ModelService`): requests
validated in the service thread (400 naming the problem, with its JSON path), a queue the
teacher's main loop (worker.py) empties into one collective pass of up to
`distillation.teacher.megatron.max_batch_sequences` sequences, each request answered with its own
rows, a failed pass answered 500 for its requests only, the bearer token
(`distillation.teacher.api_key_env`) when one is set.
"""

from __future__ import annotations

import msgspec
from aiohttp import web

from megatron_rl.critic.service import ModelService
from megatron_rl.critic.wire import BINARY_LOGPROBS, encode_rows


class TeacherService(ModelService):
    name = "teacher"
    path = "/logprobs"
    key = "distillation.teacher.megatron"
    token_key = "distillation.teacher.api_key_env"
    legacy = False

    def reply(self, request, result, legacy: bool) -> web.Response:
        """`result`: this request's rows, [T] float32 each (nan at 0)."""
        if BINARY_LOGPROBS in request.headers.get("Accept", ""):
            return web.Response(body=encode_rows(result), content_type=BINARY_LOGPROBS)
        # msgspec writes a non-finite float as null: position 0 of every row
        reply = {"logprobs": [row.tolist() for row in result]}
        return web.Response(body=msgspec.json.encode(reply), content_type="application/json")
