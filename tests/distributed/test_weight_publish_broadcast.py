"""Weight publishing path (b) on CPU: policy ranks (PP=2, so rank 1 owns half the tensors and
policy rank 0 relays them) broadcast to an inference worker through a WeightUpdateGroup over
gloo. The worker is the real WeightReceiverExtension; in place of vLLM's dev-mode HTTP endpoints
a small threaded server dispatches /collective_rpc to it, and its `reload_weights` (vLLM's
worker method, with vLLM's signature) loads HF-named tensors into a `transformers` model."""

from __future__ import annotations

import json
import multiprocessing as mp
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from megatron_rl.parallel import free_port
from megatron_rl.testing.spawn import run_ranks


class _HFLoader:
    def __init__(self, model):
        self.params = dict(model.named_parameters())
        self.loaded: list[str] = []

    def load_weights(self, weights):
        for name, tensor in weights:
            self.params[name].data.copy_(tensor)
            self.loaded.append(name)


def inference_worker(hf_dir: str, http_port: int, out_path: str) -> None:
    """A stand-in vLLM server process around the real extension."""
    from transformers import AutoModelForCausalLM

    from megatron_rl.inference.vllm_extension import WeightReceiverExtension

    class Worker(WeightReceiverExtension):
        def __init__(self):
            self.rank = 0
            self.device = torch.device("cpu")
            self.model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
            self.loader = _HFLoader(self.model)

        def reload_weights(self, weights_iterator=None, weights_path=None, is_checkpoint_format=True):
            self.loader.load_weights(weights_iterator)

    worker, calls = Worker(), []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            calls.append(self.path)
            result = None
            if self.path == "/collective_rpc":
                request = json.loads(body)
                calls.append(request["method"])
                result = {"results": [getattr(worker, request["method"])(**request["kwargs"])]}
                if request["method"] == "receive_weights":
                    torch.save(
                        {
                            "state": {k: v.detach().clone() for k, v in worker.model.state_dict().items()},
                            "loaded": worker.loader.loaded,
                            "version": worker.weights_version,
                        },
                        out_path,
                    )
            with open(out_path + ".calls", "w") as f:
                json.dump(calls, f)
            data = json.dumps(result).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    ThreadingHTTPServer(("127.0.0.1", http_port), Handler).serve_forever()


def policy_publish(rank, world_size, hf_dir, http_port, group_port):
    from megatron_rl import parallel
    from megatron_rl.inference.vllm_control import VllmControl
    from megatron_rl.models.builder import build_gpt_model
    from megatron_rl.models.checkpoint_io import read_architecture
    from megatron_rl.models.hf_mapping import megatron_to_hf
    from megatron_rl.models.sharding import gather_full_parameters
    from megatron_rl.policy.publish import BroadcastPublisher
    from megatron_rl.trainer.weights import load_initial_weights

    parallel.initialize_model_parallel(pp=2)
    arch = read_architecture(hf_dir)
    model = build_gpt_model(arch, pp=2)
    load_initial_weights(model, hf_dir, arch)
    with torch.no_grad():  # trained weights: different from what the worker started with
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    publisher = BroadcastPublisher(
        arch,
        [VllmControl(f"http://127.0.0.1:{http_port}", timeout_s=120)],
        "127.0.0.1",
        group_port,
        backend="gloo",
        bucket_bytes=4096,  # many buckets
        timeout_s=120,
    )
    if rank == 0:
        publisher.connect()
    sent = publisher.publish(model, version=7)
    return sent, megatron_to_hf(gather_full_parameters(model), arch, partial=True)


def test_policy_ranks_broadcast_to_an_inference_worker(tiny_models, tmp_path):
    hf_dir, http_port = str(tiny_models["qwen3"]), free_port()
    out = tmp_path / "worker_state.pt"
    worker = mp.get_context("spawn").Process(
        target=inference_worker, args=(hf_dir, http_port, str(out)), daemon=True
    )
    worker.start()
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(
                    urllib.request.Request(f"http://127.0.0.1:{http_port}/resume", data=b"", method="POST"),
                    timeout=2,
                )
                break
            except OSError:
                assert time.monotonic() < deadline and worker.is_alive(), "stand-in server did not start"
                time.sleep(0.3)
        (sent, first_stage), (_, last_stage) = run_ranks(policy_publish, 2, hf_dir, http_port, free_port())
    finally:
        worker.kill()
    received = torch.load(out)
    expected = {**first_stage, **last_stage}
    assert sent == len(expected) and sorted(received["loaded"]) == sorted(expected)
    assert received["version"] == 7
    for name, tensor in expected.items():
        assert torch.equal(received["state"][name], tensor), name
    calls = json.loads((tmp_path / "worker_state.pt.calls").read_text())
    assert calls[1:] == [  # after the readiness probe: join, pause, update, reset, resume
        "/collective_rpc",
        "init_weight_update_group",
        "/pause?mode=keep",
        "/collective_rpc",
        "receive_weights",
        "/reset_prefix_cache",
        "/resume",
    ]
