"""The memory plan's parameter and optimizer-state counts against what megatron allocates: tiny
models built at several layouts on two gloo ranks (TP=2; DP=2 value model with frozen
attention; MoE at EP=2; PP=2), one training step each so Adam's state exists; the GPU and
host shares of an offloaded optimizer against the tensors megatron's hybrid optimizer holds;
and LoRA models on the TE layer spec (CPU stand-ins, whose linear_qkv and dense linear_fc1 fuse
their input norm): an MoE model with expert adapters at EP=2 (expert-DP 1) and a dense float32
one on part of the targets, each trained one step, against the plan's optimizer state (the
distributed optimizer's Adam tensors), the adapters' activations (what autograd saved during the
adapters' forward) and check-config's update bytes (the tensors of a version published by the
project's own publishers, both paths)."""

from __future__ import annotations

import collections
import json
from functools import partial
from pathlib import Path

import pytest
import torch

from megatron_rl.config import Architecture, ModelLayout, RecomputeConfig, parse_config
from megatron_rl.config.memory_plan import (
    GIB,
    activation_bytes,
    adam_tensor_elements,
    optimizer_bytes,
    rank_parameters,
    weight_update_gib,
)
from megatron_rl.config.model_memory import published_lora_elements, weight_buffer_bytes
from tests.support.configs import base
from tests.support.spawn import run_ranks

# (family, tp, pp, ep, value model, freeze attention)
LAYOUTS = [
    ("qwen3", 2, 1, 1, False, False),
    ("qwen3", 1, 1, 1, True, True),
    ("qwen3_moe", 1, 1, 2, False, False),
    ("qwen3", 1, 2, 1, False, False),
    ("glm4_moe", 1, 1, 2, False, False),  # shared experts, q/k/v bias
    ("glm4_moe", 1, 2, 1, True, False),  # stage 0 the dense first layer, stage 1 an MoE layer
    ("deepseek_v3", 1, 1, 2, False, False),  # multi-latent attention, two shared experts
    ("deepseek_v3", 1, 2, 1, True, True),  # the critic on MLA, its attention frozen; stage 0 dense
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
        for family in ("qwen3", "qwen3_moe", "glm4_moe", "deepseek_v3")
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


# (family, ep, dtype, LoRA targets): LoRA models on the TE layer spec (CPU stand-ins), two ranks
LORA_CASES = [
    (
        "qwen3_moe",
        2,
        "bfloat16",
        ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"],
    ),  # expert adapters
    ("qwen3", 1, "float32", ["linear_qkv", "linear_fc1", "linear_fc2"]),  # dense, DP 2, no linear_proj
    # a dense first layer, shared experts' adapters (TP-split, DP-sharded) beside the experts'
    ("glm4_moe", 2, "bfloat16", ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]),
    # multi-latent attention's five linears (TE spec: the down-projections duplicated, the up-projections
    # fusing the latents' norms), a dense first layer, shared and routed experts
    ("deepseek_v3", 2, "bfloat16", ["linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj",
                                    "linear_proj", "linear_fc1", "linear_fc2"]),  # fmt: skip
]
# the activation plan's per-layer term assumes alike layers: not a dense first layer (glm4_moe, deepseek_v3)
ALIKE_LAYERS = [i for i, case in enumerate(LORA_CASES) if case[0] not in ("glm4_moe", "deepseek_v3")]
LORA_RANK, LORA_ALPHA, TOKENS = 4, 8.0, 48


class AdapterActivations:
    """Bytes that the adapters' forward passes save for the backward pass beyond the layers' own,
    per transformer layer (`bytes[layer]`), via autograd's saved-tensor hooks: storages saved
    while a LoRALinear runs its adapter path (outside the wrapped layer's forward) that nothing
    saved before, that are no parameter (megatron DDP's buffers included) and not the adapter's
    input (the layer's input, which the plan counts with the layer)."""

    def __init__(self, model):
        from megatron_rl.transforms.lora import LoRALinear

        self.adapters = [(int(n.split("layers.")[1].split(".")[0]), m) for n, m in model.named_modules()
                         if isinstance(m, LoRALinear)]  # fmt: skip
        self.parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.seen, self.kept, self.where, self.input, self.layer = set(), [], None, None, None
        self.bytes = collections.Counter()

    def _pack(self, tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self.seen:
            self.seen.add(storage.data_ptr())
            self.kept.append(tensor)  # alive until the step ends anyway; no address is reused
            if self.where == "adapter" and storage.data_ptr() not in self.parameters | {self.input}:
                self.bytes[self.layer] += storage.nbytes()
        return tensor

    def _set(self, where, layer=None):
        def hook(module, args, *output):
            self.where = where
            if layer is not None:  # entering the adapter
                self.input, self.layer = args[0].untyped_storage().data_ptr(), layer

        return hook

    def __enter__(self):
        self.handles = []
        for layer, adapter in self.adapters:
            self.handles += [adapter.register_forward_pre_hook(self._set("adapter", layer)),
                             adapter.base.register_forward_pre_hook(self._set("base")),
                             adapter.base.register_forward_hook(self._set("adapter")),
                             adapter.register_forward_hook(self._set(None))]  # fmt: skip
        self.saved = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)
        self.saved.__enter__()
        return self

    def __exit__(self, *exc):
        self.saved.__exit__(*exc)
        for handle in self.handles:
            handle.remove()
        self.kept.clear()


def measure_lora(rank, world_size, architectures, directory):
    """Per LORA_CASES entry: this rank's Adam moment elements after one step on a micro-batch of
    TOKENS tokens, the adapters' saved bytes in that step (`AdapterActivations`), the adapter
    tensors this rank streams on path (b) (`owned_adapter_tensors`), and on rank 0 the tensor
    bytes and dtypes in the files of a version published on path (a) (`publish_adapter`) and of
    the merged full weights (`publish_hf_weights`)."""
    import numpy as np
    from safetensors import safe_open

    from megatron_rl import parallel
    from megatron_rl.config import AlgorithmConfig, OptimizerConfig
    from megatron_rl.data.packing import pack_into_grid
    from megatron_rl.data.types import TrainingSample
    from megatron_rl.policy.loss import policy_loss_func
    from megatron_rl.policy.publish import publish_hf_weights
    from megatron_rl.policy.publish.adapters import owned_adapter_tensors, publish_adapter
    from megatron_rl.trainer.optimizer import build_trainable, torch_optimizers
    from megatron_rl.trainer.step import train_step
    from megatron_rl.transforms.lora import apply_lora, merge_adapter_tensors
    from megatron_rl.transforms.lora_transform import PeftAdapters
    from tests.support.te_standins import build_te_style_model

    def file_bytes(paths):
        total, dtypes = 0, set()
        for path in paths:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    tensor = f.get_tensor(key)
                    total, dtypes = (
                        total + tensor.numel() * tensor.element_size(),
                        dtypes | {str(tensor.dtype)},
                    )
        return total, sorted(dtypes)

    rng = np.random.default_rng(rank)
    results = []
    for index, (family, ep, dtype, targets) in enumerate(LORA_CASES):
        arch = Architecture(**architectures[family])
        parallel.initialize_model_parallel(ep=ep, seed=index)
        model = build_te_style_model(arch, ep=ep, dtype=dtype)
        apply_lora(model, LORA_RANK, LORA_ALPHA, targets, seed=1)
        trainable = build_trainable(model, OptimizerConfig(lr=1e-2), total_steps=1)
        sample = TrainingSample(token_ids=rng.integers(0, arch.vocab_size, TOKENS), loss_mask=np.ones(TOKENS, bool),
                                inference_logprobs=-rng.random(TOKENS), reward=1.0,
                                advantages=rng.normal(size=TOKENS).astype(np.float32))  # fmt: skip
        with AdapterActivations(model) as saved:
            train_step(
                trainable,
                [pack_into_grid([sample], TOKENS, 1)[0][0]],
                policy_loss_func(AlgorithmConfig(type="grpo")),
            )
        adam = sum(state["exp_avg"].numel() for opt in torch_optimizers(trainable.optimizer)
                   for state in opt.state.values() if "exp_avg" in state)  # fmt: skip
        streamed = owned_adapter_tensors(model, arch, PeftAdapters(LORA_RANK, LORA_ALPHA))
        adapters = publish_adapter(
            model, arch, Path(directory) / f"adapters{index}", 1, PeftAdapters(LORA_RANK, LORA_ALPHA)
        )
        merged = publish_hf_weights(model, arch, Path(directory) / f"merged{index}", 1,
                                    merge=partial(merge_adapter_tensors, alpha=LORA_ALPHA))
        torch.distributed.barrier()
        result = {
            "adam": adam,
            "parameters": len(list(model.parameters())),
            "adapter_saved_bytes": dict(saved.bytes),
            "streamed_bytes": sum(t.numel() * t.element_size() for t in streamed.values()),
            "streamed_dtypes": sorted({str(t.dtype) for t in streamed.values()}),
            "trainer_adapter_elements": sum(p.numel() for n, p in model.named_parameters() if ".lora_" in n),
        }
        if rank == 0:
            result["published"] = file_bytes([adapters / "adapter_model.safetensors"])
            result["merged"] = file_bytes(sorted(merged.glob("model-*.safetensors")))
        results.append(result)
        del trainable, model
        torch.distributed.barrier()
    return results


@pytest.fixture(scope="module")
def lora_measured(tiny_models, tmp_path_factory):
    architectures = {
        family: Architecture.from_hf_config(
            json.loads((tiny_models[family] / "config.json").read_text()), family
        )
        for family in ("qwen3", "qwen3_moe", "glm4_moe", "deepseek_v3")
    }
    ranks = run_ranks(measure_lora, 2, {k: a.model_dump() for k, a in architectures.items()},
                      str(tmp_path_factory.mktemp("published")))  # fmt: skip
    return architectures, ranks


def lora_config(arch: Architecture, dtype: str, targets: list[str], serve: str = "adapter"):
    """A resolved config of `arch` with a LoRA policy served as adapters (vLLM on CUDA), or `serve`."""
    config = base("grpo")
    config["model"].update(architecture=arch.model_dump(exclude_none=True), dtype=dtype)
    config["lora"] = {"rank": LORA_RANK, "alpha": LORA_ALPHA, "target_modules": targets, "serve": serve}
    return parse_config(config)


@pytest.mark.parametrize("index", range(len(LORA_CASES)), ids=[f"{f}-ep{e}-{d}" for f, e, d, _ in LORA_CASES])
def test_lora_optimizer_state_is_sharded_as_megatron_shards_it(lora_measured, index):
    """Expert adapters sit in megatron's expert buffers (allreduce False under EP), whose Adam state
    the distributed optimizer shards over expert-DP (1 here), not over DP x CP (2)."""
    architectures, ranks = lora_measured
    family, ep, dtype, targets = LORA_CASES[index]
    arch, layout = architectures[family], layout_of(1, 1, ep)
    plan = rank_parameters(arch, layout, lora_rank=LORA_RANK, lora_targets=targets)
    assert [r[index]["trainer_adapter_elements"] for r in ranks] == [plan.trainable] * 2
    planned = adam_tensor_elements(plan, layout)
    for rank in ranks:  # up to the distributed optimizer's alignment padding on one rank
        assert abs(rank[index]["adam"] - planned) <= 64 * rank[index]["parameters"] + 128 * layout.dp
    assert sum(rank[index]["adam"] for rank in ranks) == pytest.approx(
        2 * planned, abs=1e-6
    )  # exact over the group
    if ep > 1:
        assert plan.expert_trainable > 0 and layout.expert_dp == 1 and layout.dp == 2
        as_if_dense = plan.trainable / (layout.dp * layout.cp)  # the old plan: every adapter over DP x CP
        # the old plan missed one rank's expert adapters (each rank keeps all of its own)
        assert sum(rank[index]["adam"] for rank in ranks) - 2 * as_if_dense == plan.expert_trainable > 0


@pytest.mark.parametrize("index", ALIKE_LAYERS, ids=[f"{f}-ep{e}-{d}" for f, e, d, _ in (LORA_CASES[i] for i in ALIKE_LAYERS)])
def test_lora_adapter_activations_match_what_autograd_saved(lora_measured, index):
    """The plan's adapter term per layer (activation_bytes with the adapters less without, fused
    norms as on the TE spec) against the bytes the adapters' forward saved in each layer, summed
    over the two ranks (each token's k routed copies land on either rank's experts). Exact in
    every layer but the first, whose input (the frozen embedding's output) needs no gradient, so
    its fused norm saves no float32 statistics: there the plan is an upper bound. A bfloat16
    model's fused norm also saves its fp32 norm weight, h floats per layer and fused linear, not
    per token: the plan leaves that out."""
    architectures, ranks = lora_measured
    family, ep, dtype, targets = LORA_CASES[index]
    arch, layout = architectures[family], layout_of(1, 1, ep)

    def planned(**lora):
        return activation_bytes(arch, layout, TOKENS, dtype, RecomputeConfig(), value_model=False, **lora)

    per_layer = (
        planned(lora_rank=LORA_RANK, lora_targets=targets, fused_norms=True) - planned()
    ) / arch.num_layers
    fused = 1 if arch.num_experts else 2  # linear_qkv, and a dense model's linear_fc1
    weight_copies = fused * 4 * arch.hidden_size if dtype != "float32" else 0
    measured = [
        sum(rank[index]["adapter_saved_bytes"][layer] for rank in ranks) for layer in range(arch.num_layers)
    ]
    assert arch.num_layers > 1 and measured[1:] == [2 * (per_layer + weight_copies)] * (arch.num_layers - 1)
    # the first layer: the fp32 copy of x (none in float32), its inverse RMS and the fp32 weight
    unsaved = TOKENS * ((4 * arch.hidden_size if dtype != "float32" else 0) + 4) + 4 * arch.hidden_size * (
        dtype != "float32"
    )
    assert measured[0] == 2 * (per_layer + weight_copies - unsaved) < 2 * per_layer
    # the fused norms' copies are most of it: without them the plan says far less
    unfused = (planned(lora_rank=LORA_RANK, lora_targets=targets) - planned()) / arch.num_layers
    assert unfused < per_layer / 3


@pytest.mark.parametrize("index", range(len(LORA_CASES)), ids=[f"{f}-ep{e}-{d}" for f, e, d, _ in LORA_CASES])
def test_check_config_update_bytes_are_a_published_versions(lora_measured, index):
    """check-config's weight update (`weight_update_gib`, the figure it prints) against the tensor
    bytes of a version the project's publishers wrote: the PEFT adapter file of path (a), what
    the ranks stream on path (b), and for the whole model the merged full weights; all in the
    model's dtype, one A per Hugging Face module (q, k, v; gate, up), only the targets'."""
    architectures, ranks = lora_measured
    family, ep, dtype, targets = LORA_CASES[index]
    arch = architectures[family]
    if arch.multi_latent_attention:  # served merged (vLLM absorbs kv_b_proj): the adapters' bytes as PEFT's files
        whole, served = weight_update_gib(lora_config(arch, dtype, targets, serve="auto"))
        adapters = published_lora_elements(arch, LORA_RANK, targets) * (2 if dtype == "bfloat16" else 4) / GIB
        assert served is None
    else:
        whole, adapters = weight_update_gib(lora_config(arch, dtype, targets))
    torch_dtype = f"torch.{dtype}"
    assert ranks[0][index]["published"] == (round(adapters * GIB), [torch_dtype])
    assert sum(rank[index]["streamed_bytes"] for rank in ranks) == round(adapters * GIB)
    assert {d for rank in ranks for d in rank[index]["streamed_dtypes"]} == {torch_dtype}
    # the routers' expert bias (a buffer) is published too, in float32, and weight_update_gib counts it
    bias = weight_buffer_bytes(arch)
    assert bias == (4 * 6 if family in ("glm4_moe", "deepseek_v3") else 0)
    assert ranks[0][index]["merged"] == (round(whole * GIB), sorted({torch_dtype} | ({"torch.float32"} if bias else set())))
    # more than the trainer holds (one rank's count at EP = 1, checked above): a fused layer's A is
    # sent once per part
    trainer = rank_parameters(arch, layout_of(1, 1, 1, world=1), lora_rank=LORA_RANK, lora_targets=targets)
    assert adapters * GIB > trainer.trainable * (2 if dtype == "bfloat16" else 4)
