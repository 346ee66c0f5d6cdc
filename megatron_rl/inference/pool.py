"""The inference pool: N vLLM servers behind one vllm-router, and their weight versions.

`InferencePool.start(servers, router_port, log_dir, ...)` starts every server (each on its own
device list, with its own log), waits until every one answers `GET /v1/models` with the
expected model name (a server that exits while starting fails the pool with its name and the
last lines of its log; the others are stopped), and only then starts vllm-router over all of
them. `InferencePool.from_config(resolved, devices, log_dir)` builds the server specs from the
resolved config (`inference.*`, the devices it is given: never assumed to be 0..N-1).

Rollout traffic goes to `pool.router_url`; admin traffic (pause, reload, collective_rpc, reset)
goes straight to each server through `pool.controls`.

`WeightSync` (pool.sync) knows which policy version each server runs, asking the servers
themselves (our worker extension records it), and moves them to a new version:

- path (a), `update(version, weights_dir)`: `updating` is set (the rollout client sends nothing
  meanwhile), then on every server at once: pause (`inference.update_mode`: `keep` holds the
  requests in flight, `interrupt` ends them with the tokens so far for the client to resume;
  KV and prefix caches cleared) -> load the published directory -> reset the prefix cache, its
  reply checked -> resume, the resume in a `finally`; the new version is recorded before
  `updating` is cleared, so a request sent afterwards is stamped with the weights it runs on;
  admin calls retry with backoff;
- path (b): policy rank 0 broadcasts into the servers itself; `refresh()` learns the version it
  installed.

A server whose version is behind the pool's version is removed from the router, so it gets no
rollout traffic (a restarted server with initial weights must not serve), and is added back
once it has been brought up to date (`bring_up_to_date`, path (a)).
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from megatron_rl.config import Layout, ResolvedConfig
from megatron_rl.inference.router import RouterSettings, VllmRouter
from megatron_rl.inference.vllm_control import VllmControl, VllmControlError
from megatron_rl.inference.vllm_server import ServerStartError, VllmServer

log = logging.getLogger(__name__)


@dataclass
class ServerSpec:
    """One vLLM server: where it listens and which devices it uses."""

    port: int
    devices: list[str] = field(default_factory=list)
    host: str = "127.0.0.1"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


class WeightSyncError(RuntimeError):
    pass


# inference.update_mode -> vLLM's pause mode: requests in flight held, or ended with their tokens.
PAUSE_MODES = {"keep": "keep", "interrupt": "abort"}


ADAPTER_CONFIG = "adapter_config.json"  # a published version that is a LoRA adapter (PEFT's format)


def is_adapter_version(weights_dir: str | Path) -> bool:
    return (Path(weights_dir) / ADAPTER_CONFIG).is_file()


class WeightSync:
    def __init__(self, controls: list[VllmControl], router: VllmRouter | None, version: int = 0,
                 adapter_name: str | None = None, update_mode: str = "keep"):  # fmt: skip
        self.controls = controls
        self.router = router
        self.version = version  # the newest version installed on every in-service server
        self.update_mode = update_mode  # inference.update_mode (the orchestrator sets the config's)
        self.updating = False  # a path (a) update is in progress: the rollout client waits
        # A LoRA policy served as an adapter: the name its adapter is loaded under, and whether
        # versions after 0 are adapters (then requests name the adapter: `model_for`).
        self.adapter_name = adapter_name
        self.adapter_versions = False
        self.server_versions = {c.base_url: version for c in controls}
        self.out_of_service: set[str] = set()
        self.last_update_s: float | None = None

    def _on_each(self, call) -> dict[str, object]:
        """Runs `call(control)` for every server concurrently; raises naming every failed server."""
        with concurrent.futures.ThreadPoolExecutor(max(1, len(self.controls))) as pool:
            futures = {c.base_url: pool.submit(call, c) for c in self.controls}
        errors = {url: f.exception() for url, f in futures.items() if f.exception() is not None}
        if errors:
            raise WeightSyncError("; ".join(f"{url}: {exc}" for url, exc in errors.items()))
        return {url: f.result() for url, f in futures.items()}

    def model_for(self, base: str) -> str:
        """The model name rollout requests give now: the adapter's once a LoRA policy's first
        version is installed, else the base model's (version 0 is the base: B = 0)."""
        return self.adapter_name if self.adapter_versions and self.version > 0 else base

    def _load_one(self, control: VllmControl, version: int, weights_dir: str) -> int:
        control.pause(mode=PAUSE_MODES[self.update_mode], clear_cache=True)
        try:
            if is_adapter_version(weights_dir):
                if self.adapter_name is None:
                    raise WeightSyncError(f"{weights_dir} is a LoRA adapter and the pool has no adapter name")
                control.load_adapter_version(self.adapter_name, weights_dir, version)
            else:
                control.load_version(weights_dir, version)
            control.reset_prefix_cache()
        finally:
            control.resume()
        return version

    def update(self, version: int, weights_dir: str | Path) -> float:
        """Path (a): every server loads `weights_dir` as `version`; returns the seconds taken.
        On failure the servers keep serving (resumed) and the error names each failed server."""
        began = time.perf_counter()
        self.updating = True
        try:
            self._on_each(lambda c: self._load_one(c, version, str(weights_dir)))
            self.server_versions = dict.fromkeys(self.server_versions, version)
            self.version = version
            self.adapter_versions = self.adapter_versions or is_adapter_version(weights_dir)
        finally:
            self.updating = False
        self._reconcile()
        self.last_update_s = time.perf_counter() - began
        return self.last_update_s

    def refresh(self) -> dict[str, int]:
        """Asks every server which version it runs (path (b), and after restarts); takes servers
        that are behind out of the router and puts up-to-date ones back."""
        self.server_versions = {
            url: int(v) for url, v in self._on_each(lambda c: c.weights_version()).items()
        }
        self.version = max(self.server_versions.values())
        self._reconcile()
        return dict(self.server_versions)

    def _reconcile(self) -> None:
        for url, version in self.server_versions.items():
            behind = version < self.version
            if behind and url not in self.out_of_service:
                log.warning(
                    "inference server %s runs version %d < %d: no rollouts until updated",
                    url,
                    version,
                    self.version,
                )
                if self.router is not None:
                    self.router.remove_worker(url)
                self.out_of_service.add(url)
            elif not behind and url in self.out_of_service:
                if self.router is not None:
                    self.router.add_worker(url)
                self.out_of_service.discard(url)

    def bring_up_to_date(self, control: VllmControl, weights_dir: str | Path | None) -> None:
        """Loads the pool's version into one server (path (a)) and returns it to service."""
        if self.server_versions[control.base_url] < self.version:
            if weights_dir is None:
                raise WeightSyncError(
                    f"{control.base_url} runs version {self.server_versions[control.base_url]} < {self.version} "
                    "and no published directory was given to load"
                )
            self._load_one(control, self.version, str(weights_dir))
            self.server_versions[control.base_url] = self.version
        self._reconcile()


class InferencePool:
    def __init__(self, servers: list[VllmServer], router: VllmRouter, version: int = 0,
                 controls: list[VllmControl] | None = None, model_name: str | None = None):  # fmt: skip
        """`servers` are the processes this pool owns (none when attached to running ones)."""
        self.servers = servers
        self.router = router
        self.controls = controls if controls is not None else [s.control for s in servers]
        self.model_name = model_name or servers[0].served_model_name
        self.sync = WeightSync(self.controls, router, version, adapter_name=adapter_name(self.model_name))

    @classmethod
    def attach(cls, controls: list[VllmControl], router: VllmRouter, model_name: str) -> InferencePool:
        """A pool over servers and a router started elsewhere (the launcher); stops nothing."""
        pool = cls([], router, controls=controls, model_name=model_name)
        pool.sync.refresh()
        return pool

    @property
    def router_url(self) -> str:
        return self.router.url

    @property
    def worker_urls(self) -> list[str]:
        return [c.base_url for c in self.controls]

    @classmethod
    def launch(
        cls,
        servers: list[VllmServer],
        router_port: int,
        log_dir: str | Path,
        router_host: str = "127.0.0.1",
        startup_timeout_s: float = 1800.0,
        router_settings: RouterSettings | None = None,
        weights_version: int = 0,
    ) -> InferencePool:
        """Waits for every (started) server, then starts the router; on any failure stops all."""
        try:
            _wait_all_ready(servers, startup_timeout_s)
            router = VllmRouter(
                [s.url for s in servers], router_port, Path(log_dir) / "router.log", host=router_host,
                settings=router_settings,
            )  # fmt: skip
            try:
                router.wait_ready()
            except BaseException:
                router.stop()
                raise
        except BaseException:
            for server in servers:
                server.stop()
            raise
        return cls(servers, router, weights_version)

    @classmethod
    def start(
        cls,
        model_dir: str | Path,
        specs: list[ServerSpec],
        router_port: int,
        log_dir: str | Path,
        router_host: str = "127.0.0.1",
        startup_timeout_s: float = 1800.0,
        router_settings: RouterSettings | None = None,
        weights_version: int = 0,
        **server_kwargs,
    ) -> InferencePool:
        """Starts one vLLM server per spec (log `inference_{i}.log` in `log_dir`), then the router."""
        servers: list[VllmServer] = []
        try:
            for i, spec in enumerate(specs):
                servers.append(
                    VllmServer(
                        model_dir,
                        spec.port,
                        Path(log_dir) / f"inference_{i}.log",
                        host=spec.host,
                        devices=spec.devices,
                        name=f"inference server {i} ({spec.url})",
                        weights_version=weights_version,
                        **server_kwargs,
                    )  # fmt: skip
                )
        except BaseException:
            for server in servers:
                server.stop()
            raise
        return cls.launch(
            servers, router_port, log_dir, router_host, startup_timeout_s, router_settings, weights_version
        )

    @classmethod
    def from_config(
        cls,
        resolved: ResolvedConfig,
        devices: list[list[str]],
        log_dir: str | Path,
        model_dir: str | Path | None = None,
        launch: bool = True,
    ) -> InferencePool | list[VllmServer]:
        """The pool of `resolved.inference`: one server per entry of `devices` (each a list of
        `inference.tp` device ids), on the layout's inference ports. With `launch=False` it
        returns the (unstarted) servers, for a dry run."""
        from megatron_rl.models.tokenizer import vllm_remote_code_args  # transformers: not for every importer

        inference = resolved.inference
        api_key = inference.api_key()
        if len(devices) != inference.num_servers:
            raise ValueError(
                f"inference.num_servers is {inference.num_servers} but {len(devices)} device sets were given"
            )
        servers = []
        hosts = inference.server_hosts or [inference.host] * inference.num_servers
        for i, (port, host, devs) in enumerate(
            zip(resolved.layout.inference_ports, hosts, devices, strict=True)
        ):
            if len(devs) != inference.tp:
                raise ValueError(
                    f"inference server {i}: {len(devs)} devices {devs} for inference.tp = {inference.tp}"
                )
            spec = ServerSpec(port, list(devs), host)
            servers.append(
                VllmServer(
                    model_dir or served_model_dir(resolved),
                    spec.port,
                    Path(log_dir) / f"inference_{i}.log",
                    host=spec.host,
                    devices=spec.devices,
                    name=f"inference server {i} ({spec.url})",
                    device="cpu" if resolved.deployment.device == "cpu" else "cuda",
                    served_model_name=inference.served_model_name,
                    tp=inference.tp,
                    max_model_len=resolved.model.seq_len,
                    gpu_memory_utilization=inference.gpu_memory_utilization,
                    kv_cache_gib=inference.cpu_kv_cache_gib,
                    shutdown_timeout_s=inference.shutdown_timeout_s,
                    seed=resolved.orchestrator.seed,
                    http_log_level=resolved.logging.inference_level,
                    extra_args=[*vllm_remote_code_args(resolved.model), *inference.extra_args],
                    return_routed_experts=resolved.layout.sampler_routes,
                    lora_rank=adapter_rank(resolved.layout),
                    api_key=api_key,
                    launch=launch,
                )  # fmt: skip
            )
        if not launch:
            return servers
        return cls.launch(
            servers, inference.router_port, log_dir, router_host=inference.host,
            startup_timeout_s=inference.startup_timeout_s, router_settings=router_settings(resolved),
        )  # fmt: skip

    def stop(self) -> None:
        self.router.stop()
        for server in self.servers:
            server.stop()

    def __enter__(self) -> InferencePool:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def adapter_rank(layout: Layout) -> int | None:
    """The LoRA rank the servers must serve adapters of (a LoRA policy published as adapters:
    `layout.policy_lora.serve`), None when they serve plain weights."""
    plan = layout.policy_lora
    return plan.rank if plan is not None and plan.serve == "adapter" else None


def adapter_name(model_name: str) -> str:
    """The name a LoRA policy's adapter is served under, beside the base model's."""
    return f"{model_name}-lora"


def served_model_dir(resolved: ResolvedConfig) -> str:
    """The HF directory the inference servers start from (and the tokenizer's)."""
    directory = resolved.inference.model_dir or resolved.model.hf_config
    if not directory:
        raise ValueError(
            "inference.model_dir: the inference servers need the policy as an HF directory (weights, config, "
            "tokenizer); set inference.model_dir or model.hf_config"
        )
    return directory


def router_settings(resolved: ResolvedConfig) -> RouterSettings:
    """Router timeouts and queue sized from the config: every rollout of the batches that may be
    in flight at once fits in the queue, and no timeout is shorter than the longest rollout."""
    inference, orchestrator = resolved.inference, resolved.orchestrator
    groups = orchestrator.batch_size * (orchestrator.max_async_level + 1) + orchestrator.oversample
    in_flight = groups * orchestrator.group_size
    return RouterSettings(
        policy=inference.router_policy,
        request_timeout_s=int(inference.request_timeout_s),
        health_check_timeout_s=30,
        health_failure_threshold=inference.router_health_failure_threshold,
        worker_startup_timeout_s=int(inference.startup_timeout_s),
        max_concurrent_requests=max(256, 2 * in_flight),
        queue_size=max(1024, 4 * in_flight),
        queue_timeout_s=int(inference.request_timeout_s),
        api_key=inference.api_key(),
        log_level=resolved.logging.inference_level,
    )


def _wait_all_ready(servers: list[VllmServer], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    pending = list(servers)
    while pending:
        pending = [s for s in pending if not s.poll_ready()]
        if not pending:
            return
        if time.monotonic() > deadline:
            names = ", ".join(s.name for s in pending)
            raise ServerStartError(
                f"not ready within {timeout_s:.0f}s (inference.startup_timeout_s): {names}; last lines of "
                f"{pending[0].log_path}:\n{pending[0].log_tail()}"
            )
        time.sleep(0.25)


__all__ = [
    "InferencePool",
    "ServerSpec",
    "WeightSync",
    "WeightSyncError",
    "VllmControlError",
    "router_settings",
]
