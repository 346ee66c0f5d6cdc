"""vllm-router (the vLLM project's Rust router, PyPI `vllm-router`) in front of the vLLM servers.

`VllmRouter(worker_urls, port, log_path, settings)` starts the router process only when called,
which the pool does after every worker answers `GET /v1/models`. Its options, and why:

- `--policy consistent_hash --request-id-headers x-session-id`: every turn of one multi-turn
  rollout carries the same session header and so reaches the same worker (its KV cache holds the
  prefix); single-turn rollouts carry a header per rollout, which spreads them over the workers;
- `--health-check-timeout-secs 30`, `--health-failure-threshold` > 1: a worker busy with a long
  batch answers health checks slowly and must not be dropped for it; one that answers 503 or
  dies is dropped after that many failed checks (and at once by the circuit breaker);
- `--request-timeout-secs`, `--queue-size`, `--queue-timeout-secs`, `--max-concurrent-requests`
  sized from the config: the defaults (60 s queue timeout, queue of 100) are too small for RL
  batches;
- `--prometheus-port` on a free loopback port (`megatron_rl.ports.free_port`): the default 29000 collides between two
  routers on one machine;
- its log level (`logging.inference_level`, WARNING by default) as `RUST_LOG` as well as
  `--log-level`: vllm-router 0.1.17 ignores `--log-level warning` and logs at INFO, three lines
  per routed request; `RUST_LOG` is what its Rust logger reads.
  It writes ANSI colour codes whatever its output is (`NO_COLOR` too), so it is started through
  `python -m megatron_rl.inference.router --rust-log LEVEL -- vllm-router ...` (`exec_plain`),
  which passes its output through a pipe to a forked copy of itself that strips them: the log
  file holds plain text. The router keeps the pid (exec).

`add_worker(url)` / `remove_worker(url)` / `workers()` use the router's own worker API; the weight
sync removes a server whose weights are behind and adds it back once it is up to date. The
process renames itself `vllm::router`; it runs in its own process group and is stopped by pid.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

from megatron_rl.inference.vllm_server import ServerStartError, log_tail
from megatron_rl.lifetime import bound_to_parent
from megatron_rl.ports import free_port

SESSION_HEADER = "x-session-id"

# vllm-router's ANSI escape sequences: CSI, ESC [ parameters intermediates final byte
ANSI_ESCAPE = re.compile(rb"\x1b\[[0-?]*[ -/]*[@-~]")
# logging.inference_level -> (vllm-router --log-level, RUST_LOG)
ROUTER_LEVELS = {"DEBUG": ("debug", "debug"), "INFO": ("info", "info"), "WARNING": ("warning", "warn"),
                 "ERROR": ("error", "error")}  # fmt: skip


@dataclass(frozen=True)
class RouterSettings:
    policy: str = "consistent_hash"
    request_timeout_s: int = 3600
    health_check_timeout_s: int = 30
    health_check_interval_s: int = 10
    health_failure_threshold: int = 3
    worker_startup_timeout_s: int = 1800
    max_concurrent_requests: int = 4096
    queue_size: int = 4096
    queue_timeout_s: int = 3600
    api_key: str | None = None
    log_level: str = "WARNING"  # logging.inference_level


def router_executable() -> list[str]:
    """The `vllm-router` command of this environment."""
    beside = Path(sys.executable).with_name("vllm-router")
    if beside.exists():
        return [str(beside)]
    found = shutil.which("vllm-router")
    if found:
        return [found]
    raise ServerStartError(
        "vllm-router is not installed: pip install vllm-router (it is in megatron_rl's gpu and cpu extras)"
    )


def router_command(
    worker_urls: list[str], host: str, port: int, metrics_port: int, settings: RouterSettings
) -> list[str]:
    if settings.log_level not in ROUTER_LEVELS:
        raise ValueError(
            f"router log_level must be one of {sorted(ROUTER_LEVELS)}, got {settings.log_level!r}"
        )
    if settings.health_failure_threshold < 2:
        raise ValueError(
            f"router health_failure_threshold must be above 1 (got {settings.health_failure_threshold}): "
            "one slow health check must not drop a busy worker"
        )
    flag, rust_log = ROUTER_LEVELS[settings.log_level]
    command = [sys.executable, "-m", "megatron_rl.inference.router", "--rust-log", rust_log, "--",
               *router_executable(),
        "--worker-urls", *worker_urls,
        "--host", host,
        "--port", str(port),
        "--policy", settings.policy,
        "--request-id-headers", SESSION_HEADER,
        "--health-check-timeout-secs", str(settings.health_check_timeout_s),
        "--health-check-interval-secs", str(settings.health_check_interval_s),
        "--health-failure-threshold", str(settings.health_failure_threshold),
        "--worker-startup-timeout-secs", str(settings.worker_startup_timeout_s),
        "--request-timeout-secs", str(settings.request_timeout_s),
        "--max-concurrent-requests", str(settings.max_concurrent_requests),
        "--queue-size", str(settings.queue_size),
        "--queue-timeout-secs", str(settings.queue_timeout_s),
        "--prometheus-host", "127.0.0.1",
        "--prometheus-port", str(metrics_port),
        "--log-level", flag,
    ]  # fmt: skip
    if settings.api_key:
        command += ["--api-key", settings.api_key]
    return command


class VllmRouter:
    def __init__(
        self,
        worker_urls: list[str],
        port: int,
        log_path: str | Path,
        host: str = "127.0.0.1",
        metrics_port: int | None = None,
        settings: RouterSettings | None = None,
    ):
        self.settings = settings or RouterSettings()
        self.url = f"http://{host}:{port}"
        self.log_path = Path(log_path)
        self.command = router_command(
            list(worker_urls), host, port, metrics_port or free_port(), self.settings
        )
        self.headers = {"Authorization": f"Bearer {self.settings.api_key}"} if self.settings.api_key else {}
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "a")
        self.started_at = time.time()
        self.process = subprocess.Popen(
            bound_to_parent(self.command), stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )

    @classmethod
    def attach(cls, url: str, api_key: str | None = None) -> VllmRouter:
        """A handle on a router started elsewhere (its worker API only; `stop` does nothing)."""
        router = cls.__new__(cls)
        router.settings = RouterSettings(api_key=api_key)
        router.url = url.rstrip("/")
        router.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        router.process = None
        router._log = None
        return router

    def alive(self) -> bool:
        return self.process is None or self.process.poll() is None

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Until the router answers `GET /list_workers` (it listens once its workers are healthy)."""
        deadline = time.monotonic() + timeout_s
        while True:
            if not self.alive():
                raise ServerStartError(
                    f"vllm-router on {self.url} exited with code {self.process.returncode}; last lines "
                    f"of {self.log_path}:\n{log_tail(self.log_path)}"
                )
            try:
                if httpx.get(f"{self.url}/list_workers", headers=self.headers, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise ServerStartError(
                    f"vllm-router on {self.url} not ready within {timeout_s:.0f}s; last lines of "
                    f"{self.log_path}:\n{log_tail(self.log_path)}"
                )
            time.sleep(0.2)

    def workers(self) -> list[str]:
        reply = httpx.get(f"{self.url}/list_workers", headers=self.headers, timeout=10)
        reply.raise_for_status()
        return list(reply.json()["urls"])

    def _change(self, action: str, url: str) -> None:
        try:
            reply = httpx.post(f"{self.url}/{action}", params={"url": url}, headers=self.headers, timeout=30)
        except httpx.HTTPError as exc:
            raise RuntimeError(f"vllm-router {self.url}/{action} {url}: {exc}") from None
        if reply.status_code >= 400:
            raise RuntimeError(
                f"vllm-router {self.url}/{action} {url}: HTTP {reply.status_code}: {reply.text[:300]}"
            )

    def add_worker(self, url: str) -> None:
        self._change("add_worker", url)

    def remove_worker(self, url: str) -> None:
        self._change("remove_worker", url)

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM to the router's process group, SIGKILL after `timeout_s`; returns once the
        router is gone and its output filter (`exec_plain`'s child) has written its last lines
        to the log (the filter outlives the router until end of file: without this wait a
        caller that reads the log at once could miss the router's shutdown lines)."""
        if self.process is None:
            return
        if self.alive():
            try:
                filters = psutil.Process(self.process.pid).children()
            except psutil.NoSuchProcess:
                filters = []
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
            except ProcessLookupError:
                pass
            psutil.wait_procs(filters, timeout=timeout_s)
        self._log.close()


def exec_plain(rust_log: str, command: list[str]) -> None:
    """Execs `command` (this process becomes it) with RUST_LOG=`rust_log`, its stdout and stderr
    through a pipe to a forked child that writes them to this process's stdout without ANSI
    escape sequences. The child ignores SIGTERM and SIGINT (the router's process group gets
    them), so it writes the router's last lines, and ends at end of file, once the router is gone."""
    os.environ["RUST_LOG"] = rust_log
    read, write = os.pipe()
    if os.fork() == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        os.close(write)
        with os.fdopen(read, "rb") as lines, os.fdopen(1, "wb", buffering=0) as out:
            for line in lines:
                out.write(ANSI_ESCAPE.sub(b"", line))
        os._exit(0)
    os.dup2(write, 1)
    os.dup2(write, 2)
    os.close(read)
    os.close(write)
    os.execvp(command[0], command)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description="run vllm-router with a RUST_LOG level and plain-text output"
    )
    parser.add_argument("--rust-log", required=True, choices=sorted({v for _, v in ROUTER_LEVELS.values()}))
    parser.add_argument("command", nargs="+", help="the router's command line, after --")
    args = parser.parse_args()
    exec_plain(args.rust_log, args.command)
