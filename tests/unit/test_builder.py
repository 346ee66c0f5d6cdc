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
