"""A stand-in for a vLLM OpenAI server, for router and pool tests (aiohttp, its own process).

`fake_vllm_command("--port", P, ...)` (this file run by the test's Python, from any directory):
`--port P --name W [--model M] [--start-delay S]
[--health-delay S] [--completion-delay S] [--completion-status N]` serves `GET /v1/models` (model M), `GET /health`
(answering after `--health-delay` seconds), `POST /v1/completions` (a deterministic completion
whose first token id is the worker's number, so a test knows which worker answered) and the
dev-mode admin endpoints. It starts listening only after `--start-delay` seconds (a worker that
comes up late). `POST /fault {"health_status": 503}` makes /health answer that status.
Every request is appended to `--record FILE` as a JSON line (path, session header, time).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

from aiohttp import web


def fake_vllm_command(*args) -> list[str]:
    """The command line of a stand-in server with `args` (a server's `command=`)."""
    return [sys.executable, str(Path(__file__).resolve()), *map(str, args)]


def make_app(args) -> web.Application:
    state = {"health_status": 200, "paused": False, "version": 0}

    def record(request, extra=None):
        if args.record:
            with open(args.record, "a") as f:
                line = {"worker": args.name, "path": request.path, "time": time.time(),
                        "session": request.headers.get("x-session-id"), **(extra or {})}  # fmt: skip
                f.write(json.dumps(line) + "\n")

    async def models(request):
        record(request)
        return web.json_response({"object": "list", "data": [{"id": args.model, "object": "model"}]})

    async def health(request):
        record(request)
        await asyncio.sleep(args.health_delay)
        return web.Response(status=state["health_status"])

    async def completions(request):
        body = await request.json()
        record(request, {"prompt": body.get("prompt")})
        await asyncio.sleep(args.completion_delay)
        if args.completion_status != 200:  # as the router answers when it could not reach a worker
            url = f"http://127.0.0.1:{args.port}/v1/completions"
            return web.Response(
                status=args.completion_status, text=f"Request failed: error sending request for url ({url})"
            )
        n = int(body.get("max_tokens", 4))
        tokens = [args.number] + [(args.number + i) % 50 + 1 for i in range(1, n)]
        choice = {
            "index": 0,
            "text": "",
            "token_ids": tokens,
            "finish_reason": "length",
            "logprobs": {"token_logprobs": [-0.5] * n, "tokens": [f"token_id:{t}" for t in tokens]},
        }
        return web.json_response({"id": "cmpl-fake", "object": "text_completion", "model": args.model,
                                  "choices": [choice], "prompt_token_ids": body.get("prompt")})  # fmt: skip

    async def admin(request):
        record(request)
        if request.path == "/pause":
            state["paused"] = True
        elif request.path == "/resume":
            state["paused"] = False
        elif request.path == "/reset_prefix_cache":  # vLLM's reply: whether the cache was emptied
            return web.json_response({"success": True})
        return web.json_response({})

    async def is_paused(request):
        return web.json_response({"is_paused": state["paused"]})

    async def fault(request):
        state.update(await request.json())
        return web.json_response(state)

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_post("/v1/completions", completions)
    for path in ("/pause", "/resume", "/reset_prefix_cache", "/collective_rpc"):
        app.router.add_post(path, admin)
    app.router.add_get("/is_paused", is_paused)
    app.router.add_post("/fault", fault)
    return app


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--number", type=int, default=1)
    parser.add_argument("--model", default="fake-model")
    parser.add_argument("--start-delay", type=float, default=0.0)
    parser.add_argument("--health-delay", type=float, default=0.0)
    parser.add_argument("--completion-delay", type=float, default=0.0)
    parser.add_argument("--completion-status", type=int, default=200)
    parser.add_argument("--record", default=None)
    args = parser.parse_args(argv)
    time.sleep(args.start_delay)
    web.run_app(make_app(args), host="127.0.0.1", port=args.port, print=None)


if __name__ == "__main__":
    main()
