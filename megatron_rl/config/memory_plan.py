"""Memory plan: what each GPU of each role will hold, before anything is started.

`memory_plan(resolved)` estimates, per GPU of the policy and of the critic: weights,
gradients, optimizer state (sharded by the distributed optimizer over DP x CP for dense and over
expert-DP for expert parameters, as megatron shards it, minus what `optimizer.cpu_offload`
keeps on the host), activations of one micro-batch (one packed row of `seq_len` tokens, split
by CP, and by TP under sequence parallelism) with the configured recomputation, the logits,
and a fixed allowance for the CUDA context, NCCL buffers and allocator fragmentation; and per
inference GPU the weights and the KV cache vLLM gets at `inference.gpu_memory_utilization`.
`check_fits` turns a plan over `deployment.gpu_memory_gib` into errors that say by how much and
which option would fix it; `check-config` prints the plan.

What is exact and what is estimated:
- parameter counts per rank follow megatron's sharding of our builders (column/row parallel
  linears split by TP, experts by EP and expert-TP = TP, embeddings and output layer by TP on
  the first/last pipeline stage, norms and the router replicated); tests/distributed/
  test_memory_plan.py checks them against tiny models built at several layouts, exactly, and the
  optimizer state against the Adam tensors megatron allocates (exact over the DP group; on one
  rank up to the distributed optimizer's bucket padding);
- gradients: megatron's DDP grad buffer (fp32 here: `grad_reduce_in_fp32`) holds every trainable
  parameter of the rank, unsharded;
- optimizer state: Adam moments (2 x 4 bytes) plus an fp32 master copy (4 bytes) when the
  model is bf16/fp16, per trainable parameter, divided by the sharding group; under
  `optimizer.cpu_offload` (megatron's hybrid device optimizer on the precision-aware path) the
  GPU keeps that for the share not offloaded, and the host holds, per offloaded element, the
  fp32 master (the host copy of an fp32 weight), the two moments and the pinned fp32 copy of
  its gradient: 16 bytes (`HOST_OFFLOAD_BYTES`); tests/distributed/test_memory_plan.py checks
  both shares against the tensors the hybrid optimizer allocates;
- the frozen KL reference policy (`algorithm.kl_coef` > 0): a second copy of the policy's
  weights on every policy GPU (its forward pass runs before the training pass, so its
  activations are not held at the same time);
- activations are an estimate (per token and layer: the inputs of the norms, QKV, the attention
  output, SwiGLU's gate/up and product, for MoE the routed copies of the top-k experts), not a
  measurement; the GPU script (tests/gpu/run.sh) is where it gets compared with CUDA's peak;
- routing replay (`algorithm.routing_replay` on): the policy builds every micro-batch of a step
  before its first forward, so each policy GPU holds the routes of its share of the step's
  tokens at once: at most batch_size x group_size samples of model.seq_len tokens over DP x CP,
  each token L x k experts (1 byte up to 256 experts, else 2) and one `routed` byte, plus one
  layer's int64 targets for one micro-batch's tokens per local layer (`routes_bytes`; an upper
  bound: samples are rarely seq_len long);
- `OVERHEAD_GIB` is an allowance, not a measurement.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_rl.config.layout import ModelLayout, ResolvedConfig
from megatron_rl.config.model import Architecture, RecomputeConfig

GIB = float(1 << 30)
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
OVERHEAD_GIB = 5.0  # CUDA context, NCCL buffers, allocator fragmentation: an allowance
# Per offloaded optimizer element on the host: fp32 master 4, exp_avg 4, exp_avg_sq 4, and the
# pinned fp32 gradient copy the hybrid optimizer keeps for the host step 4.
HOST_OFFLOAD_BYTES = 16
# The log-prob kernel (models/logprobs.py) keeps the logits (model dtype) and writes one gradient
# of the same dtype; its fp32 temporaries are chunk-sized, at most 24 B per element of a chunk of
# CHUNK_ELEMENTS (tests/distributed/test_logprobs.py; docs/gpu/review.md has the measurement).
LOGITS_PER_LOGIT = 2  # the logits and their gradient, each in the model's dtype
LOGPROB_CHUNK_ELEMENTS = 1 << 24  # models.logprobs.CHUNK_ELEMENTS (config imports nothing of ours)
LOGPROB_CHUNK_BYTES_PER_ELEMENT = 24
LOGPROB_CHUNK_BYTES = LOGPROB_CHUNK_BYTES_PER_ELEMENT * LOGPROB_CHUNK_ELEMENTS
VLLM_RESERVE_GIB = 4.0  # vLLM's activations, CUDA graphs and sampler beside weights and KV cache


@dataclass(frozen=True)
class RankParameters:
    """Parameter counts on one rank: all of them and the trainable ones, dense and expert."""

    dense: int
    expert: int
    dense_trainable: int
    expert_trainable: int

    @property
    def total(self) -> int:
        return self.dense + self.expert

    @property
    def trainable(self) -> int:
        return self.dense_trainable + self.expert_trainable


def layer_parameters(arch: Architecture, tp: int, ep: int) -> dict[str, tuple[int, bool]]:
    """One transformer layer's parameters on one rank: name -> (count, is_expert)."""
    h, d = arch.hidden_size, arch.kv_channels
    nq, nkv = arch.num_attention_heads, arch.num_key_value_heads
    parts = {
        "input_layernorm": (h, False),
        "self_attention.linear_qkv": (h * (nq + 2 * nkv) * d // tp, False),
        "self_attention.linear_proj": (nq * d * h // tp, False),
        "pre_mlp_layernorm": (h, False),
    }
    if arch.qk_norm:
        parts["self_attention.q_layernorm"] = (d, False)
        parts["self_attention.k_layernorm"] = (d, False)
    if arch.num_experts:
        f = arch.moe_intermediate_size
        parts["mlp.router"] = (arch.num_experts * h, False)
        parts["mlp.experts"] = ((arch.num_experts // ep) * 3 * h * f // tp, True)
    else:
        parts["mlp.linear_fc1"] = (h * 2 * arch.intermediate_size // tp, False)
        parts["mlp.linear_fc2"] = (arch.intermediate_size * h // tp, False)
    return parts


def rank_parameters(
    arch: Architecture,
    layout: ModelLayout,
    *,
    value_model: bool = False,
    freeze_attention: bool = False,
    lora_rank: int | None = None,
    stage: int = 0,
) -> RankParameters:
    """The parameters pipeline stage `stage` of a model holds on each of its ranks."""
    tp, pp, ep = layout.tp, layout.pp, layout.ep
    first, last = stage == 0, stage == pp - 1
    layers = arch.num_layers // pp + (1 if stage < arch.num_layers % pp else 0)
    dense = expert = dense_frozen = expert_frozen = 0
    for name, (count, is_expert) in layer_parameters(arch, tp, ep).items():
        frozen = freeze_attention and name.startswith("self_attention.")
        if is_expert:
            expert += count * layers
            expert_frozen += count * layers if frozen else 0
        else:
            dense += count * layers
            dense_frozen += count * layers if frozen else 0
    embedding = arch.vocab_size // tp * arch.hidden_size
    if first:
        dense += embedding
    if last:
        dense += arch.hidden_size  # final_layernorm
        if value_model:
            dense += arch.hidden_size + 1  # value_head (weight and bias)
        elif not (arch.tie_word_embeddings and first):
            dense += embedding  # output_layer
    if lora_rank is not None:  # adapters train, the backbone does not (the value head does)
        head = arch.hidden_size + 1 if value_model and last else 0
        adapters = _lora_parameters(arch, tp, ep, lora_rank) * layers
        return RankParameters(dense + adapters, expert, adapters + head, 0)
    return RankParameters(dense, expert, dense - dense_frozen, expert - expert_frozen)


def _lora_parameters(arch: Architecture, tp: int, ep: int, rank: int) -> int:
    """Adapter parameters per layer for the default targets (A: rank x in, B: out x rank on each
    wrapped linear, the TP-split side divided by TP): an upper bound within a few percent."""
    h, d = arch.hidden_size, arch.kv_channels
    qkv_out = (arch.num_attention_heads + 2 * arch.num_key_value_heads) * d
    total = rank * (h + qkv_out // tp) + rank * (arch.num_attention_heads * d // tp + h)
    if arch.num_experts:
        f = arch.moe_intermediate_size
        total += (arch.num_experts // ep) * (rank * (h + 2 * f // tp) + rank * (f // tp + h))
    else:
        f = arch.intermediate_size
        total += rank * (h + 2 * f // tp) + rank * (f // tp + h)
    return total


def adam_tensor_elements(params: RankParameters, layout: ModelLayout, distributed: bool = True) -> float:
    """Elements of one Adam tensor (a moment, or the fp32 master copy) on one rank: every
    trainable parameter's, sharded by the distributed optimizer over DP x CP (dense) and
    expert-DP (experts)."""
    if not distributed:
        return float(params.trainable)
    return params.dense_trainable / (layout.dp * layout.cp) + params.expert_trainable / layout.expert_dp


def adam_tensors(dtype: str) -> int:
    """Two moments, plus an fp32 master copy of a 16-bit model's weights."""
    return 2 + (1 if BYTES[dtype] < 4 else 0)


def optimizer_bytes(elements: float, dtype: str, offload_fraction: float) -> tuple[float, float]:
    """(GPU bytes, host bytes) of the optimizer for `elements` (one Adam tensor's elements on the
    rank, `adam_tensor_elements`) with `offload_fraction` of them offloaded (0 without offload):
    the Adam tensors of the share kept on the GPU, `HOST_OFFLOAD_BYTES` per offloaded element."""
    gpu = elements * (1.0 - offload_fraction) * adam_tensors(dtype) * 4
    return gpu, elements * offload_fraction * HOST_OFFLOAD_BYTES


def activation_bytes(
    arch: Architecture,
    layout: ModelLayout,
    seq_len: int,
    dtype: str,
    recompute: RecomputeConfig,
    value_model: bool,
    stage: int = 0,
) -> float:
    """Activations kept for the backward pass of one micro-batch on one rank of stage `stage`
    (an estimate: see the module docstring), times the micro-batches in flight at that stage
    under 1F1B pipelining, plus the logits on the last stage."""
    tp, cp, pp = layout.tp, layout.cp, layout.pp
    moe = bool(arch.num_experts)
    sp = tp > 1 and moe  # our builders use sequence parallelism with MoE
    tokens = seq_len / cp
    h, d, b = arch.hidden_size, arch.kv_channels, BYTES[dtype]
    nq, nkv = arch.num_attention_heads, arch.num_key_value_heads
    replicated = 2 * h  # the two norms' inputs
    attention = h + (nq + 2 * nkv) * d + 2 * nq * d  # QKV input, q/k/v, attention output and proj input
    if moe:
        k, f = arch.num_experts_per_tok, arch.moe_intermediate_size
        mlp = h + k * (h + 3 * f) + 2 * arch.num_experts  # router in, routed copies, gate/up/product, logits
    else:
        mlp = h + 3 * arch.intermediate_size
    core_attention = 2 * nq * d  # what selective recomputation drops
    per_token = (replicated / (tp if sp else 1) + (attention + mlp) / tp) * b
    full_layer = tokens * per_token
    layers = arch.num_layers // pp + (1 if stage < arch.num_layers % pp else 0)
    if recompute.granularity == "full":
        n = recompute.num_layers
        checkpoint = tokens * h * b / (tp if sp else 1)  # a recomputed unit keeps only its input
        if recompute.method == "uniform":
            units = -(-layers // n)
            kept = units * checkpoint + min(n, layers) * full_layer  # one unit rebuilt at a time
        else:  # block: the first n layers of the stage are recomputed
            recomputed = min(n, layers)
            kept = recomputed * checkpoint + (layers - recomputed) * full_layer + full_layer
    elif recompute.granularity == "selective":
        kept = layers * (full_layer - tokens * core_attention * b / tp)
    else:
        kept = layers * full_layer
    in_flight = pp - stage if pp > 1 else 1
    total = kept * in_flight
    if stage == pp - 1 and not value_model:
        total += tokens * arch.vocab_size / tp * LOGITS_PER_LOGIT * b + LOGPROB_CHUNK_BYTES
    return total


@dataclass
class GpuMemory:
    """One GPU of one role, in GiB."""

    role: str
    where: str  # the config section, for messages
    parts: dict[str, float]
    host_gib: float = 0.0  # offloaded optimizer state (and its gradient copy), in host memory

    @property
    def total(self) -> float:
        return sum(self.parts.values())


def _training_gpu(resolved: ResolvedConfig, role: str) -> GpuMemory:
    if role == "policy":
        model, optimizer, arch, layout = (
            resolved.model, resolved.optimizer, resolved.layout.policy_architecture, resolved.layout.policy
        )  # fmt: skip
        value_model, freeze, lora, where = False, False, None, "model"
    else:
        value = resolved.value
        model, optimizer, arch, layout = (
            value.model,
            value.optimizer,
            resolved.layout.critic_architecture,
            resolved.layout.critic,
        )
        value_model, freeze, lora, where = True, value.freeze_attention, value.lora, "value.model"  # fmt: skip
    worst: GpuMemory | None = None  # the fuller of the first and last pipeline stage
    for stage in sorted({0, layout.pp - 1}):
        params = rank_parameters(
            arch, layout, value_model=value_model, freeze_attention=freeze,
            lora_rank=lora.rank if lora else None, stage=stage,
        )  # fmt: skip
        elements = adam_tensor_elements(params, layout, optimizer.distributed_optimizer)
        fraction = optimizer.offload_fraction if optimizer.cpu_offload else 0.0
        on_gpu, on_host = optimizer_bytes(elements, model.dtype, fraction)
        weights = params.total * BYTES[model.dtype] / GIB
        parts = {
            "weights": weights,
            "gradients": params.trainable * 4 / GIB,
            "optimizer": on_gpu / GIB,
            "activations": activation_bytes(arch, layout, model.seq_len, model.dtype, model.recompute, value_model, stage) / GIB,
            "overhead": OVERHEAD_GIB,
        }  # fmt: skip
        if role == "policy" and resolved.algorithm.kl_coef > 0:
            parts["reference"] = weights  # the frozen initial policy, same layout and dtype
        if role == "policy" and resolved.algorithm.routing_replay != "off":
            parts["routes"] = routes_bytes(resolved) / GIB
        gpu = GpuMemory(role, where, parts, host_gib=on_host / GIB)
        if worst is None or gpu.total > worst.total:
            worst = gpu
    return worst


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
    return GpuMemory(
        "inference", "inference",
        {"weights": weights, "kv_cache": max(kv, 0.0), "reserve": VLLM_RESERVE_GIB},
    )  # fmt: skip


def kv_bytes_per_token(arch: Architecture, tp: int) -> float:
    """K and V of every layer for one token on one GPU (16-bit; KV heads split by TP, or
    replicated when there are fewer than TP of them)."""
    heads = max(arch.num_key_value_heads / tp, 1)
    return 2 * arch.num_layers * heads * arch.kv_channels * 2


def memory_plan(resolved: ResolvedConfig) -> list[GpuMemory]:
    plan = [_training_gpu(resolved, "policy")]
    if resolved.value is not None and resolved.layout.critic is not None:
        plan.append(_training_gpu(resolved, "critic"))
    if resolved.deployment.inference_gpus:
        plan.append(_inference_gpu(resolved))
    return plan


def check_fits(resolved: ResolvedConfig, plan: list[GpuMemory]) -> list[str]:
    """Errors for GPUs the plan overfills (CUDA deployments only)."""
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
            continue
        if gpu.total <= budget:
            continue
        over = gpu.total - budget
        prefix = "value." if gpu.role == "critic" else ""
        parts = ", ".join(f"{k} {v:.1f}" for k, v in gpu.parts.items())
        fixes = []
        model = resolved.value.model if gpu.role == "critic" else resolved.model
        optimizer = resolved.value.optimizer if gpu.role == "critic" else resolved.optimizer
        if gpu.parts["optimizer"] > 0.01:
            fixes.append(
                f"{prefix}optimizer.cpu_offload: true (offload_fraction 1 moves {gpu.parts['optimizer']:.1f} GiB to the host)"
            )
        if model.recompute.granularity != "full":
            fixes.append(f"{prefix}model.recompute {{granularity: full, method: uniform, num_layers: 1}}")
        fixes.append("more GPUs for this model (its ep, tp or pp) to split the weights")
        errors.append(
            f"{gpu.where}: the {gpu.role} needs about {gpu.total:.1f} GiB per GPU ({parts} GiB), "
            f"{over:.1f} GiB more than deployment.gpu_memory_gib = {budget:g}; "
            + (f"the optimizer state is already offloaded at offload_fraction {optimizer.offload_fraction:g}; "
               if optimizer.cpu_offload else "")
            + "options: " + "; ".join(fixes)
        )  # fmt: skip
    return errors


def format_plan(resolved: ResolvedConfig, plan: list[GpuMemory]) -> str:
    """The plan as a table, in GiB per GPU."""
    budget = resolved.deployment.gpu_memory_gib
    columns = [
        "weights",
        "reference",
        "routes",
        "gradients",
        "optimizer",
        "activations",
        "overhead",
        "kv_cache",
        "reserve",
    ]
    lines = [
        f"memory plan (GiB per GPU; budget deployment.gpu_memory_gib = {budget:g}"
        + ("" if resolved.deployment.device == "cuda" else "; deployment.device cpu: not checked")
        + ")",
        f"{'role':<10}" + "".join(f"{c:>12}" for c in columns) + f"{'total':>10}{'host':>8}",
    ]
    for gpu in plan:
        cells = "".join(f"{gpu.parts[c]:>12.2f}" if c in gpu.parts else f"{'-':>12}" for c in columns)
        lines.append(f"{gpu.role:<10}{cells}{gpu.total:>10.2f}{gpu.host_gib:>8.1f}")
    return "\n".join(lines)
