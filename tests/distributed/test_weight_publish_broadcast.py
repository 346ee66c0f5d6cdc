"""Weight publishing path (b) on CPU: policy ranks (PP=2, EP=2 and PP=2 x EP=2, so other ranks
own some of the tensors and policy rank 0 relays them) broadcast to an inference worker through
a WeightUpdateGroup over gloo, one decoder layer at a time. The worker is the real
WeightReceiverExtension; in place of vLLM's dev-mode HTTP endpoints a small threaded server
dispatches /collective_rpc to it, and its `reload_weights` (vLLM's worker method, with vLLM's
signature) loads HF-named tensors into a `transformers` model."""

from __future__ import annotations

import json
import multiprocessing as mp
import re
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from safetensors.torch import load_file

from megatron_rl.parallel import free_port
from tests.support.spawn import run_ranks

EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight")


class _HFLoader:
    """Loads HF on-disk names into a transformers model (which fuses each layer's experts in
    memory: gate_up_proj [E, 2I, H], down_proj [E, H, I])."""

    def __init__(self, model):
        self.params = dict(model.named_parameters())
        self.loaded: list[str] = []

    def load_weights(self, weights):
        for name, tensor in weights:
            expert = EXPERT.fullmatch(name)
            if expert is None:
                self.params[name].data.copy_(tensor)
            else:
                prefix, index, kind = expert.group(1), int(expert.group(2)), expert.group(3)
                fused = self.params[f"{prefix}.{'down' if kind == 'down' else 'gate_up'}_proj"].data[index]
                half = fused.shape[0] // 2
                {"down": fused, "gate": fused[:half], "up": fused[half:]}[kind].copy_(tensor)
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
            result = {"success": True} if self.path == "/reset_prefix_cache" else None  # vLLM's reply
            if self.path == "/collective_rpc":
                request = json.loads(body)
                calls.append(request["method"])
                result = {"results": [getattr(worker, request["method"])(**request["kwargs"])]}
                if request["method"] == "receive_weights":  # on-disk names, by transformers itself
                    worker.model.save_pretrained(out_path + ".model")
                    with open(out_path, "w") as f:
                        json.dump({"loaded": worker.loader.loaded, "version": worker.weights_version}, f)
            with open(out_path + ".calls", "w") as f:
                json.dump(calls, f)
            data = json.dumps(result).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    ThreadingHTTPServer(("127.0.0.1", http_port), Handler).serve_forever()


def policy_publish(rank, world_size, hf_dir, http_port, group_port, pp, ep):
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
    torch.manual_seed(7)  # the same noise on every replica of a tensor (the EP ranks' dense layers)
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


def layer_of(name: str) -> int:
    """A tensor's place in a layer-by-layer stream: -1 the embeddings, L decoder layer L, 10**6
    the final norm and output layer."""
    if name.startswith("model.layers."):
        return int(name.split(".")[2])
    return -1 if name == "model.embed_tokens.weight" else 10**6


@pytest.mark.parametrize(
    "family,pp,ep",
    [("qwen3", 2, 1), ("qwen3_moe", 1, 2), pytest.param("qwen3_moe", 2, 2, marks=pytest.mark.slow)],
)  # 4 ranks: slow
def test_policy_ranks_broadcast_to_an_inference_worker(family, pp, ep, tiny_models, tmp_path):
    hf_dir, http_port = str(tiny_models[family]), free_port()
    out = tmp_path / "worker_state.json"
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
        ranks = run_ranks(policy_publish, pp * ep, hf_dir, http_port, free_port(), pp, ep)
    finally:
        worker.kill()
    received = json.loads(out.read_text())
    received["state"] = {}
    for shard in sorted((tmp_path / "worker_state.json.model").glob("*.safetensors")):
        received["state"].update(load_file(shard))
    expected = {}
    for _, share in ranks:
        for name, tensor in share.items():
            assert name not in expected or torch.equal(expected[name], tensor), name  # replicas agree
            expected[name] = tensor
    sent = ranks[0][0]
    assert sent == len(expected) and sorted(received["loaded"]) == sorted(expected)
    # layer by layer: every owner's tensors of a layer before the next layer's
    order = [layer_of(name) for name in received["loaded"]]
    assert order == sorted(order), received["loaded"]
    assert received["version"] == 7
    for name, tensor in expected.items():
        assert torch.equal(received["state"][name], tensor), name
    calls = json.loads((tmp_path / "worker_state.json.calls").read_text())
    assert calls[1:] == [  # after the readiness probe: join, pause, update, reset, resume
        "/collective_rpc",
        "init_weight_update_group",
        "/pause?mode=keep&clear_cache=true",  # the caches cleared: held requests re-prefill
        "/collective_rpc",
        "receive_weights",
        "/reset_prefix_cache",
        "/resume",
    ]
