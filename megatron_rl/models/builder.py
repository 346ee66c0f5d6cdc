"""Megatron GPT models from an `Architecture` (read from an HF config.json or written inline).

No gate on a model name: every family maps onto the same GPT building blocks (RMSNorm, RoPE,
SwiGLU, GQA, optional q/k-norm, optional MoE). The TransformerEngine layer spec is used when TE
is importable, CUDA is present and CP = 1, the local spec otherwise. MoE routes in float32
(`moe_router_dtype`, as vLLM and transformers do: their softmax over the router logits is
float32) and runs its experts as one grouped GEMM where the TE spec has TE's grouped linear
(`moe_grouped_gemm`; megatron's other grouped path, GroupedMLP, needs the `grouped_gemm`
package, and the stand-in for neither exists on CPU, so the local spec keeps one GEMM per expert).
"""

from __future__ import annotations

import functools
import logging

import megatron_rl.compat as compat  # megatron-core on CPU needs its patches first

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel, gpt_layer_specs
from megatron.core.transformer import TransformerConfig, transformer_block
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_config import MLATransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from megatron_rl.config import Architecture
from megatron_rl.models.attention import PackedDotProductAttention, UlyssesAttention

try:  # as megatron's layer specs import TE: absent without TE (or a broken TE, which compat hides)
    from megatron.core.extensions.transformer_engine import TEColumnParallelGroupedLinear
except ImportError:
    TEColumnParallelGroupedLinear = None

log = logging.getLogger("megatron_rl.models")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def transformer_engine_available() -> bool:
    """TE usable on a CUDA machine (the TE layer spec's requirement); compat's probe imported its
    torch extension already (a TE that fails there counts as absent)."""
    return compat.MACHINE.cuda and compat.MACHINE.transformer_engine


def te_grouped_linear_available() -> bool:
    """TE's GroupedLinear, which megatron's TE spec needs for grouped-GEMM experts (TE >= 1.9)."""
    return transformer_engine_available() and TEColumnParallelGroupedLinear is not None


def uses_transformer_engine(context_parallel_size: int = 1, transformer_engine: bool | None = None) -> bool:
    """Whether a model is built with the TE spec: `transformer_engine` if given, else TE when
    available and CP = 1 (the Ulysses core attention is a local-spec module). Asking for TE
    where it cannot be used raises."""
    if transformer_engine is None:
        return transformer_engine_available() and context_parallel_size == 1
    if transformer_engine and (not transformer_engine_available() or context_parallel_size > 1):
        raise ValueError(
            "the TransformerEngine layer spec needs TE importable, CUDA and context_parallel_size 1"
        )
    return transformer_engine


def transformer_engine_choice(setting: str, device: str, context_parallel_size: int, where: str) -> bool | None:
    """`build_gpt_model`'s `transformer_engine` for a trainer's `model.transformer_engine` setting
    (`where`: its config key) on `deployment.device`: False for the local spec (`off`, the cpu
    device, or CP > 1, whose Ulysses attention is a local-spec module), None for TE when it imports
    (`auto`), True for `required`. Raises when TE is required on cuda and its torch extension does
    not import (or TE is not installed), naming the import error: a broken TE must not silently
    become the local spec (slower, other numerics, other checkpoint keys)."""
    if setting == "off" or device != "cuda" or context_parallel_size > 1:
        return False
    why = compat.MACHINE.transformer_engine_error or "transformer_engine is not installed"
    if setting == "auto":
        if not compat.MACHINE.transformer_engine:
            log.warning("%s: auto, and TransformerEngine is not usable (%s): the local layer spec", where, why)
        return None
    if not compat.MACHINE.transformer_engine:
        raise RuntimeError(
            f"{where}: required (the default) on device cuda, but TransformerEngine is not usable here: {why}. "
            "Install it (bash scripts/ensure_venv.sh --gpu builds its torch extension), or set "
            f"{where}: auto (TE when it imports, else the local spec) or off (the local spec)"
        )
    return True


def transformer_config(
    arch: Architecture,
    tp: int = 1,
    cp: int = 1,
    pp: int = 1,
    ep: int = 1,
    dtype: str = "float32",
    transformer_engine: bool | None = None,
    **overrides,
) -> TransformerConfig:
    """The megatron TransformerConfig for `arch` at the given parallel degrees, for the layer
    spec that `uses_transformer_engine(cp, transformer_engine)` picks."""

    params_dtype = DTYPES[dtype]
    moe = arch.num_experts > 0
    fields = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_key_value_heads,
        kv_channels=arch.kv_channels,
        ffn_hidden_size=arch.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.attention_bias,
        qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        context_parallel_size=cp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        # MoE with expert parallel over TP>1 needs sequence parallel.
        sequence_parallel=tp > 1 and moe,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        pipeline_dtype=params_dtype,
        # Fused kernels exist on GPU only.
        bias_activation_fusion=not compat.CPU_MODE,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        bias_dropout_fusion=False,
        persist_layer_norm=False,
        # Packed batches change length every step; megatron then requires the alltoall dispatcher.
        variable_seq_lengths=True,
        moe_token_dispatcher_type="alltoall",
        use_cpu_initialization=compat.CPU_MODE,
    )
    if moe:
        fields.update(
            num_moe_experts=arch.num_experts,
            moe_router_topk=arch.num_experts_per_tok,
            moe_ffn_hidden_size=arch.moe_intermediate_size,
            moe_grouped_gemm=uses_transformer_engine(cp, transformer_engine)
            and te_grouped_linear_available(),
            moe_router_dtype="fp32",
            moe_router_load_balancing_type="none",
            # softmax over the top-k logits == softmax over all, then renormalised top-k.
            moe_router_pre_softmax=not arch.moe_norm_topk_prob,
            moe_aux_loss_coeff=0.0,
            moe_router_score_function=arch.moe_score_function,
            moe_router_topk_scaling_factor=arch.moe_routed_scaling_factor
            if arch.moe_routed_scaling_factor != 1.0
            else None,
            moe_router_num_groups=arch.moe_num_groups or None,
            moe_router_group_topk=arch.moe_group_topk or None,
            moe_shared_expert_intermediate_size=arch.shared_expert_intermediate_size or None,
        )
        if arch.first_k_dense_layers:
            # dense first layers (0) then experts (1); megatron then saves per-layer checkpoint keys
            fields.update(moe_layer_freq=[int(layer in arch.moe_layers) for layer in range(arch.num_layers)])
        if arch.moe_expert_bias:
            # The bias is loaded and frozen: megatron's aux-loss-free balancing would move it by
            # rate x sign(load error) each step, while vLLM keeps routing with the bias it loaded.
            fields.update(moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.0)
    if arch.multi_latent_attention:
        fields.update(latent_attention_fields(arch))
    fields.update(overrides)
    return (MLATransformerConfig if arch.multi_latent_attention else TransformerConfig)(**fields)


def latent_attention_fields(arch: Architecture) -> dict:
    """MLATransformerConfig's fields for `arch`'s multi-latent attention: head sizes, ranks and
    RoPE (plain or YaRN). megatron's softmax scale is yarn(rotary_scaling_factor,
    mscale_all_dim)^2 / sqrt(q/k head dim) whatever the RoPE; with plain RoPE mscale_all_dim 0
    makes the factor 1, as transformers' 1 / sqrt(q/k head dim)."""
    yarn = arch.rope_yarn
    fields = dict(
        q_lora_rank=arch.q_lora_rank,
        kv_lora_rank=arch.kv_lora_rank,
        qk_head_dim=arch.qk_nope_head_dim,
        qk_pos_emb_head_dim=arch.qk_rope_head_dim,
        v_head_dim=arch.v_head_dim,
        rotary_base=arch.rope_theta,
        rope_type="yarn" if yarn else "rope",
        rotary_scaling_factor=yarn.factor if yarn else 1.0,
        mscale=yarn.mscale if yarn else 1.0,
        mscale_all_dim=yarn.mscale_all_dim if yarn else 0.0,
    )
    if yarn:
        fields.update(original_max_position_embeddings=yarn.original_max_position_embeddings,
                      beta_fast=yarn.beta_fast, beta_slow=yarn.beta_slow)  # fmt: skip
    return fields


def layer_spec(
    arch: Architecture,
    context_parallel_size: int = 1,
    transformer_engine: bool | None = None,
    moe_grouped_gemm: bool = False,
):
    """TE spec with TE on CUDA, local spec otherwise; Ulysses core attention when CP > 1.
    `transformer_engine` True/False asks for one spec (True fails without TE or with CP > 1).
    `moe_grouped_gemm` (the config's) needs the TE spec with TE's grouped linear."""

    num_experts = arch.num_experts or None
    transformer_engine = uses_transformer_engine(context_parallel_size, transformer_engine)
    if moe_grouped_gemm and not (transformer_engine and te_grouped_linear_available()):
        raise ValueError(
            "moe_grouped_gemm needs the TransformerEngine spec with TE's grouped linear (TE >= 1.9); "
            "this model is built with the local spec"
        )
    mla = arch.multi_latent_attention
    # MLA's spec builds the q/kv latents' norms (TE: fused into the up-projections) under qk_layernorm
    norms = dict(qk_layernorm=arch.qk_norm or mla, multi_latent_attention=mla)
    if transformer_engine:
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm, **norms
        )
    spec = gpt_layer_specs.get_gpt_layer_local_spec(
        num_experts=num_experts, moe_grouped_gemm=False, normalization="RMSNorm", **norms
    )
    # The stock local core attention refuses packed (THD) sequences and CP > 1.
    core = PackedDotProductAttention
    refusal = arch.context_parallel_refusal(context_parallel_size)
    if refusal:
        raise ValueError(refusal)
    if context_parallel_size > 1:
        core = ModuleSpec(module=UlyssesAttention, params={"rotary_base": arch.rope_theta})
    spec.submodules.self_attention.submodules.core_attention = core
    return spec


def block_spec(
    arch: Architecture,
    config: TransformerConfig,
    transformer_engine: bool | None = None,
):
    """The decoder's spec for this pipeline stage: `layer_spec` for every layer, or, for an MoE
    model whose first layers are dense (`first_k_dense_layers`), a block of this stage's layers,
    each dense or MoE (megatron's `moe_layer_freq` pattern)."""
    args = (config.context_parallel_size, transformer_engine, config.moe_grouped_gemm)
    return layered_block_spec(arch, config, lambda layer_arch: layer_spec(layer_arch, *args))


def layered_block_spec(arch: Architecture, config: TransformerConfig, spec_of):
    """`spec_of(arch)` for an MoE model whose layers are all alike, else the block of this
    pipeline stage's layers: `spec_of` of the dense copy of `arch` (no experts) for its dense
    first layers, of `arch` for the others."""
    moe_spec = spec_of(arch)
    if not arch.first_k_dense_layers:
        return moe_spec
    dense_spec = spec_of(arch.model_copy(update=dict(num_experts=0)))
    specs = [moe_spec if layer in arch.moe_layers else dense_spec for layer in range(arch.num_layers)]
    offset = get_transformer_layer_offset(config)
    # the final norm megatron's block gives a single layer spec
    return TransformerBlockSubmodules(
        layer_specs=specs[offset : offset + get_num_layers_to_build(config)],
        layer_norm=transformer_block.LayerNormImpl,  # read now, as megatron's block reads it for one spec
    )


def position_embedding_type(context_parallel_size: int) -> str:
    """Megatron's RoPE assumes its zigzag CP layout; with Ulysses CP, RoPE runs in the core
    attention instead, so the model itself gets no position embedding."""
    return "rope" if context_parallel_size == 1 else "none"


def build_gpt_model(
    arch: Architecture,
    config: TransformerConfig | None = None,
    seq_len: int | None = None,
    model_class=None,
    transformer_engine: bool | None = None,
    device: torch.device | str | None = None,
    **config_kwargs,
):
    """A megatron GPTModel (or `model_class`, a GPTModel subclass such as the value model) for
    this pipeline stage, pre/post process from parallel_state; `transformer_engine` as in
    `layer_spec` (default: TE when available); on `device` (default: this process's device;
    "meta" for a structure without storage, built under `torch.device("meta")`)."""

    model_class = model_class or GPTModel
    config = config or transformer_config(arch, transformer_engine=transformer_engine, **config_kwargs)
    model = model_class(
        config,
        block_spec(arch, config, transformer_engine),
        vocab_size=arch.vocab_size,
        max_sequence_length=seq_len or arch.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type=position_embedding_type(config.context_parallel_size),
        rotary_base=int(arch.rope_theta),
        rotary_percent=arch.partial_rotary_factor,
    )
    if config.recompute_granularity is not None and parallel_state.is_pipeline_first_stage():
        model.embedding.register_forward_hook(functools.partial(_embedding_output_requires_grad, model.decoder))
    return model.to(device or compat.device())


def _embedding_output_requires_grad(decoder, embedding, inputs, output):
    """A forward hook on the embedding of a model with activation recomputation: in a pass that
    builds a graph, the embedding's output requires grad whenever a parameter of the `decoder`
    does. Megatron recomputes a checkpointed unit (whole layers: `full`) in its backward and
    runs its forward under no_grad, so the unit's output requires grad only if one of its tensor
    inputs does: with a frozen embedding (a LoRA policy or critic) none does, no gradient would
    reach any adapter behind it, and the step would train nothing. (HF/PEFT's
    `enable_input_require_grads` for gradient checkpointing.) A model whose embedding trains, or
    whose decoder is frozen (a head-only critic phase), is left as it is: no backward through a
    backbone that does not train."""
    if not torch.is_grad_enabled() or output.requires_grad:
        return output
    if any(p.requires_grad for p in decoder.parameters()):
        return output.requires_grad_(True)
    return output
