"""Commands that one SLURM job step runs (the rendered sbatch script calls them):

    megatron-rl check-config CONFIG --set KEY=VALUE ... --out JOB.json   # node addresses in
    megatron-rl inference-server --config JOB.json --index I           # becomes vLLM (exec)
    megatron-rl inference-server --config JOB.json --service teacher --index I   # a served model's
    megatron-rl wait-inference --config JOB.json                         # every server ready?
    megatron-rl router --config JOB.json [--service teacher]             # becomes vllm-router
    python -m megatron_rl.launch.ports --count N --hosts ADDR 127.0.0.1 --exclude P ...

`inference-server` and `router` replace their own process with the server's (os.execve), so
the signals srun sends reach vLLM and the router directly. A Megatron teacher
(`distillation.teacher.megatron`) is no vLLM server: it runs as `megatron-rl teacher` under
torchrun (the script's `torchrun_step teacher`), and the orchestrator waits for its /health.
"""

from __future__ import annotations

import os
import sys
import time

from megatron_rl.config import ResolvedConfig
from megatron_rl.config.services import vllm_services
from megatron_rl.inference.pool import InferencePool, router_settings
from megatron_rl.inference.router import router_command
from megatron_rl.inference.services import service_api_key, service_router_settings, service_servers
from megatron_rl.inference.vllm_control import VllmControl, VllmControlError
from megatron_rl.ports import free_port


def exec_inference_server(resolved: ResolvedConfig, index: int, service: str | None = None) -> None:
    """Becomes server `index` of the policy's inference, or of served model `service` (teacher,
    judge); its devices are the ones SLURM gave this step."""
    log_dir = f"{resolved.logging.dir}/logs"
    if service is not None:
        served = _service(resolved, service)
        placeholder = [["0"] * served.tp for _ in range(served.num_servers)]
        server = service_servers(resolved, service, placeholder, log_dir)[index]
    else:
        placeholder = [["0"] * resolved.inference.tp for _ in range(resolved.inference.num_servers)]
        server = InferencePool.from_config(resolved, placeholder, log_dir, launch=False)[index]
    env = {k: v for k, v in server.env.items() if k != "CUDA_VISIBLE_DEVICES"}
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        env["CUDA_VISIBLE_DEVICES"] = os.environ["CUDA_VISIBLE_DEVICES"]
    print(f"inference server {index}: {' '.join(server.command)}", flush=True)
    os.execve(server.command[0], server.command, env)


def _service(resolved: ResolvedConfig, name: str):
    served = vllm_services(resolved.layout.services)
    if name not in served:
        megatron = name in resolved.layout.services
        raise SystemExit(f"--service {name}: the config serves {sorted(served) or 'no model'} with vLLM beside the policy"
                         + ("; its teacher is the Megatron service (distillation.teacher.megatron), started as "
                            "`megatron-rl teacher` under torchrun" if megatron else ""))  # fmt: skip
    return served[name]


def exec_router(resolved: ResolvedConfig, service: str | None = None) -> None:
    """Becomes the policy's vllm-router, or served model `service`'s."""
    if service is not None:
        served = _service(resolved, service)
        host, port = served.url.removeprefix("http://").rsplit(":", 1)
        command = router_command(served.server_urls, host, int(port), free_port(),
                                 service_router_settings(resolved, service))  # fmt: skip
    else:
        command = router_command(resolved.layout.inference_urls, resolved.inference.host,
                                 resolved.inference.router_port, free_port(), router_settings(resolved))  # fmt: skip
    print(f"router: {' '.join(command)}", flush=True)
    os.execv(command[0], command)


def wait_inference(resolved: ResolvedConfig) -> int:
    """0 once every server (the policy's, and each served model's) answers /v1/models with its
    model; 1 after inference.startup_timeout_s, naming those that do not."""
    inference = resolved.inference
    expected = {url: (inference.served_model_name, inference.api_key()) for url in resolved.layout.inference_urls}
    for name, service in vllm_services(resolved.layout.services).items():
        expected.update({url: (service.served_model_name, service_api_key(resolved, name)) for url in service.server_urls})
    deadline = time.monotonic() + inference.startup_timeout_s
    pending = list(expected)
    while pending:
        still = []
        for url in pending:
            model, api_key = expected[url]
            try:
                if model not in VllmControl(url, api_key=api_key).models(timeout_s=2):
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
    served = "".join(f", {s.num_servers} {name} server(s) {s.served_model_name!r}"
                     for name, s in vllm_services(resolved.layout.services).items())  # fmt: skip
    print(f"all {len(resolved.layout.inference_urls)} inference servers serve {inference.served_model_name!r}{served}")
    return 0
