"""One process group's parallel layout (`ModelLayout`) and its derivation from a model section
(`model_layout`: DP and the divisibility checks), in a module of its own so that both layout.py
(the policy's and the critic's) and services.py (a Megatron teacher's) use them."""

from __future__ import annotations

from megatron_rl.config.base import Strict
from megatron_rl.config.model import Architecture, ModelConfig


class ModelLayout(Strict):
    """One process group's parallel layout. world = tp * cp * pp * dp."""

    world_size: int
    tp: int
    cp: int
    pp: int
    ep: int
    dp: int
    expert_dp: int  # data-parallel size of expert weights: world / (tp * ep * pp)
    # Sequence-parallel size: tp when the model runs sequence parallel (the builder turns it on
    # for MoE at tp > 1), else 1. Packed rows pad to a multiple of cp * sp.
    sp: int = 1


def model_layout(
    model: ModelConfig, arch: Architecture | None, gpus: int, where: str, errors: list[str], device: str = "cuda"
) -> ModelLayout | None:
    """DP from the model's own GPU count and degrees, plus divisibility checks (`device`:
    deployment.device, which with model.transformer_engine decides the layer spec)."""
    model_parallel = model.tp * model.cp * model.pp
    if gpus % model_parallel:
        errors.append(
            f"{where}: {gpus} GPUs are not divisible by tp*cp*pp = {model.tp}*{model.cp}*{model.pp} = {model_parallel}"
        )
        return None
    dp = gpus // model_parallel
    if arch is not None:
        if arch.num_attention_heads % (model.tp * model.cp):
            errors.append(
                f"{where}: num_attention_heads ({arch.num_attention_heads}) must be divisible by "
                f"tp*cp ({model.tp}*{model.cp}) for tensor parallel with Ulysses context parallel"
            )
        if arch.num_key_value_heads % model.tp:
            errors.append(
                f"{where}: num_key_value_heads ({arch.num_key_value_heads}) must be divisible by tp ({model.tp})"
            )
        errors += latent_attention_local_spec_problems(model, arch, device, where)
        if arch.context_parallel_refusal(model.cp):
            errors.append(f"{where}.cp: {arch.context_parallel_refusal(model.cp)}")
        if arch.num_layers % model.pp:
            errors.append(f"{where}: num_layers ({arch.num_layers}) must be divisible by pp ({model.pp})")
        if model.ep > 1 and not arch.num_experts:
            errors.append(f"{where}.ep: ep = {model.ep} but the model has no experts")
        if arch.num_experts and arch.num_experts % model.ep:
            errors.append(
                f"{where}.ep: num_experts ({arch.num_experts}) must be divisible by ep ({model.ep})"
            )
    # Every packed row is split over CP ranks, and over TP ranks too under sequence parallel
    # (the builder turns it on for MoE models at tp > 1): seq_len must divide evenly.
    sequence_parallel = model.tp if model.tp > 1 and arch is not None and arch.num_experts else 1
    if model.seq_len % (model.cp * sequence_parallel):
        errors.append(
            f"{where}.seq_len ({model.seq_len}) must be a multiple of cp ({model.cp})"
            + (f" x tp ({model.tp}, sequence parallel for MoE)" if sequence_parallel > 1 else "")
        )
    # Experts are sharded over the data-parallel ranks (times CP): ep must divide dp*cp.
    if (dp * model.cp) % model.ep:
        errors.append(f"{where}.ep: ep ({model.ep}) must divide dp*cp ({dp}*{model.cp})")
        return None
    return ModelLayout(
        world_size=gpus,
        tp=model.tp,
        cp=model.cp,
        pp=model.pp,
        ep=model.ep,
        dp=dp,
        expert_dp=gpus // (model.tp * model.ep * model.pp),
        sp=sequence_parallel,
    )


def latent_attention_local_spec_problems(model: ModelConfig, arch: Architecture, device: str, where: str) -> list[str]:
    """Multi-latent attention at TP > 1 on megatron's local layer spec (the cpu device, or
    model.transformer_engine off); TransformerEngine's spec runs the down-projections whole on every
    rank and is not concerned. The local spec's down-projections are column-parallel: their
    outputs, the q latent (q_lora_rank) and the kv latent with the shared RoPE key
    (kv_lora_rank + qk_rope_head_dim), are split over TP, so each must divide by tp. (megatron-core
    does not sum the shared RoPE key's gradient over TP there, nor on TE's spec without sequence
    parallel; the compat patch latent_attention_shared_rope_grad does: tests/distributed/test_mla_tp.py.)"""
    if not arch.multi_latent_attention or model.tp == 1 or (device != "cpu" and model.transformer_engine != "off"):
        return []
    spec = "deployment.device cpu" if device == "cpu" else "model.transformer_engine off"
    sizes = {"kv_lora_rank + qk_rope_head_dim": arch.kv_lora_rank + arch.qk_rope_head_dim}
    if arch.q_lora_rank is not None:
        sizes = {"q_lora_rank": arch.q_lora_rank, **sizes}
    return [f"{where}.tp: {name} ({size}) must be divisible by tp ({model.tp}): on megatron's local "
            f"layer spec ({spec}) multi-latent attention splits its down-projections over TP"
            for name, size in sizes.items() if size % model.tp]  # fmt: skip
