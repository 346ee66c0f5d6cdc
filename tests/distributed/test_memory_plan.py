"""The memory plan's parameter and optimizer-state counts against what megatron allocates: tiny
models built at several layouts on two gloo ranks (TP=2; DP=2 value model with frozen
attention; MoE at EP=2; PP=2), one training step each so Adam's state exists; and the GPU and
host shares of an offloaded optimizer against the tensors megatron's hybrid optimizer holds."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_rl.config import Architecture, ModelLayout
from megatron_rl.config.memory_plan import adam_tensor_elements, optimizer_bytes, rank_parameters
from tests.support.spawn import run_ranks

# (family, tp, pp, ep, value model, freeze attention)
LAYOUTS = [
    ("qwen3", 2, 1, 1, False, False),
    ("qwen3", 1, 1, 1, True, True),
    ("qwen3_moe", 1, 1, 2, False, False),
    ("qwen3", 1, 2, 1, False, False),
]


def layout_of(tp: int, pp: int, ep: int, world: int = 2) -> ModelLayout:
    dp = world // (tp * pp)
    return ModelLayout(world_size=world, tp=tp, cp=1, pp=pp, ep=ep, dp=dp, expert_dp=world // (tp * ep * pp))


def measure(rank, world_size, architectures):
    """Per layout: this rank's pipeline stage, parameter counts and Adam moment elements."""
    from megatron.core import parallel_state

    from megatron_rl import parallel
    from megatron_rl.config import AlgorithmConfig, OptimizerConfig
    from megatron_rl.critic.loss import value_loss_func
    from megatron_rl.data.packing import dummy_micro_batch
    from megatron_rl.models.builder import build_gpt_model
    from megatron_rl.models.value_model import build_value_model, freeze_attention
    from megatron_rl.policy.loss import policy_loss_func
    from megatron_rl.trainer.optimizer import build_trainable, torch_optimizers
    from megatron_rl.trainer.step import train_step

    results = []
    for family, tp, pp, ep, value, freeze in LAYOUTS:
        arch = Architecture(**architectures[family])
        parallel.initialize_model_parallel(tp=tp, pp=pp, ep=ep)
        build = build_value_model if value else build_gpt_model
        model = build(arch, tp=tp, pp=pp, ep=ep, seq_len=64)
        if freeze:
            freeze_attention(model)
        trainable = build_trainable(model, OptimizerConfig(lr=1e-3), total_steps=1)
        loss = value_loss_func() if value else policy_loss_func(AlgorithmConfig(type="grpo"))
        train_step(trainable, [dummy_micro_batch()], loss)
        params = list(model.named_parameters())
        expert = [p for n, p in params if ".experts." in n]
        dense = [p for n, p in params if ".experts." not in n]
        adam = sum(
            state["exp_avg"].numel()
            for opt in torch_optimizers(trainable.optimizer)
            for state in opt.state.values()
            if "exp_avg" in state
        )
        results.append({
            "stage": parallel_state.get_pipeline_model_parallel_rank(),
            "dense": sum(p.numel() for p in dense),
            "expert": sum(p.numel() for p in expert),
            "dense_trainable": sum(p.numel() for p in dense if p.requires_grad),
            "expert_trainable": sum(p.numel() for p in expert if p.requires_grad),
            "adam": adam,
            "parameters": len(params),
        })  # fmt: skip
        del trainable, model
        torch.distributed.barrier()
    return results


@pytest.fixture(scope="module")
def measured(tiny_models):
    architectures = {
        family: Architecture.from_hf_config(
            json.loads((tiny_models[family] / "config.json").read_text()), family
        ).model_dump()
        for family in ("qwen3", "qwen3_moe")
    }
    return architectures, run_ranks(measure, 2, architectures)


@pytest.mark.parametrize(
    "index",
    range(len(LAYOUTS)),
    ids=[f"{f}-tp{t}-pp{p}-ep{e}" + ("-value" if v else "") for f, t, p, e, v, _ in LAYOUTS],
)
def test_parameters_per_rank_are_exact_and_adam_state_matches(measured, index):
    architectures, ranks = measured
    family, tp, pp, ep, value, freeze = LAYOUTS[index]
    arch = Architecture(**architectures[family])
    layout = layout_of(tp, pp, ep)
    planned_adam = measured_adam = 0.0
    for rank_results in ranks:
        got = rank_results[index]
        plan = rank_parameters(arch, layout, value_model=value, freeze_attention=freeze, stage=got["stage"])
        assert (plan.dense, plan.expert, plan.dense_trainable, plan.expert_trainable) == (
            got["dense"], got["expert"], got["dense_trainable"], got["expert_trainable"]
        ), (LAYOUTS[index], got)  # fmt: skip
        planned = adam_tensor_elements(plan, layout)
        # One rank's shard differs from an even split only by the distributed optimizer's
        # alignment padding (param starts on 64-element boundaries, buffer end on lcm(dp, 128)).
        assert abs(got["adam"] - planned) <= 64 * got["parameters"] + 128 * layout.dp, (planned, got)
        planned_adam += planned
        measured_adam += got["adam"]
    assert measured_adam == pytest.approx(planned_adam, abs=1e-6)  # exact over the group
    if freeze:
        assert plan.dense_trainable < plan.dense  # the frozen attention has no gradient or Adam state


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_offloaded_optimizer_bytes_match_what_the_hybrid_optimizer_allocates(dtype):
    """optimizer.cpu_offload at fractions 0.5 and 1, DP=2, one step (megatron's hybrid optimizer,
    its host copies emulated on CPU): the plan's host share (16 B per offloaded element: master,
    two moments, pinned gradient copy; 12 before, without the gradient copy) and GPU share (the
    Adam tensors of what stays) against the tensors it holds."""
    fractions = (0.5, 1.0)
    for rank in run_ranks(measure_offload, 2, DENSE_ARCH, dtype, fractions):
        for fraction, got in zip(fractions, rank):
            share = got["host_elements"] / got["elements"]  # whole parameters, so >= fraction
            assert fraction <= share <= 1.0 and (share == 1.0) == (fraction == 1.0)
            gpu, host = optimizer_bytes(got["elements"], dtype, share)
            assert got["host_bytes"] == pytest.approx(host, rel=0, abs=0), got
            # the plan counts an fp32 master for every element of a bf16 model; its fp32 norm
            # weights (a few hundred elements here) are stepped in place, without one
            assert got["gpu_bytes"] == pytest.approx(gpu, rel=0.02), got
            assert (got["gpu_bytes"] == 0) == (fraction == 1.0)


DENSE_ARCH = dict(family="qwen3", hidden_size=64, num_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, intermediate_size=96, vocab_size=128, qk_norm=True)  # fmt: skip


def measure_offload(rank, world_size, arch, dtype, fractions):
    """Per offload fraction: bytes the hybrid optimizer holds on the host (its host copies, their Adam moments, the
    gradient copies) and on the device (its device-side fp32 copies and the device optimizer's
    moments), after one step; the rank's shard elements and how many of them are offloaded."""
    from megatron_rl import parallel
    from megatron_rl.config import AlgorithmConfig, OptimizerConfig
    from megatron_rl.data.packing import dummy_micro_batch
    from megatron_rl.models.builder import build_gpt_model
    from megatron_rl.policy.loss import policy_loss_func
    from megatron_rl.trainer.optimizer import build_trainable, hybrid_optimizers
    from megatron_rl.trainer.step import train_step
    from tests.support import host_offload

    host_offload.install()
    parallel.initialize_model_parallel()
    results = []
    for fraction in fractions:
        model = build_gpt_model(Architecture(**arch), dtype=dtype)
        config = OptimizerConfig(lr=1e-3, cpu_offload=True, offload_fraction=fraction)
        trainable = build_trainable(model, config, total_steps=1)
        train_step(trainable, [dummy_micro_batch()], policy_loss_func(AlgorithmConfig(type="grpo")))
        [hybrid] = hybrid_optimizers(trainable.optimizer)
        results.append(_hybrid_bytes(hybrid))
    return results


def _hybrid_bytes(hybrid) -> dict:
    from tests.support import host_offload

    nbytes = lambda tensors: sum(t.numel() * t.element_size() for t in tensors)  # noqa: E731
    host_copies = list(hybrid.gpu_params_map_cpu_copy.values())
    assert all(host_offload.is_host_copy(t) for t in host_copies)
    host_moments = [
        s[k] for o in hybrid.cpu_optimizers for s in o.state.values() for k in ("exp_avg", "exp_avg_sq")
    ]
    device = hybrid.gpu_optimizer
    device_copies = (
        [p for g in device.param_groups for p in g["params"] if p in hybrid.fp32_param_to_orig_param]
        if device
        else []
    )
    device_moments = (
        [s[k] for s in device.state.values() for k in ("exp_avg", "exp_avg_sq")] if device else []
    )
    return {
        "elements": sum(p.numel() for g in hybrid.param_groups for p in g["params"]),
        "host_elements": sum(t.numel() for t in host_copies),
        "host_bytes": nbytes(host_copies) + nbytes(host_moments) + nbytes(hybrid.cpu_copy_map_grad.values()),
        "gpu_bytes": nbytes(device_copies) + nbytes(device_moments),
    }
