"""HttpValueScorer's network behaviour against small local aiohttp servers: timeouts, retries
on 503 and on a server that starts late, reply validation. (The real critic service is tested
in tests/distributed/test_critic_service.py.)"""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from megatron_rl.critic.client import CriticError, CriticTimeout, HttpValueScorer
from megatron_rl.parallel import free_port

REPLY = {"values": [[0.0, 0.5]], "bootstrap_values": [0.25], "step": 3}


async def serve(port: int, handler) -> web.AppRunner:
    app = web.Application()
    app.router.add_post("/score", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


def test_timeout_names_the_url():
    async def slow(request):
        await asyncio.sleep(2)
        return web.json_response(REPLY)

    async def run():
        port = free_port()
        runner = await serve(port, slow)
        scorer = HttpValueScorer(f"http://127.0.0.1:{port}", timeout_s=0.3)
        try:
            with pytest.raises(CriticTimeout, match=f"127.0.0.1:{port}/score: no reply within 0.3s"):
                await scorer.score([[1, 2]])
        finally:
            await scorer.close()
            await runner.cleanup()

    asyncio.run(run())


def test_retries_503_and_a_server_that_starts_late():
    calls = []

    async def flaky(request):
        calls.append(1)
        if len(calls) < 3:
            return web.json_response({"error": "the critic is shutting down"}, status=503)
        return web.json_response(REPLY)

    async def run():
        port = free_port()
        scorer = HttpValueScorer(f"http://127.0.0.1:{port}", retries=6, backoff_s=0.1)
        task = asyncio.create_task(scorer.score([[1, 2]]))
        await asyncio.sleep(0.35)  # refused connections meanwhile
        runner = await serve(port, flaky)
        try:
            return await task
        finally:
            await scorer.close()
            await runner.cleanup()

    result = asyncio.run(run())
    assert len(calls) == 3 and result.step == 3 and result.bootstrap_values == [0.25]
    assert result.values[0].tolist() == [0.0, 0.5]


def test_reply_breaking_the_contract_is_an_error():
    async def wrong(request):
        return web.json_response({"values": [[0.0]]})

    async def run():
        port = free_port()
        runner = await serve(port, wrong)
        scorer = HttpValueScorer(f"http://127.0.0.1:{port}")
        try:
            with pytest.raises(CriticError, match="does not follow the contract"):
                await scorer.score([[1]])
        finally:
            await scorer.close()
            await runner.cleanup()

    asyncio.run(run())
