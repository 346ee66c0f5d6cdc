"""Memory plan: what each GPU of each role will hold, before anything is started.

`memory_plan(resolved)` estimates, per GPU of the policy and of the critic: weights,
gradients, optimizer state (sharded by the distributed optimizer over DP x CP for dense and over
expert-DP for expert parameters and an expert's LoRA adapters, as megatron shards them, minus
what `optimizer.cpu_offload` keeps on the host), activations of one micro-batch (one packed row
of `seq_len` tokens, split by CP, and by TP under sequence parallelism) with the configured
recomputation, the logits, and a fixed allowance for the CUDA context, NCCL buffers and
allocator fragmentation; per inference GPU the weights and the KV cache vLLM gets at
`inference.gpu_memory_utilization`; and the same for each GPU of a model the run serves beside
the policy (a distillation teacher, an LLM judge: config/services.py), from that model's own
architecture, `serve.tp` and `serve.gpu_memory_utilization`, whose KV cache must hold one
sequence of its `max_model_len`; a Megatron teacher (`distillation.teacher.megatron`) per GPU
of its layout: its weights in its dtype, split as the policy's are, and the transient memory of
a forward-only pass (one layer's activations, the last stage's logits of one packed row and one
fp32 log-probability chunk), no gradients or optimizer. `gpu_totals` counts every role's GPUs against the nodes.
`check_fits` turns a plan over `deployment.gpu_memory_gib` into errors that say by how much and
which option would fix it; `check-config` prints the plan.

What is exact and what is estimated:
- parameter counts per rank follow megatron's sharding of our builders (column/row parallel
  linears split by TP, experts by EP and expert-TP = TP, embeddings and output layer by TP on
  the first/last pipeline stage, norms and the router replicated); tests/distributed/
  test_memory_plan.py checks them against tiny models built at several layouts, exactly, and the
  optimizer state against the Adam tensors megatron allocates (exact over the DP group; on one
  rank up to the distributed optimizer's bucket padding), LoRA models with expert adapters at
  EP = 2 included;
- gradients: megatron's DDP grad buffer (fp32 here: `grad_reduce_in_fp32`) holds every trainable
  parameter of the rank, unsharded;
- optimizer state: Adam moments (2 x 4 bytes) plus an fp32 master copy (4 bytes) when the
  model is bf16/fp16, per trainable parameter, divided by the sharding group; under
  `optimizer.cpu_offload` (megatron's hybrid device optimizer on the precision-aware path) the
  GPU keeps that for the share not offloaded, and the host holds, per offloaded element, the
  fp32 master (the host copy of an fp32 weight), the two moments and the pinned fp32 copy of
  its gradient: 16 bytes of tensors (`HOST_OFFLOAD_BYTES`; config/host_memory.py plans them as the
  pinned allocator takes them); tests/distributed/test_memory_plan.py checks
  both shares against the tensors the hybrid optimizer allocates;
- the frozen KL reference policy (`algorithm.kl_coef` > 0): a second copy of the policy's
  weights on every policy GPU (its forward pass runs before the training pass, so its
  activations are not held at the same time); none with a LoRA policy (`lora`), whose reference
  is its own model with the adapters off, and whose gradients and optimizer state are the
  adapters' only;
- activations are an estimate (per token and layer: the inputs of the norms, QKV, the attention
  output, SwiGLU's gate/up and product, for MoE the routed copies of the top-k experts), not a
  measurement; the GPU script (tests/gpu/run.sh) is where it gets compared with CUDA's peak.
  LoRA adapters add what they save (`adapter_bytes_per_token`: their rank-r products, and on the
  TE spec the fp32 copy of x that each fused-norm adapter keeps); tests/distributed/
  test_memory_plan.py checks that term per layer against what autograd saves;
- routing replay (`algorithm.routing_replay` on): the policy builds every micro-batch of a step
  before its first forward, so each policy GPU holds the routes of its share of the step's
  tokens at once: at most batch_size x group_size samples of model.seq_len tokens over DP x CP,
  each token L x k experts (1 byte up to 256 experts, else 2) and one `routed` byte, plus one
  layer's int64 targets for one micro-batch's tokens per local layer (`routes_bytes`; an upper
  bound: samples are rarely seq_len long);
- `CUDA_CONTEXT_GIB`, `FRAGMENTATION_GIB` and `NCCL_GIB_PER_COMMUNICATOR` are allowances, not
  measurements.

Peaks besides the steady state (one training step), per training GPU, in the order the code
allocates (trainer/role.py):
- start-up: megatron DDP (distributed_data_parallel.py ~291-297) builds the dense parameter and
  gradient buffers, then the expert ones; each allocates the new parameter buffer (distributed
  optimizer) and the fp32 gradient buffer before it copies the old weights in and frees them
  (param_and_grad_buffer.py ~795-835), so while a group is built its old weights, its new copy
  and its gradients are resident at once. Then the optimizer (under cpu_offload megatron first
  builds a hybrid optimizer over the full parameters: its GPU fp32 copies of the share kept on the
  GPU coexist with the sharded one's), then the KL reference (the policy builds it after the
  optimizer, `PolicyTrainer.after_optimizer`, so it is not resident during DDP's buffers);
- resume: the state of one step less its activations, plus what the load allocates on the GPU:
  the hybrid optimizer's state initialisation (trainer/optimizer.py
  `initialise_state_with_one_gradient_buffer`: one zero fp32 gradient buffer per device as large
  as the largest parameter stepped there, so nothing on the GPU at offload fraction 1; megatron's
  own `dummy_step` took a `randn_like` gradient of every shard at once, `hybrid_optimizer.py`
  ~453-463, +28.4 GiB on a 30B policy GPU); the hybrid optimizer keeps its sub-optimizers and their
  fp32 copies through a load (trainer/optimizer.py `_keep_sub_optimizers`: megatron's load hook
  would rebuild them beside the old ones); the dist checkpoint loader fills the existing tensors in place (the `dp_reshardable` format hands it
  the optimizer's own tensors: distrib_optimizer.py `get_parameter_state_dp_reshardable`);
- NCCL: `NCCL_GIB_PER_COMMUNICATOR` for each communicator a GPU of the role uses (groups of more
  than one rank: data-parallel, expert data-parallel, expert all-to-all, tensor, context and
  pipeline parallel, and the policy's weight broadcast under `inference.weight_update: nccl`);
- host: config/host_memory.py (pinned rounding, megatron's two optimizer builds), summed over the
  training ranks of each node and checked against `deployment.host_memory_gib`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_rl.config.host_memory import GIB, HostMemory, ShardTensor, offloaded_host_memory
from megatron_rl.config.layout import ModelLayout, ResolvedConfig
from megatron_rl.config.model import LORA_TARGETS, Architecture, RecomputeConfig
from megatron_rl.config.model_memory import (  # the per-rank counts, imported from here by tests and tools
    BYTES,
    HOST_OFFLOAD_BYTES,
    LOGITS_PER_LOGIT,
    LOGPROB_CHUNK_BYTES,
    LOGPROB_CHUNK_BYTES_PER_ELEMENT,
    LOGPROB_CHUNK_ELEMENTS,
    RankParameters,
    activation_bytes,
    adam_tensor_elements,
    adam_tensors,
    adapter_bytes_per_token,
    layer_parameters,
    layer_tensors,
    lora_parameters,
    lora_tensors,
    optimizer_bytes,
    published_lora_elements,
    rank_parameters,
    rank_tensors,
    stage_layers,
    weight_buffer_bytes,
)
from megatron_rl.config.services import MEGATRON_TEACHER_KEY, served_models

__all__ = [
    "BYTES", "CUDA_CONTEXT_GIB", "FRAGMENTATION_GIB", "GIB", "HOST_OFFLOAD_BYTES", "LOGITS_PER_LOGIT",
    "LOGPROB_CHUNK_BYTES", "LOGPROB_CHUNK_BYTES_PER_ELEMENT", "LOGPROB_CHUNK_ELEMENTS", "NCCL_GIB_PER_COMMUNICATOR",
    "GpuMemory", "Peak", "RankParameters", "activation_bytes", "adam_tensor_elements", "adam_tensors",
    "adapter_bytes_per_token", "check_fits", "format_plan", "gpu_totals", "layer_parameters", "layer_tensors", "lora_parameters",
    "lora_tensors", "memory_plan", "node_host_memory", "optimizer_bytes", "published_lora_elements",
    "rank_parameters", "rank_tensors", "route_bytes_per_token", "routes_bytes", "weight_update_gib",
]  # fmt: skip

# The CUDA context with cuBLAS handles and workspaces: about 0.5-0.6 GiB on Hopper under CUDA 12's
# lazy module loading; an allowance.
CUDA_CONTEXT_GIB = 1.0
FRAGMENTATION_GIB = 2.0  # the caching allocator's fragmentation: an allowance
# NCCL's buffers per communicator grow with its channels and connections (NVIDIA/nccl#986: linear
# in the number of communicators); about 1.6 GB measured for a first communicator with its CUDA
# context after an all-reduce (NVIDIA/nccl#864). NCCL_NVLS_ENABLE=0 or fewer channels lower it.
NCCL_GIB_PER_COMMUNICATOR = 1.0
VLLM_RESERVE_GIB = 4.0  # vLLM's activations, CUDA graphs and sampler beside weights and KV cache


@dataclass
class Peak:
    """One moment of a GPU's memory: its name (steady, start-up, resume), when it happens, and
    what is resident then (GiB)."""

    name: str
    moment: str
    parts: dict[str, float]

    @property
    def total(self) -> float:
        return sum(self.parts.values())


@dataclass
class GpuMemory:
    """One GPU of one role, in GiB: the steady state of a step (`parts`) and its other peaks."""

    role: str
    where: str  # the config section, for messages
    parts: dict[str, float]
    host_gib: float = 0.0  # offloaded optimizer state and gradient copies in host memory, steady, per rank
    peaks: list[Peak] = field(default_factory=list)  # start-up and resume (training roles)
    host: HostMemory | None = None  # bytes, per rank, under optimizer.cpu_offload

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    def all_peaks(self) -> list[Peak]:
        return [Peak("steady", "a training step", self.parts), *self.peaks]

    def largest(self) -> Peak:
        return max(self.all_peaks(), key=lambda peak: peak.total)


def communicators(resolved: ResolvedConfig, role: str, layout: ModelLayout) -> list[str]:
    """The NCCL communicators one GPU of `role` uses (groups of more than one rank)."""
    names = []
    if layout.dp * layout.cp > 1:
        names.append("data-parallel")
    if layout.ep > 1 and layout.expert_dp > 1:
        names.append("expert data-parallel")
    for size, name in ((layout.ep, "expert all-to-all"), (layout.tp, "tensor-parallel"),
                       (layout.cp, "context-parallel"), (layout.pp, "pipeline")):  # fmt: skip
        if size > 1:
            names.append(name)
    if role == "policy" and resolved.inference.weight_update == "nccl" and resolved.deployment.inference_gpus:
        names.append("weight broadcast")
    return names


def _training_gpu(resolved: ResolvedConfig, role: str) -> GpuMemory:
    if role == "policy":
        model, optimizer, arch, layout = (
            resolved.model, resolved.optimizer, resolved.layout.policy_architecture, resolved.layout.policy
        )  # fmt: skip
        value_model, freeze, lora, where = False, False, resolved.lora, "model"
    else:
        value = resolved.value
        model, optimizer, arch, layout = (
            value.model,
            value.optimizer,
            resolved.layout.critic_architecture,
            resolved.layout.critic,
        )
        value_model, freeze, lora, where = True, value.freeze_attention, value.lora, "value.model"  # fmt: skip
    fraction = optimizer.offload_fraction if optimizer.cpu_offload else 0.0
    distributed = optimizer.distributed_optimizer
    nccl = NCCL_GIB_PER_COMMUNICATOR * len(communicators(resolved, role, layout))
    fixed = {"cuda_context": CUDA_CONTEXT_GIB, "fragmentation": FRAGMENTATION_GIB, "nccl": nccl}
    worst: GpuMemory | None = None  # the fuller of the first and last pipeline stage
    rank, targets = (lora.rank, tuple(lora.target_modules)) if lora else (None, LORA_TARGETS)
    # The TE layer spec (CUDA, CP = 1, model.transformer_engine not off: models/builder.py) fuses
    # linear_qkv's and a dense fc1's input norm.
    fused_norms = resolved.deployment.device == "cuda" and layout.cp == 1 and model.transformer_engine != "off"  # fmt: skip
    for stage in sorted({0, layout.pp - 1}):
        params = rank_parameters(
            arch, layout, value_model=value_model, freeze_attention=freeze, lora_rank=rank, lora_targets=targets,
            stage=stage,
        )  # fmt: skip
        elements = adam_tensor_elements(params, layout, distributed)
        on_gpu, on_host = optimizer_bytes(elements, model.dtype, fraction)
        size = BYTES[model.dtype]
        weights = params.total * size / GIB
        activations = activation_bytes(arch, layout, model.seq_len, model.dtype, model.recompute, value_model, stage,
                                       lora_rank=rank, lora_targets=targets, fused_norms=fused_norms)  # fmt: skip
        chunk = LOGPROB_CHUNK_BYTES if stage == layout.pp - 1 and not value_model else 0.0
        parts = {
            "weights": weights,
            "gradients": params.trainable * 4 / GIB,
            "optimizer": on_gpu / GIB,
            "activations": (activations - chunk) / GIB,
        }
        if chunk:
            parts["logprob_chunk"] = chunk / GIB
        # A LoRA policy's reference is its own model with the adapters off: no second copy.
        reference = role == "policy" and resolved.algorithm.kl_coef > 0 and resolved.lora is None
        if reference:
            parts["reference"] = weights  # the frozen initial policy, same layout and dtype
        if role == "policy" and resolved.layout.sampler_routes:
            parts["routes"] = routes_bytes(resolved) / GIB
        if role == "policy" and stage == layout.pp - 1 and top_k_kl(resolved):
            parts["top_k_kl"] = top_k_kl_bytes(resolved) / GIB
        parts.update(fixed)
        tensors = rank_tensors(arch, layout, value_model, freeze, rank, stage, distributed, targets)
        peaks = [
            _start_up_peak(params, size, distributed, fraction, parts, fixed, reference),
            _resume_peak(parts, tensors, fraction, elements, optimizer.cpu_offload),
        ]
        host = offloaded_host_memory(tensors, size, fraction) if optimizer.cpu_offload else None
        host_gib = sum(host.steady.values()) / GIB if host else on_host / GIB  # pinned rounding included
        gpu = GpuMemory(role, where, parts, host_gib=host_gib, peaks=peaks, host=host)
        if worst is None or gpu.largest().total > worst.largest().total:
            worst = gpu
    return worst


# Distillation's top_k_kl on the policy's last stage, per token and teacher entry: the micro-batch's
# ids (int64) and log-probabilities (fp32), and what the fused kernel keeps for its backward pass
# (the local ids, their in-range mask, the teacher's probabilities) and writes in it (the gradient
# at the ids).
TOP_K_KL_BYTES_PER_ENTRY = 8 + 4 + 8 + 1 + 4 + 4


def top_k_kl(resolved: ResolvedConfig) -> bool:
    return resolved.distillation is not None and resolved.distillation.mode == "top_k_kl"


def top_k_kl_bytes(resolved: ResolvedConfig) -> float:
    """What distillation's top_k_kl adds on the policy's last stage for one packed row: the
    teacher's top k per token (TOP_K_KL_BYTES_PER_ENTRY each), and no logits-sized tensor: the
    policy loss computes log p, entropy and the top-k KL in one kernel whose backward writes the
    one logits gradient already counted (models/logprobs.py `vocab_parallel_logprobs_and_top_k_kl`).
    Measured (tests/distributed/test_logprobs.py, 1024 tokens x 4096 bf16 logits, top 64, chunks of
    64 rows): the backward's peak is 3.53 bytes a logit against the plain log-prob kernel's 3.51,
    where two separate kernels on the same logits reached 6.00 (a second bf16 gradient)."""
    layout, model = resolved.layout.policy, resolved.model
    return model.seq_len / layout.cp * resolved.distillation.top_k * TOP_K_KL_BYTES_PER_ENTRY


def _start_up_peak(params: RankParameters, size: int, distributed: bool, fraction: float, steady: dict,
                   fixed: dict, reference: bool) -> Peak:  # fmt: skip
    """The largest moment of building DDP (dense buffers, then expert buffers), the optimizer,
    then the KL reference (module docstring)."""
    weights = params.total * size / GIB
    new_copy = size / GIB if distributed else 0.0  # the distributed optimizer re-maps the weights
    dense, expert = params.dense_trainable, params.expert_trainable
    moments = [
        Peak("start-up", "DDP builds the dense buffers", {
            "weights": weights, "new_dense_weights": dense * new_copy, "dense_gradients": dense * 4 / GIB, **fixed}),
        Peak("start-up", "DDP builds the expert buffers", {
            "weights": weights, "new_expert_weights": expert * new_copy, "gradients": params.trainable * 4 / GIB,
            **fixed}),
    ]  # fmt: skip
    building = {"weights": weights, "gradients": steady["gradients"], "optimizer": steady["optimizer"]}
    if 0.0 < fraction < 1.0:  # the first hybrid optimizer's fp32 copies of the GPU share, of full parameters
        building["first_optimizer_copies"] = params.trainable * (1.0 - fraction) * 4 / GIB
    moments.append(Peak("start-up", "the optimizer is built", {**building, **fixed}))
    if reference:
        resident = {k: steady[k] for k in ("weights", "gradients", "optimizer")}
        moments.append(Peak("start-up", "the KL reference is built", {**resident, "reference": steady["reference"], **fixed}))  # fmt: skip
    return max(moments, key=lambda peak: peak.total)


def _resume_peak(steady: dict, tensors: list[ShardTensor], fraction: float, elements: float, offload: bool) -> Peak:
    """A checkpoint load before the first step (module docstring)."""
    parts = {k: v for k, v in steady.items() if k not in ("activations", "logprob_chunk", "routes")}
    if offload and fraction < 1.0:
        # trainer/optimizer.py's state initialisation: one zero fp32 gradient buffer per device, as
        # large as the largest parameter stepped there (a whole tensor: most lie in one rank's range)
        parts["state_init_gradient"] = max(t.elements for t in tensors) * 4 / GIB
    return Peak("resume", "a checkpoint is loaded", parts)


def route_bytes_per_token(arch: Architecture) -> int:
    """The routes of one token on the wire and in a policy GPU's memory: layers x top-k expert
    indices (uint8 up to 256 experts, else uint16) and its `routed` flag (data/types.py)."""
    return arch.num_layers * arch.num_experts_per_tok * (1 if arch.num_experts <= 256 else 2) + 1


def routes_bytes(resolved: ResolvedConfig) -> float:
    """One policy GPU's routes under routing replay (an upper bound; the module docstring)."""
    arch, layout, model, o = (resolved.layout.policy_architecture, resolved.layout.policy, resolved.model,
                              resolved.orchestrator)  # fmt: skip
    tokens = o.batch_size * o.group_size * model.seq_len / (layout.dp * layout.cp)
    local_layers = -(-arch.num_layers // layout.pp)  # the fuller stage's
    sp = layout.tp if layout.sp > 1 else 1
    targets = model.seq_len / layout.cp / sp * arch.num_experts_per_tok * 8 * local_layers
    return tokens * route_bytes_per_token(arch) + targets


def _inference_gpu(resolved: ResolvedConfig) -> GpuMemory:
    arch, inference = resolved.layout.policy_architecture, resolved.inference
    layout = ModelLayout(world_size=1, tp=1, cp=1, pp=1, ep=1, dp=1, expert_dp=1)
    single = rank_parameters(arch, layout)
    budget = resolved.deployment.gpu_memory_gib * inference.gpu_memory_utilization
    weights = single.total * 2 / inference.tp / GIB  # vLLM serves 16-bit weights, split by its TP
    kv = budget - weights - VLLM_RESERVE_GIB
    parts = {"weights": weights, "kv_cache": max(kv, 0.0), "reserve": VLLM_RESERVE_GIB}
    # vLLM's start-up (its profile run) stays within gpu_memory_utilization; a weight update
    # receives one decoder layer at a time (policy/publish/) beside it, over its own communicator
    # under weight_update nccl, both outside vLLM's share of the GPU.
    layer = sum(count for count, _ in layer_parameters(arch, 1, 1).values()) * 2 / inference.tp / GIB
    update = {**parts, "update_layer": layer}
    if inference.weight_update == "nccl":
        update["nccl"] = NCCL_GIB_PER_COMMUNICATOR
    peaks = [Peak("start-up", "vLLM starts (within gpu_memory_utilization)", parts),
             Peak("weight update", "a new policy version is received", update)]  # fmt: skip
    return GpuMemory("inference", "inference", parts, peaks=peaks)


def _megatron_teacher_gpu(resolved: ResolvedConfig, name: str) -> GpuMemory:
    """One GPU of the Megatron teacher (the fuller of its first and last pipeline stage): its
    weights in its dtype at its layout, one layer's activations of a packed row of model.seq_len
    tokens (forward-only: nothing is kept for a backward pass; a layer's input and output are
    alive at once), and on the last stage the row's logits in its dtype and one fp32 log-prob chunk
    (models/logprobs.py); no gradients, no optimizer state; its weights never change."""
    service = resolved.layout.services[name]
    arch, layout, megatron = service.architecture, service.megatron, resolved.distillation.teacher.megatron
    size, seq_len = BYTES[megatron.dtype], resolved.model.seq_len
    one_stage = layout.model_copy(update={"pp": 1})
    layer = activation_bytes(arch, one_stage, seq_len, megatron.dtype, RecomputeConfig(), value_model=True) / arch.num_layers
    nccl = NCCL_GIB_PER_COMMUNICATOR * len(communicators(resolved, name, layout))
    worst = None
    for stage in sorted({0, layout.pp - 1}):
        parts = {"weights": rank_parameters(arch, layout, stage=stage).total * size / GIB,
                 "activations": 2 * layer / GIB if stage_layers(arch, layout.pp, stage) else 0.0}  # fmt: skip
        if stage == layout.pp - 1:
            parts["activations"] += seq_len / layout.cp * arch.vocab_size / layout.tp * size / GIB
            parts["logprob_chunk"] = LOGPROB_CHUNK_BYTES / GIB
        parts.update({"cuda_context": CUDA_CONTEXT_GIB, "fragmentation": FRAGMENTATION_GIB, "nccl": nccl})
        gpu = GpuMemory(name, MEGATRON_TEACHER_KEY, parts)
        if worst is None or gpu.total > worst.total:
            worst = gpu
    return worst


def _served_gpu(resolved: ResolvedConfig, name: str) -> GpuMemory:
    """One GPU of served model `name` (teacher, judge): 16-bit weights split by its tp, the KV
    cache vLLM gets at its gpu_memory_utilization, vLLM's reserve; its weights never change."""
    service = resolved.layout.services[name]
    if not service.is_vllm:
        return _megatron_teacher_gpu(resolved, name)
    serve = served_models(resolved)[name][1]
    single = rank_parameters(service.architecture, ModelLayout(world_size=1, tp=1, cp=1, pp=1, ep=1, dp=1, expert_dp=1))
    budget = resolved.deployment.gpu_memory_gib * serve.gpu_memory_utilization
    weights = single.total * 2 / service.tp / GIB
    parts = {"weights": weights, "kv_cache": max(budget - weights - VLLM_RESERVE_GIB, 0.0), "reserve": VLLM_RESERVE_GIB}
    peaks = [Peak("start-up", "vLLM starts (within gpu_memory_utilization)", parts)]
    return GpuMemory(name, service.key, parts, peaks=peaks)


def gpu_totals(resolved: ResolvedConfig) -> dict[str, int]:
    """GPUs of every role (policy inference, critic, policy, and each served model) by name."""
    deployment, layout = resolved.deployment, resolved.layout
    totals = {"inference": deployment.inference_gpus, "critic": layout.value_gpus, "policy": deployment.policy_gpus}
    totals.update({name: service.gpus for name, service in layout.services.items()})
    return {name: gpus for name, gpus in totals.items() if gpus}


def kv_bytes_per_token(arch: Architecture, tp: int) -> float:
    """K and V of every layer for one token on one GPU (16-bit; KV heads split by TP, or
    replicated when there are fewer than TP of them). With multi-latent attention vLLM caches the
    kv latent and the shared rotary key instead, kv_lora_rank + qk_rope_head_dim a layer, whole on
    every TP rank."""
    if arch.multi_latent_attention:
        return arch.num_layers * (arch.kv_lora_rank + arch.qk_rope_head_dim) * 2
    heads = max(arch.num_key_value_heads / tp, 1)
    return 2 * arch.num_layers * heads * arch.kv_channels * 2


def memory_plan(resolved: ResolvedConfig) -> list[GpuMemory]:
    plan = [_training_gpu(resolved, "policy")]
    if resolved.value is not None and resolved.layout.critic is not None:
        plan.append(_training_gpu(resolved, "critic"))
    if resolved.deployment.inference_gpus:
        plan.append(_inference_gpu(resolved))
    plan += [_served_gpu(resolved, name) for name in resolved.layout.services]
    return plan


def node_host_memory(resolved: ResolvedConfig, plan: list[GpuMemory]) -> list[tuple[str, float, dict[str, int]]]:
    """Per kind of node: (name, host GiB at its largest moment, training ranks by role), summing
    each rank's offloaded-optimizer host memory over the training ranks the node holds."""
    host = {gpu.role: gpu.host for gpu in plan if gpu.host is not None}
    if not host:
        return []
    deployment, style = resolved.deployment, resolved.layout.deployment_style
    shared = deployment.num_value_gpus_per_train_node if style == "shared" else 0
    nodes = [("policy node", {"policy": min(deployment.policy_gpus, deployment.gpus_per_node - shared), "critic": shared})]
    if style == "dedicated":
        nodes.append(("critic node", {"critic": min(resolved.layout.value_gpus, deployment.gpus_per_node)}))
    out = []
    for name, ranks in nodes:
        moments = {}
        for moment in ("steady", "start_up", "resume"):
            moments[moment] = sum(
                count * sum(getattr(host[role], moment).values()) for role, count in ranks.items() if role in host
            )
        out.append((name, max(moments.values()) / GIB, {r: c for r, c in ranks.items() if c and r in host}))
    return out


def check_fits(resolved: ResolvedConfig, plan: list[GpuMemory]) -> list[str]:
    """Errors for GPUs the plan overfills at their largest peak, and for nodes whose host memory
    the offloaded optimizers overfill (CUDA deployments only)."""
    if resolved.deployment.device != "cuda":
        return []
    budget = resolved.deployment.gpu_memory_gib
    errors = []
    for gpu in plan:
        if gpu.role == "inference":
            per_token = kv_bytes_per_token(resolved.layout.policy_architecture, resolved.inference.tp)
            longest = resolved.orchestrator.max_prompt_tokens + resolved.orchestrator.max_completion_tokens
            need = longest * per_token / GIB
            if gpu.parts["kv_cache"] < need:
                errors.append(
                    f"inference: the weights ({gpu.parts['weights']:.1f} GiB per GPU at inference.tp "
                    f"{resolved.inference.tp}) leave {gpu.parts['kv_cache']:.1f} GiB of KV cache at "
                    f"gpu_memory_utilization {resolved.inference.gpu_memory_utilization} of "
                    f"{budget:g} GiB; one {longest}-token sequence needs {need:.2f} GiB: raise inference.tp"
                )
            peak = gpu.largest()
            if peak.total > budget:
                parts = ", ".join(f"{k} {v:.1f}" for k, v in peak.parts.items())
                errors.append(
                    f"inference: the {peak.name} peak (when {peak.moment}) needs about {peak.total:.1f} GiB per GPU "
                    f"({parts} GiB), more than deployment.gpu_memory_gib = {budget:g}: lower "
                    f"inference.gpu_memory_utilization ({resolved.inference.gpu_memory_utilization})"
                )
            continue
        if gpu.role in resolved.layout.services:
            errors += _served_errors(resolved, gpu, budget)
            continue
        peak = gpu.largest()
        if peak.total <= budget:
            continue
        over = peak.total - budget
        prefix = "value." if gpu.role == "critic" else ""
        parts = ", ".join(f"{k} {v:.1f}" for k, v in peak.parts.items())
        fixes = []
        model = resolved.value.model if gpu.role == "critic" else resolved.model
        optimizer = resolved.value.optimizer if gpu.role == "critic" else resolved.optimizer
        if gpu.parts["optimizer"] > 0.01:
            fixes.append(
                f"{prefix}optimizer.cpu_offload: true (offload_fraction 1 moves {gpu.parts['optimizer']:.1f} GiB to the host)"
            )
        if peak.name == "steady" and model.recompute.granularity != "full":
            fixes.append(f"{prefix}model.recompute {{granularity: full, method: uniform, num_layers: 1}}")
        fixes.append("more GPUs for this model (its ep, tp or pp) to split the weights")
        what = "" if peak.name == "steady" else f"'s {peak.name} peak (when {peak.moment})"
        errors.append(
            f"{gpu.where}: the {gpu.role}{what} needs about {peak.total:.1f} GiB per GPU ({parts} GiB), "
            f"{over:.1f} GiB more than deployment.gpu_memory_gib = {budget:g}; "
            + (f"the optimizer state is already offloaded at offload_fraction {optimizer.offload_fraction:g}; "
               if optimizer.cpu_offload else "")
            + "options: " + "; ".join(fixes)
        )  # fmt: skip
    host_budget = resolved.deployment.host_memory_gib
    for name, need, ranks in node_host_memory(resolved, plan):
        if need > host_budget:
            each = ", ".join(f"{count} {role} ranks" for role, count in ranks.items())
            errors.append(
                f"deployment.host_memory_gib: a {name} needs about {need:.0f} GiB of host memory for the offloaded "
                f"optimizer state of its {each} (pinned allocations rounded to powers of two), more than "
                f"deployment.host_memory_gib = {host_budget:g}; options: a lower optimizer.offload_fraction, "
                "more nodes for the training ranks, or deployment.host_memory_gib if the nodes have more"
            )
    return errors


def _served_errors(resolved: ResolvedConfig, gpu: GpuMemory, budget: float) -> list[str]:
    """A served model's GPU: the KV cache holds one sequence of its max_model_len, and the whole
    fits (a Megatron teacher: the whole fits)."""
    service = resolved.layout.services[gpu.role]
    if not service.is_vllm:
        if gpu.total <= budget:
            return []
        parts = ", ".join(f"{k} {v:.1f}" for k, v in gpu.parts.items())
        return [f"{MEGATRON_TEACHER_KEY}: the {gpu.role} needs about {gpu.total:.1f} GiB per GPU ({parts} GiB), "
                f"{gpu.total - budget:.1f} GiB more than deployment.gpu_memory_gib = {budget:g}; options: a larger "
                f"{MEGATRON_TEACHER_KEY}.tp or pp to split the weights (ep for an MoE teacher's experts)"]  # fmt: skip
    serve = served_models(resolved)[gpu.role][1]
    need = service.max_model_len * kv_bytes_per_token(service.architecture, service.tp) / GIB
    errors = []
    if gpu.parts["kv_cache"] < need:
        errors.append(
            f"{service.key}: the {gpu.role}'s weights ({gpu.parts['weights']:.1f} GiB per GPU at {service.key}.serve.tp "
            f"{service.tp}) leave {gpu.parts['kv_cache']:.1f} GiB of KV cache at serve.gpu_memory_utilization "
            f"{serve.gpu_memory_utilization} of {budget:g} GiB; one {service.max_model_len}-token sequence needs "
            f"{need:.2f} GiB: raise {service.key}.serve.tp"
        )
    if gpu.total > budget:
        errors.append(f"{service.key}: the {gpu.role} needs about {gpu.total:.1f} GiB per GPU, more than "
                      f"deployment.gpu_memory_gib = {budget:g}: lower {service.key}.serve.gpu_memory_utilization")  # fmt: skip
    return errors


COLUMNS = ["weights", "reference", "routes", "gradients", "optimizer", "activations", "logprob_chunk",
           "cuda_context", "fragmentation", "nccl", "kv_cache", "reserve"]  # fmt: skip


def weight_update_gib(resolved: ResolvedConfig) -> tuple[float, float | None]:
    """GiB one policy version sends to inference, in the model's dtype (`model.dtype`: both paths
    send the trainer's tensors as they are): (the whole model, as merged or full weights travel;
    the adapters alone when a LoRA policy is served as adapters (the layout's `policy_lora.serve`), else None). The
    adapters are counted as they are sent (`published_lora_elements`: PEFT's tensors for
    `lora.target_modules`, one A per Hugging Face module), not as the trainer holds them. The
    whole model includes the buffers a version carries (the routers' float32 expert bias)."""
    arch = resolved.layout.policy_architecture
    single = rank_parameters(arch, ModelLayout(world_size=1, tp=1, cp=1, pp=1, ep=1, dp=1, expert_dp=1))
    element = BYTES[resolved.model.dtype]
    # + the weights that are buffers (the routers' expert bias, float32), which a version carries too
    full = (single.total * element + weight_buffer_bytes(arch)) / GIB
    lora = resolved.layout.policy_lora
    if lora is None or lora.serve != "adapter":
        return full, None
    return full, published_lora_elements(arch, lora.rank, lora.target_modules) * element / GIB


def format_plan(resolved: ResolvedConfig, plan: list[GpuMemory]) -> str:
    """The plan as tables, in GiB per GPU: the steady state by part, then every training GPU's
    steady, start-up and resume peaks (with the parts of the two latter), then host memory."""
    budget = resolved.deployment.gpu_memory_gib
    lines = [
        f"memory plan (GiB per GPU; budget deployment.gpu_memory_gib = {budget:g}"
        + ("" if resolved.deployment.device == "cuda" else "; deployment.device cpu: not checked")
        + ")",
        f"{'role':<10}" + "".join(f"{c:>14}" for c in COLUMNS) + f"{'total':>10}{'host':>8}",
    ]
    for gpu in plan:
        cells = "".join(f"{gpu.parts[c]:>14.2f}" if c in gpu.parts else f"{'-':>14}" for c in COLUMNS)
        lines.append(f"{gpu.role:<10}{cells}{gpu.total:>10.2f}{gpu.host_gib:>8.1f}")
    totals = gpu_totals(resolved)
    deployment = resolved.deployment
    lines.append("GPUs: " + " + ".join(f"{name} {gpus}" for name, gpus in totals.items())
                 + f" = {sum(totals.values())} of {deployment.nodes} node(s) x {deployment.gpus_per_node} = "
                 f"{deployment.nodes * deployment.gpus_per_node}")  # fmt: skip
    lines.append(f"peaks (GiB per GPU; the largest must fit in {budget:g})")
    lines.append(f"{'role':<10}{'steady':>10}{'start-up':>10}{'resume':>10}  largest (GiB)")
    for gpu in plan:
        if not gpu.peaks:
            continue
        by_name = {peak.name: peak for peak in gpu.all_peaks()}
        cells = "".join(f"{by_name[n].total:>10.2f}" if n in by_name else f"{'-':>10}" for n in ("steady", "start-up", "resume"))  # fmt: skip
        largest = gpu.largest()
        lines.append(f"{gpu.role:<10}{cells}  {largest.name} {largest.total:.2f}")
        for peak in gpu.peaks:
            parts = ", ".join(f"{k} {v:.2f}" for k, v in peak.parts.items())
            lines.append(f"  {gpu.role} {peak.name} (when {peak.moment}): {parts}")
    for gpu in plan:
        if gpu.host is not None:
            moments = {"steady": gpu.host.steady, "start-up": gpu.host.start_up, "resume": gpu.host.resume}
            lines.append(f"  {gpu.role} host per rank (GiB): " + "; ".join(
                f"{moment} {sum(parts.values()) / GIB:.1f} (" + ", ".join(f"{k} {v / GIB:.1f}" for k, v in parts.items()) + ")"
                for moment, parts in moments.items()))  # fmt: skip
    for name, need, ranks in node_host_memory(resolved, plan):
        each = ", ".join(f"{count} {role}" for role, count in ranks.items())
        lines.append(f"host memory of a {name} ({each} ranks): {need:.0f} GiB at its largest "
                     f"(budget deployment.host_memory_gib = {resolved.deployment.host_memory_gib:g})")  # fmt: skip
    full, adapters = weight_update_gib(resolved)
    dtype = resolved.model.dtype
    if adapters is None:
        lines.append(f"weight update per policy version: {full:.2f} GiB (the whole model, {dtype})")
    else:
        lines.append(f"weight update per policy version: {adapters:.2f} GiB of LoRA adapters in PEFT's format "
                     f"({adapters / full:.2%} of the {full:.2f} GiB whole model, both {dtype})")  # fmt: skip
    return "\n".join(lines)
