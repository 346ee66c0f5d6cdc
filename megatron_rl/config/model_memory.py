"""What one rank of a model holds: its parameters (counts, and tensors as the optimizer shards
them), the Adam state, the activations of one micro-batch. config/memory_plan.py's docstring says
what is exact and what is estimated; it adds these up per GPU and moment."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_rl.config.host_memory import ShardTensor
from megatron_rl.config.layout import ModelLayout
from megatron_rl.config.model import LORA_TARGETS, Architecture, RecomputeConfig

BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
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


def layer_parameters(arch: Architecture, tp: int, ep: int, dense: bool = False) -> dict[str, tuple[int, bool]]:
    """One transformer layer's parameters on one rank: name -> (count, is_expert). An MoE model's
    layers have experts (and its shared experts, TP-split like a dense MLP) unless `dense` (its
    first `first_k_dense_layers`: `layer_is_dense`). The router's expert bias, a buffer of
    num_experts floats, is not a parameter and is left out."""
    h, d = arch.hidden_size, arch.kv_channels
    nq, nkv = arch.num_attention_heads, arch.num_key_value_heads
    parts = {"input_layernorm": (h, False)}
    if arch.multi_latent_attention:
        parts.update({name: (count, False) for name, count in latent_attention_parameters(arch, tp).items()})
    else:
        parts["self_attention.linear_qkv"] = ((h + arch.attention_bias) * (nq + 2 * nkv) * d // tp, False)
        parts["self_attention.linear_proj"] = (nq * d * h // tp, False)
    parts["pre_mlp_layernorm"] = (h, False)
    if arch.qk_norm:
        parts["self_attention.q_layernorm"] = (d, False)
        parts["self_attention.k_layernorm"] = (d, False)
    if arch.num_experts and not dense:
        f, s = arch.moe_intermediate_size, arch.shared_expert_intermediate_size
        parts["mlp.router"] = (arch.num_experts * h, False)
        parts["mlp.experts"] = ((arch.num_experts // ep) * 3 * h * f // tp, True)
        if s:
            parts["mlp.shared_experts"] = (3 * h * s // tp, False)
    else:
        parts["mlp.linear_fc1"] = (h * 2 * arch.intermediate_size // tp, False)
        parts["mlp.linear_fc2"] = (arch.intermediate_size * h // tp, False)
    return parts


def latent_attention_parameters(arch: Architecture, tp: int) -> dict[str, int]:
    """Multi-latent attention's parameters on one rank, by module: the down-projections to the q
    and kv latents and the latents' norms whole (TransformerEngine's spec runs the down-projections
    duplicated on every TP rank; megatron's local spec, used on CPU, splits them over TP), the
    up-projections (or the one q projection without q_lora_rank) and linear_proj split over TP."""
    h, heads, latent = arch.hidden_size, arch.num_attention_heads, arch.kv_lora_rank
    q_rows = heads * arch.kv_channels  # each head's q: its non-rotary, then its rotary channels
    parts = {}
    if arch.q_lora_rank is None:
        parts["self_attention.linear_q_proj"] = h * q_rows // tp
    else:
        parts["self_attention.linear_q_down_proj"] = h * arch.q_lora_rank
        parts["self_attention.q_layernorm"] = arch.q_lora_rank
        parts["self_attention.linear_q_up_proj"] = arch.q_lora_rank * q_rows // tp
    parts["self_attention.linear_kv_down_proj"] = h * (latent + arch.qk_rope_head_dim)
    parts["self_attention.kv_layernorm"] = latent
    parts["self_attention.linear_kv_up_proj"] = latent * heads * (arch.qk_nope_head_dim + arch.v_head_dim) // tp
    parts["self_attention.linear_proj"] = heads * arch.v_head_dim * h // tp
    return parts


def weight_buffer_bytes(arch: Architecture) -> int:
    """Bytes of the weights that are buffers, not parameters, as a published version holds them:
    the routers' expert bias (HF `e_score_correction_bias`), num_experts float32 per MoE layer
    (float32 whatever the model's dtype, as transformers keeps it)."""
    return 4 * arch.num_experts * len(arch.moe_layers) if arch.moe_expert_bias else 0


def layer_is_dense(arch: Architecture, layer: int) -> bool:
    """Whether decoder layer `layer` has a dense MLP (a dense model's, or an MoE model's first
    `first_k_dense_layers`)."""
    return layer not in arch.moe_layers


def stage_layer_indices(arch: Architecture, pp: int, stage: int) -> range:
    """The decoder layers of pipeline stage `stage` (`stage_layers` of them, in order)."""
    start = sum(stage_layers(arch, pp, s) for s in range(stage))
    return range(start, start + stage_layers(arch, pp, stage))


def rank_parameters(
    arch: Architecture,
    layout: ModelLayout,
    *,
    value_model: bool = False,
    freeze_attention: bool = False,
    lora_rank: int | None = None,
    lora_targets: tuple[str, ...] | list[str] = LORA_TARGETS,
    stage: int = 0,
) -> RankParameters:
    """The parameters pipeline stage `stage` of a model holds on each of its ranks; with
    `lora_rank`, the adapters on `lora_targets` (`lora_tensors`) are its trainable parameters,
    an expert's adapters counted with the experts (megatron's expert buffers, sharded over
    expert-DP)."""
    tp, pp, ep = layout.tp, layout.pp, layout.ep
    first, last = stage == 0, stage == pp - 1
    dense = expert = dense_frozen = expert_frozen = 0
    for layer in stage_layer_indices(arch, pp, stage):
        for name, (count, is_expert) in layer_parameters(arch, tp, ep, layer_is_dense(arch, layer)).items():
            frozen = freeze_attention and name.startswith("self_attention.")
            if is_expert:
                expert += count
                expert_frozen += count if frozen else 0
            else:
                dense += count
                dense_frozen += count if frozen else 0
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
        adapters = [t for layer in stage_layer_indices(arch, pp, stage)
                    for t in lora_tensors(arch, tp, ep, lora_rank, lora_targets, layer_is_dense(arch, layer))]  # fmt: skip
        dense_adapters = sum(n for _, n, is_expert in adapters if not is_expert)
        expert_adapters = sum(n for _, n, is_expert in adapters if is_expert)
        return RankParameters(
            dense + dense_adapters, expert + expert_adapters, dense_adapters + head, expert_adapters
        )
    return RankParameters(dense, expert, dense - dense_frozen, expert - expert_frozen)


def stage_layers(arch: Architecture, pp: int, stage: int) -> int:
    """Transformer layers of pipeline stage `stage` (the first num_layers % pp stages hold one more)."""
    return arch.num_layers // pp + (1 if stage < arch.num_layers % pp else 0)


def _adapted_linears(arch: Architecture, dense: bool = False) -> list[tuple[str, int, int, bool]]:
    """One layer's linears that LoRA can wrap, as megatron builds them: (target, in, out,
    is_expert); multi-latent attention's projections in place of linear_qkv; an MoE layer's
    linear_fc1/linear_fc2 stand for each of its experts' (`dense`: a dense layer of an MoE model),
    then its shared experts' (not experts: TP-split, DP-sharded)."""
    h, d = arch.hidden_size, arch.kv_channels
    nq, nkv = arch.num_attention_heads, arch.num_key_value_heads
    moe = bool(arch.num_experts) and not dense
    f = arch.moe_intermediate_size if moe else arch.intermediate_size
    if arch.multi_latent_attention:
        kv_up = arch.kv_lora_rank, nq * (arch.qk_nope_head_dim + arch.v_head_dim)
        if arch.q_lora_rank is None:
            query = [("linear_q_proj", h, nq * d, False)]
        else:
            query = [("linear_q_down_proj", h, arch.q_lora_rank, False),
                     ("linear_q_up_proj", arch.q_lora_rank, nq * d, False)]  # fmt: skip
        attention = [*query, ("linear_kv_down_proj", h, arch.kv_lora_rank + arch.qk_rope_head_dim, False),
                     ("linear_kv_up_proj", *kv_up, False), ("linear_proj", nq * arch.v_head_dim, h, False)]  # fmt: skip
    else:
        attention = [("linear_qkv", h, (nq + 2 * nkv) * d, False), ("linear_proj", nq * d, h, False)]
    linears = [*attention, ("linear_fc1", h, 2 * f, moe), ("linear_fc2", f, h, moe)]
    if moe and arch.shared_expert_intermediate_size:
        shared = arch.shared_expert_intermediate_size
        linears += [("linear_fc1", h, 2 * shared, False), ("linear_fc2", shared, h, False)]
    return linears


# Column-parallel linears (A whole, B's rows split over TP), and multi-latent attention's
# down-projections, which TE's spec runs duplicated (A and B whole on every TP rank; the local spec,
# used on CPU, splits them like column-parallel ones: the plan counts TE's, as
# `latent_attention_parameters` does their weights).
COLUMN_PARALLEL_TARGETS = ("linear_qkv", "linear_fc1", "linear_q_proj", "linear_q_up_proj", "linear_kv_up_proj")
DUPLICATED_TARGETS = ("linear_q_down_proj", "linear_kv_down_proj")


def lora_tensors(arch: Architecture, tp: int, ep: int, rank: int,
                 targets: tuple[str, ...] | list[str] = LORA_TARGETS, dense: bool = False) -> list[tuple[str, int, bool]]:  # fmt: skip
    """One layer's adapter tensors on one rank as the trainer holds them (transforms/lora.py):
    (name, elements, is_expert) of A [rank, in] and B [out, rank] for each wrapped linear in
    `targets`. A column-parallel linear (linear_qkv, linear_fc1, MLA's q and kv up-projections or
    q_proj) keeps A whole and splits B's rows by TP, a row-parallel one (linear_proj, linear_fc2)
    splits A's columns, MLA's down-projections keep both whole (TE's duplicated linears);
    megatron's fused linear_qkv (q, k, v) and gated linear_fc1 ([gate; up]) carry one A each. An
    MoE model's linear_fc1/linear_fc2 are its experts', one pair per local expert
    (num_experts / ep), split by expert-TP (= TP)."""
    out = []
    for target, fan_in, fan_out, is_expert in _adapted_linears(arch, dense):
        if target not in targets:
            continue
        column, duplicated = target in COLUMN_PARALLEL_TARGETS, target in DUPLICATED_TARGETS
        a = rank * (fan_in if column or duplicated else fan_in // tp)
        b = (fan_out // tp if column else fan_out) * rank
        out += [(f"{target}.lora_a", a, is_expert), (f"{target}.lora_b", b, is_expert)] * (
            arch.num_experts // ep if is_expert else 1
        )
    return out


def lora_parameters(arch: Architecture, tp: int, ep: int, rank: int,
                    targets: tuple[str, ...] | list[str] = LORA_TARGETS) -> int:  # fmt: skip
    """Adapter parameters of one layer on one rank as the trainer holds them (`lora_tensors`)."""
    return sum(n for _, n, _ in lora_tensors(arch, tp, ep, rank, targets))


def published_lora_elements(
    arch: Architecture, rank: int, targets: tuple[str, ...] | list[str] = LORA_TARGETS
) -> int:
    """Elements of one LoRA policy version as both publishing paths send it (PEFT's format,
    transforms/peft.py `megatron_adapters_to_peft`), over the whole model: A [rank, in] and
    B [out, rank] of every Hugging Face module the targets map to (conversion/hf_mapping.py), in every
    layer and expert. Megatron's fused linear_qkv is q_proj, k_proj and v_proj, its gated
    linear_fc1 gate_proj and up_proj, and each part gets its own copy of the layer's A
    (safetensors stores no shared memory): three A where the trainer holds one, and two."""
    d, nq, nkv = arch.kv_channels, arch.num_attention_heads, arch.num_key_value_heads
    total = 0
    for layer in range(arch.num_layers):
        for target, fan_in, fan_out, is_expert in _adapted_linears(arch, layer_is_dense(arch, layer)):
            if target not in targets:
                continue
            parts = {"linear_qkv": [nq * d, nkv * d, nkv * d], "linear_fc1": [fan_out // 2] * 2}.get(
                target, [fan_out]
            )
            total += sum(rank * fan_in + rows * rank for rows in parts) * (arch.num_experts if is_expert else 1)
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
    lora_rank: int | None = None,
    lora_targets: tuple[str, ...] | list[str] = LORA_TARGETS,
    fused_norms: bool = False,
) -> float:
    """Activations kept for the backward pass of one micro-batch on one rank of stage `stage`
    (an estimate: see the module docstring), times the micro-batches in flight at that stage
    under 1F1B pipelining, plus the logits on the last stage; with `lora_rank`, what the adapters
    on `lora_targets` keep besides (`adapter_bytes_per_token`; `fused_norms`: the TE layer spec,
    whose linear_qkv and dense linear_fc1 fuse their input norm)."""
    tp, cp, pp = layout.tp, layout.cp, layout.pp
    moe = bool(arch.num_experts)
    sp = tp > 1 and moe  # our builders use sequence parallelism with MoE
    tokens = seq_len / cp
    h, d, b = arch.hidden_size, arch.kv_channels, BYTES[dtype]
    nq, nkv = arch.num_attention_heads, arch.num_key_value_heads
    replicated = 2 * h  # the two norms' inputs
    attention = h + (nq + 2 * nkv) * d + 2 * nq * d  # QKV input, q/k/v, attention output and proj input
    core_attention = 2 * nq * d  # what selective recomputation drops
    if arch.multi_latent_attention:
        # the latents (down-projected, normed, up-projection inputs: whole on each TP rank), then per head
        # q and k (non-rotary and rotary channels), v, the attention output and the proj input
        dv, q_latent = arch.v_head_dim, arch.q_lora_rank or 0
        replicated += 2 * q_latent + 2 * (arch.kv_lora_rank + arch.qk_rope_head_dim)
        attention = h + 2 * nq * d + nq * dv + 2 * nq * dv
        core_attention = 2 * nq * dv
    if moe:
        k, f = arch.num_experts_per_tok, arch.moe_intermediate_size
        mlp = h + k * (h + 3 * f) + 2 * arch.num_experts  # router in, routed copies, gate/up/product, logits
        # shared experts' gate/up/product; dense first layers are counted as MoE layers (an upper
        # bound where, as in GLM-4.5 and DeepSeek-V3, the routed copies outweigh the dense MLP)
        mlp += 3 * arch.shared_expert_intermediate_size
    else:
        mlp = h + 3 * arch.intermediate_size
    per_token = (replicated / (tp if sp else 1) + (attention + mlp) / tp) * b
    if lora_rank is not None:
        per_token += adapter_bytes_per_token(arch, layout, dtype, lora_rank, lora_targets, fused_norms)
    full_layer = tokens * per_token
    layers = stage_layers(arch, pp, stage)
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


def adapter_bytes_per_token(arch: Architecture, layout: ModelLayout, dtype: str, rank: int,
                            targets: tuple[str, ...] | list[str], fused_norms: bool) -> float:  # fmt: skip
    """Bytes the adapters of one layer keep for the backward pass per token of a micro-batch on one
    rank (transforms/lora.py), besides what the layer keeps (the wrapped linear's input, which A's
    gradient reads, is the layer's): each adapter's rank-r product z = A x, which B's gradient
    reads (per token through the linear: the whole sequence for linear_qkv under sequence
    parallelism, where z is gathered; this rank's share for linear_proj, reduce-scattered; the k
    routed copies of a token for an expert's), in the model's dtype; and where the wrapped linear
    fuses its input norm (`fused_norms`, TE's LayerNormLinear: linear_qkv, and a dense model's
    linear_fc1), the adapter's own norm of x (`fused_norm`, computed in float32): the fp32 copy of
    x (none for a float32 model, whose x is that copy) and its inverse RMS (one fp32 per token),
    which the norm's backward reads, and the normalised x in the model's dtype, which A's
    gradient reads; this rank's slice of the sequence under sequence parallelism."""
    b = BYTES[dtype]
    moe = bool(arch.num_experts)
    share = 1 / layout.tp if layout.tp > 1 and moe else 1.0  # sequence parallel: this rank's slice
    # z of a column-parallel linear is gathered along the sequence; a duplicated down-projection's
    # is this rank's slice (TE's spec, as the plan counts it)
    copies = {"linear_qkv": 1.0, "linear_proj": share, "linear_q_proj": 1.0, "linear_q_up_proj": 1.0,
              "linear_kv_up_proj": 1.0, "linear_q_down_proj": share, "linear_kv_down_proj": share}  # fmt: skip
    for target in ("linear_fc1", "linear_fc2"):
        copies[target] = float(arch.num_experts_per_tok) if moe else 1.0
    total = sum(copies[t] * rank * b for t in targets)
    if fused_norms:
        # the fused input norm of linear_qkv (and a dense model's linear_fc1) normalises the hidden
        # state; MLA's up-projections fuse their latent's norm (TE's spec)
        widths = {"linear_qkv": arch.hidden_size, "linear_fc1": arch.hidden_size,
                  "linear_q_up_proj": arch.q_lora_rank or 0, "linear_kv_up_proj": arch.kv_lora_rank}  # fmt: skip
        fused = ("linear_qkv", "linear_q_up_proj", "linear_kv_up_proj") + (() if moe else ("linear_fc1",))
        total += sum(share * ((4 * widths[t] if b < 4 else 0) + 4 + b * widths[t]) for t in fused if t in targets)
    return total


def layer_tensors(arch: Architecture, tp: int, ep: int, dense: bool = False) -> list[tuple[str, int, bool]]:
    """One transformer layer's parameter tensors on one rank, (name, elements, is_expert), the
    experts' one tensor per expert and linear (megatron's SequentialMLP and TEGroupedMLP);
    `dense`: a dense layer of an MoE model."""
    parts = layer_parameters(arch, tp, ep, dense)
    tensors = [(name, count, False) for name, (count, is_expert) in parts.items() if not is_expert]
    if arch.num_experts and not dense:
        h, f = arch.hidden_size, arch.moe_intermediate_size
        tensors += [("mlp.experts.linear_fc1", 2 * f * h // tp, True), ("mlp.experts.linear_fc2", f * h // tp, True)] * (arch.num_experts // ep)  # fmt: skip
    return tensors


def rank_tensors(arch: Architecture, layout: ModelLayout, value_model: bool, freeze_attention: bool,
                 lora_rank: int | None, stage: int, distributed: bool,
                 lora_targets: tuple[str, ...] | list[str] = LORA_TARGETS) -> list[ShardTensor]:  # fmt: skip
    """The trainable tensors of pipeline stage `stage` on one rank, each with the ranks the
    distributed optimizer shards it over (DP x CP dense, expert-DP experts and their adapters;
    1 without it)."""
    dense_shards = layout.dp * layout.cp if distributed else 1
    expert_shards = layout.expert_dp if distributed else 1
    layers = stage_layer_indices(arch, layout.pp, stage)
    h, tp = arch.hidden_size, layout.tp
    last = stage == layout.pp - 1
    if lora_rank is not None:  # adapters A (rank x in) and B (out x rank) of the wrapped linears
        adapters = [t for layer in layers
                    for t in lora_tensors(arch, tp, layout.ep, lora_rank, lora_targets, layer_is_dense(arch, layer))]  # fmt: skip
        head = [ShardTensor(n, dense_shards) for n in ([h, 1] if value_model and last else [])]
        return [
            ShardTensor(n, expert_shards if is_expert else dense_shards) for _, n, is_expert in adapters
        ] + head
    out = [
        ShardTensor(elements, expert_shards if is_expert else dense_shards)
        for layer in layers
        for name, elements, is_expert in layer_tensors(arch, tp, layout.ep, layer_is_dense(arch, layer))
        if not (freeze_attention and name.startswith("self_attention."))  # as rank_parameters freezes
    ]
    embedding = arch.vocab_size // tp * h
    extra = [embedding] if stage == 0 else []
    if last:
        extra.append(h)
        extra += [h, 1] if value_model else ([] if arch.tie_word_embeddings and stage == 0 else [embedding])
    return out + [ShardTensor(n, dense_shards) for n in extra]
