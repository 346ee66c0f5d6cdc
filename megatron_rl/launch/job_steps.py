"""Commands that one SLURM job step runs (the rendered sbatch script calls them):

    megatron-rl check-config CONFIG --set KEY=VALUE ... --out JOB.json   # node addresses in
    megatron-rl inference-server --config JOB.json --index I           # becomes vLLM (exec)
    megatron-rl wait-inference --config JOB.json                         # every server ready?
    megatron-rl router --config JOB.json                                 # becomes vllm-router
    python -m megatron_rl.launch.ports --count N --hosts ADDR 127.0.0.1 --exclude P ...

`inference-server` and `router` replace their own process with the server's (os.execve), so
the signals srun sends reach vLLM and the router directly.
"""

from __future__ import annotations

import os
import sys
import time

from megatron_rl.config import ResolvedConfig
from megatron_rl.inference.pool import InferencePool, router_settings
from megatron_rl.inference.router import _free_loopback_port, router_command
from megatron_rl.inference.vllm_control import VllmControl, VllmControlError


def exec_inference_server(resolved: ResolvedConfig, index: int) -> None:
    """Becomes server `index`; its devices are the ones SLURM gave this step."""

    placeholder = [["0"] * resolved.inference.tp for _ in range(resolved.inference.num_servers)]
    server = InferencePool.from_config(resolved, placeholder, f"{resolved.logging.dir}/logs", launch=False)[
        index
    ]
    env = {k: v for k, v in server.env.items() if k != "CUDA_VISIBLE_DEVICES"}
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        env["CUDA_VISIBLE_DEVICES"] = os.environ["CUDA_VISIBLE_DEVICES"]
    print(f"inference server {index}: {' '.join(server.command)}", flush=True)
    os.execve(server.command[0], server.command, env)


def exec_router(resolved: ResolvedConfig) -> None:
    command = router_command(resolved.layout.inference_urls, resolved.inference.host, resolved.inference.router_port,
                             _free_loopback_port(), router_settings(resolved))  # fmt: skip
    print(f"router: {' '.join(command)}", flush=True)
    os.execv(command[0], command)


def wait_inference(resolved: ResolvedConfig) -> int:
    inference = resolved.inference
    api_key = inference.api_key()
    deadline = time.monotonic() + inference.startup_timeout_s
    pending = list(resolved.layout.inference_urls)
    while pending:
        still = []
        for url in pending:
            try:
                if inference.served_model_name not in VllmControl(url, api_key=api_key).models(timeout_s=2):
                    still.append(url)
            except VllmControlError:
                still.append(url)
        pending = still
        if pending and time.monotonic() > deadline:
            print(
                f"inference servers not ready within {inference.startup_timeout_s:.0f}s: {pending}",
                file=sys.stderr,
            )
            return 1
        if pending:
            time.sleep(1.0)
    print(
        f"all {len(resolved.layout.inference_urls)} inference servers serve {inference.served_model_name!r}"
    )
    return 0
