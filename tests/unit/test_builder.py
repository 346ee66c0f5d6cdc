"""models/builder.py: which layer spec and MoE settings a model gets (pure; the models
themselves are tested in tests/distributed)."""

from __future__ import annotations

import pytest

from megatron_rl.models import builder
from tests.support.ranks import DENSE

MOE = DENSE.model_copy(
    update=dict(num_layers=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
)


def test_moe_routes_in_float32_whatever_the_model_dtype():
    for dtype in ("float32", "bfloat16"):
        assert builder.transformer_config(MOE, dtype=dtype).moe_router_dtype == "fp32"


def test_grouped_gemm_only_with_the_te_spec_and_te_grouped_linear(monkeypatch):
    assert builder.transformer_config(MOE).moe_grouped_gemm is False  # this machine: no TE
    with pytest.raises(ValueError, match="moe_grouped_gemm needs the TransformerEngine spec"):
        builder.layer_spec(MOE, moe_grouped_gemm=True)
    monkeypatch.setattr(builder, "transformer_engine_available", lambda: True)
    monkeypatch.setattr(builder, "te_grouped_linear_available", lambda: True)
    assert builder.transformer_config(MOE).moe_grouped_gemm is True
    assert builder.transformer_config(MOE, cp=2).moe_grouped_gemm is False  # CP > 1: local spec
    assert builder.transformer_config(MOE, transformer_engine=False).moe_grouped_gemm is False
    monkeypatch.setattr(builder, "te_grouped_linear_available", lambda: False)  # TE < 1.9
    assert builder.transformer_config(MOE).moe_grouped_gemm is False


def test_asking_for_te_where_it_cannot_run_names_the_reason():
    with pytest.raises(ValueError, match="needs TE importable, CUDA and context_parallel_size 1"):
        builder.uses_transformer_engine(1, True)
    assert builder.uses_transformer_engine(2, None) is False


def test_freeze_attention_freezes_the_same_weights_under_both_layer_specs():
    """Under TE the input norm is `linear_qkv.layer_norm_weight`, inside `self_attention`; it is not
    attention and stays trainable, as the local spec's `input_layernorm.weight` (second GPU
    reading, defect 9): the frozen weights are the projections and the q/k norms in both specs."""
    import torch

    from megatron_rl.models.value_model import freeze_attention

    class Layer(torch.nn.Module):  # parameters under the specs' own names
        def __init__(self, names):
            super().__init__()
            self.weights = {f"decoder.layers.0.{name}": torch.nn.Parameter(torch.zeros(1)) for name in names}

        def named_parameters(self):
            return list(self.weights.items())

    layer = Layer

    attention = ["self_attention.linear_qkv.weight", "self_attention.linear_proj.weight",
                 "self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"]  # fmt: skip
    local = layer(["input_layernorm.weight", *attention, "mlp.linear_fc1.weight"])
    te = layer(["self_attention.linear_qkv.layer_norm_weight", *attention, "mlp.linear_fc1.weight"])
    frozen = {spec: sorted(n.removeprefix("decoder.layers.0.") for n in freeze_attention(m))
              for spec, m in (("local", local), ("te", te))}  # fmt: skip
    assert frozen["local"] == frozen["te"] == sorted(attention)
    trainable = [n for n, p in te.named_parameters() if p.requires_grad]
    assert trainable == ["decoder.layers.0.self_attention.linear_qkv.layer_norm_weight", "decoder.layers.0.mlp.linear_fc1.weight"]


def test_a_trainer_refuses_a_broken_te_on_cuda_unless_told_otherwise(monkeypatch, caplog):
    """`model.transformer_engine`: required (the default) on cuda raises naming the import error
    and the key; auto takes TE when it imports and says why not; off, the cpu device and CP > 1
    (Ulysses attention: a local-spec module) take the local spec."""
    import dataclasses

    from megatron_rl import compat
    from megatron_rl.config import ModelConfig

    assert ModelConfig.model_fields["transformer_engine"].default == "required"
    error = "transformer_engine is installed but transformer_engine.pytorch does not import: OSError: libcudnn.so.9"
    broken = dataclasses.replace(compat.MACHINE, cuda=True, transformer_engine=False, transformer_engine_error=error)
    monkeypatch.setattr(compat, "MACHINE", broken)
    key = "value.model.transformer_engine"
    with pytest.raises(RuntimeError, match=rf"{key}: required .* libcudnn.so.9\. .* auto .* off"):
        builder.transformer_engine_choice("required", "cuda", 1, key)
    with caplog.at_level("WARNING", logger="megatron_rl.models"):
        assert builder.transformer_engine_choice("auto", "cuda", 1, key) is None
    assert "libcudnn.so.9" in caplog.text and "local layer spec" in caplog.text
    assert builder.transformer_engine_choice("off", "cuda", 1, key) is False
    assert builder.transformer_engine_choice("required", "cpu", 1, key) is False
    assert builder.transformer_engine_choice("required", "cuda", 2, key) is False
    missing = dataclasses.replace(broken, transformer_engine_error="")
    monkeypatch.setattr(compat, "MACHINE", missing)
    with pytest.raises(RuntimeError, match="transformer_engine is not installed"):
        builder.transformer_engine_choice("required", "cuda", 1, key)
    monkeypatch.setattr(compat, "MACHINE", dataclasses.replace(broken, transformer_engine=True, transformer_engine_error=""))
    assert builder.transformer_engine_choice("required", "cuda", 1, key) is True


def test_the_policy_and_critic_models_are_built_with_the_configs_te_setting(monkeypatch):
    """Both trainers' model builders pass their own key's setting (a broken TE on cuda names it)."""
    import dataclasses
    from types import SimpleNamespace

    from megatron_rl import compat
    from megatron_rl.critic.trainer import CriticTrainer
    from megatron_rl.policy.trainer import build_policy_model

    monkeypatch.setattr(compat, "MACHINE", dataclasses.replace(compat.MACHINE, cuda=True, transformer_engine=False,
                                                               transformer_engine_error="ImportError: te"))  # fmt: skip
    layout = SimpleNamespace(tp=1, cp=1, pp=1, ep=1)
    model = SimpleNamespace(transformer_engine="required", dtype="float32", seq_len=64,
                            recompute=SimpleNamespace(transformer_fields=dict))  # fmt: skip
    resolved = SimpleNamespace(
        layout=SimpleNamespace(policy_architecture=DENSE), lora=None, model=model,
        deployment=SimpleNamespace(device="cuda"), orchestrator=SimpleNamespace(seed=0),
    )  # fmt: skip
    with pytest.raises(RuntimeError, match=r"^model\.transformer_engine: required .*ImportError: te"):
        build_policy_model(resolved, layout)
    critic = SimpleNamespace(layout=layout, arch=DENSE, resolved=resolved, model_options=dict,
                             value=SimpleNamespace(model=model, head_init_std=0.0, lora=None))  # fmt: skip
    with pytest.raises(RuntimeError, match=r"^value\.model\.transformer_engine: required .*ImportError: te"):
        CriticTrainer.build_model(critic)


def test_a_bare_yaml_off_is_the_local_spec():
    """`--set model.transformer_engine=off` (YAML reads a bare off as false) means "off"."""
    from megatron_rl.config import ModelConfig

    arch = DENSE.model_dump(exclude_none=True)
    assert ModelConfig(architecture=arch, seq_len=64, transformer_engine=False).transformer_engine == "off"
    with pytest.raises(ValueError, match="transformer_engine"):
        ModelConfig(architecture=arch, seq_len=64, transformer_engine=True)
