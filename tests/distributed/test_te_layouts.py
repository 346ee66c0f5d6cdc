"""Models with the TransformerEngine layer spec's layout (megatron's TE spec built with CPU
stand-ins of TE's modules, tests/support/te_standins.py) against the local spec:
checkpoint keys, checkpoints loading across the two specs in both directions (at TP = 2 too,
where TE's expert `linear_fc2` reports the wrong partition_dim), and LoRA on TE's fused
norm + linear layers."""

from __future__ import annotations

import pytest
import torch

from megatron_rl import parallel
from tests.support.ranks import DENSE, gather_vocab, reference_weights
from tests.support.spawn import run_ranks
from tests.support.tensors import tokens

DENSE_2 = DENSE.model_copy(update=dict(num_layers=2))
MOE_2 = DENSE_2.model_copy(update=dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32))
ARCHS = {"dense": DENSE_2, "moe": MOE_2}
TE_NORM_EXTRA_STATE = {
    "decoder.layers.self_attention.q_layernorm._extra_state",
    "decoder.layers.self_attention.k_layernorm._extra_state",
    "decoder.final_layernorm._extra_state",
}


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_every_checkpoint_key_of_one_spec_has_a_counterpart_in_the_other(kind):
    from megatron_rl.conversion.spec_keys import OTHER_SPEC_KEY

    local, te = run_ranks(checkpoint_keys_of_both_specs, 1, ARCHS[kind])[0]
    local_only, te_only = local - te, te - local
    if kind == "dense":
        assert local_only == set() and te_only == TE_NORM_EXTRA_STATE
    else:
        assert local_only == {"decoder.layers.mlp.linear_fc1.layer_norm_weight"}
        assert te_only == TE_NORM_EXTRA_STATE | {
            "decoder.layers.pre_mlp_layernorm.weight",
            "decoder.layers.pre_mlp_layernorm._extra_state",
        }
    # What spec_keys.plan_load relies on: a key the other spec lacks is renamed by the table,
    # or is extra state.
    for key in local_only | te_only:
        assert OTHER_SPEC_KEY.get(key) in (local | te) or key.endswith("._extra_state"), key


@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize("source,target", [("local", "te"), ("te", "local")])
def test_checkpoints_load_across_specs_with_the_same_weights_and_logits(kind, source, target, tmp_path):
    arch = ARCHS[kind]
    saved, saved_logits = run_ranks(save_random_model, 1, arch, source, str(tmp_path), 7)[0]
    loaded, logits = run_ranks(load_model, 1, arch, target, str(tmp_path), 1)[0]
    assert set(loaded) == set(saved)
    for name, tensor in saved.items():
        assert torch.equal(loaded[name], tensor), name
    torch.testing.assert_close(logits, saved_logits, atol=1e-5, rtol=0)


def test_a_local_moe_checkpoint_loads_into_a_te_layout_model_at_tp2(tmp_path):
    """Expert TP = 2: TE's expert linear_fc2 says partition_dim 0 but is split on axis 1."""
    saved, saved_logits = run_ranks(save_random_model, 1, MOE_2, "local", str(tmp_path), 11)[0]
    for loaded, logits in run_ranks(load_model, 2, MOE_2, "te", str(tmp_path), 2):
        assert set(loaded) == set(saved)
        for name, tensor in saved.items():
            assert torch.equal(loaded[name], tensor), name
        torch.testing.assert_close(logits, saved_logits, atol=1e-5, rtol=0)


def test_te_expert_fc2_shards_are_cut_and_gathered_on_their_input_axis():
    """TE tags expert linear_fc2 (parallel_mode=None) with partition_dim 0; the weight is
    [hidden, ffn / tp]. A full state dict sharded onto the TE layout at TP = 2 and gathered back
    is the full state dict."""
    full = run_ranks(reference_weights, 1, MOE_2, 4)[0]
    reference = run_ranks(shard_and_gather, 1, MOE_2, full, 1)[0][2]
    for dims, gathered, logits in run_ranks(shard_and_gather, 2, MOE_2, full, 2):
        assert dims["decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight"] == 0  # TE's attribute
        assert set(gathered) == set(full)
        for name, tensor in full.items():
            assert torch.equal(gathered[name], tensor), name
        torch.testing.assert_close(logits, reference, atol=1e-5, rtol=0)


def test_lora_adapts_the_normalised_input_of_a_fused_norm_linear():
    out, reference, merged_out, plain = run_ranks(fused_norm_lora, 1)[0]
    assert (out - plain).abs().max() > 1e-2  # the adapter matters
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=0)
    torch.testing.assert_close(merged_out, reference, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_lora_on_the_te_layout_is_the_model_lora_gives_on_the_local_spec(kind):
    arch = ARCHS[kind]
    local_out, local_merged = run_ranks(lora_logits, 1, arch, "local")[0]
    te_out, te_merged = run_ranks(lora_logits, 1, arch, "te")[0]
    torch.testing.assert_close(te_out, local_out, atol=1e-5, rtol=0)
    torch.testing.assert_close(te_merged, local_merged, atol=1e-5, rtol=0)
    torch.testing.assert_close(te_merged, te_out, atol=1e-5, rtol=0)  # merge_lora keeps the model


# Rank functions: module-level, so that the spawned ranks can import them.


def build(arch, spec: str, **config_kwargs):
    from megatron_rl.models.builder import build_gpt_model
    from tests.support.te_standins import build_te_style_model

    if spec == "te":
        return build_te_style_model(arch, **config_kwargs)
    return build_gpt_model(arch, transformer_engine=False, **config_kwargs)


def logits_of(model, arch):
    model.eval()
    input_ids = tokens(vocab=arch.vocab_size)
    with torch.no_grad():
        out = model(input_ids, torch.arange(input_ids.shape[1]).expand_as(input_ids), attention_mask=None)
    return gather_vocab(out)


def checkpoint_keys_of_both_specs(rank, world_size, arch):
    parallel.initialize_model_parallel()
    return tuple(
        {entry.key for entry in build(arch, spec).sharded_state_dict().values()} for spec in ("local", "te")
    )


def save_random_model(rank, world_size, arch, spec, directory, seed):
    """A `spec` model with random weights (norms too) saved with dist_checkpointing; returns its
    parameters by local-spec name and its logits."""
    from megatron.core import dist_checkpointing

    from megatron_rl.models.sharding import full_parameters

    parallel.initialize_model_parallel(seed=seed)
    torch.manual_seed(seed)
    model = build(arch, spec)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
    dist_checkpointing.save(model.sharded_state_dict(), directory)
    return full_parameters(model), logits_of(model, arch)


def load_model(rank, world_size, arch, spec, directory, tp):
    """A `spec` model at TP = tp loaded with trainer.weights.load_backbone: its full parameters
    by local-spec name and its logits."""
    from megatron_rl.models.sharding import gather_full_parameters
    from megatron_rl.trainer.weights import load_backbone

    parallel.initialize_model_parallel(tp=tp)
    model = build(arch, spec, tp=tp)
    load_backbone(model, directory)
    return gather_full_parameters(model), logits_of(model, arch)


def shard_and_gather(rank, world_size, arch, full, tp):
    """The TE-layout model at TP = tp loaded from `full` by load_full_state_dict: (each TP
    parameter's partition_dim, gather_full_parameters, logits)."""
    from megatron_rl.models.sharding import gather_full_parameters, load_full_state_dict

    parallel.initialize_model_parallel(tp=tp)
    model = build(arch, "te", tp=tp)
    load_full_state_dict(model, full)
    dims = {
        n: p.partition_dim for n, p in model.named_parameters() if getattr(p, "tensor_model_parallel", False)
    }
    return dims, gather_full_parameters(model), logits_of(model, arch)


def fused_norm_lora(rank, world_size):
    """A LoRA-wrapped stand-in of TE's LayerNormColumnParallelLinear: (its output, the plain
    reference norm(x) W^T + s norm(x) A^T B^T, the merged layer's output, the layer without LoRA)."""
    from megatron_rl.models.builder import transformer_config
    from megatron_rl.transforms.lora import LoRALinear, merge_lora
    from tests.support.te_standins import FusedNormColumnParallelLinear

    parallel.initialize_model_parallel()
    torch.manual_seed(0)
    config = transformer_config(DENSE_2)
    layer = FusedNormColumnParallelLinear(
        64, 48, config=config, init_method=torch.nn.init.normal_, gather_output=False, bias=False,
        skip_bias_add=False, is_expert=False,
    )  # fmt: skip
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        layer.layer_norm_weight.copy_(1 + 0.3 * torch.randn(64, generator=g))
    x = 3.0 * torch.randn(5, 2, 64, generator=g) + 1.0
    plain = layer(x)[0].detach()
    wrapper = torch.nn.Module()
    wrapper.linear_qkv = LoRALinear(layer, "column", rank=4, alpha=8.0, seed=3)
    with torch.no_grad():
        wrapper.linear_qkv.lora_b.copy_(0.1 * torch.randn(48, 4, generator=g))
        out = wrapper.linear_qkv(x)[0]
    # The reference, written plainly: RMSNorm over the last axis, then the two linear maps.
    w, gamma = layer.weight.detach(), layer.layer_norm_weight.detach()
    a, b = wrapper.linear_qkv.lora_a.detach(), wrapper.linear_qkv.lora_b.detach()
    normed = x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + config.layernorm_epsilon) * gamma
    reference = normed @ w.T + (8.0 / 4) * (normed @ a.T) @ b.T
    merge_lora(wrapper)
    with torch.no_grad():
        merged_out = wrapper.linear_qkv(x)[0]
    return out, reference, merged_out, plain


def lora_logits(rank, world_size, arch, spec):
    """Logits of a `spec` model with fixed weights and LoRA (rank 4, B = 0.01) on every target,
    before and after merge_lora."""
    from megatron_rl.models.sharding import load_full_state_dict
    from megatron_rl.transforms.lora import apply_lora, merge_lora

    full = reference_weights(rank, world_size, arch, 5)
    parallel.initialize_model_parallel()
    model = build(arch, spec)
    g = torch.Generator().manual_seed(2)
    full = {k: v + 0.2 * torch.randn(v.shape, generator=g) if "norm" in k else v for k, v in full.items()}
    load_full_state_dict(model, full)
    apply_lora(model, rank=4, alpha=8.0, seed=9)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_b"):
                p.fill_(0.01)
    out = logits_of(model, arch)
    merge_lora(model)
    return out, logits_of(model, arch)
