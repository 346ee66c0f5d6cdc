"""CPU stand-ins for the TransformerEngine modules of megatron's TE layer spec, for tests.

TE cannot be built here, but what our code depends on is the *shape* of a TE model: its
parameter names, checkpoint keys and tensor-parallel attributes. Each stand-in reproduces those
of the module it replaces (read from megatron-core 0.16.1 `extensions/transformer_engine.py` and
TE's `Linear`/`LayerNormLinear`/`RMSNorm`), and computes what it computes:

- `FusedNormColumnParallelLinear` ~ `TELayerNormColumnParallelLinear`: y = norm(x) W^T, with the
  norm's weight as the parameter `layer_norm_weight` of the linear (TE fuses the input norm of
  `linear_qkv` and of the dense `linear_fc1` into the linear, and MLA's q/kv latent norms into its
  up-projections; the spec's norms are `IdentityOp`);
- megatron's own non-parallel `Linear` (post_training/modelopt) ~ `TELinear` in duplicated mode
  (MLA's down-projections, whole on every TP rank);
- `ExtraStateNorm` ~ `TENorm` (te.pytorch.RMSNorm): `weight` plus a `_extra_state` entry;
- `ColumnParallelLinear` / `TEStyleRowParallelLinear` ~ `TEColumnParallelLinear` /
  `TERowParallelLinear`: for experts built with explicit communication (expert TP > 1 or
  EP > 1) megatron passes `parallel_mode=None` to TE, and TE then tags the weight with
  `partition_dim = 0` whatever the layer (TE `Linear.reset_parameters`:
  `dim=1 if self.parallel_mode == "row" else 0`).

`te_layer_spec(arch)` runs megatron's own `get_gpt_layer_with_transformer_engine_spec` with
these in place of `TESpecProvider`'s modules, so the layer structure and its
`sharded_state_dict_keys_map` are megatron's; `build_te_style_model` builds a GPTModel from it
(the block's final norm is `TENorm` too whenever TE is installed).
"""

from __future__ import annotations

import contextlib

import megatron_rl.compat  # noqa: F401  (megatron-core on CPU needs its patches first)

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel, gpt_layer_specs
from megatron.core.post_training.modelopt.layers import Linear as ModelOptLinear
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer import transformer_block
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe.experts import SequentialMLP

from megatron_rl.config import Architecture
from megatron_rl.models.attention import PackedDotProductAttention
from megatron_rl.models.builder import layered_block_spec, position_embedding_type, transformer_config


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered_gamma: bool = False
) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * w (w + 1 with zero-centred gamma), computed in float32."""
    gamma = weight.float() + 1 if zero_centered_gamma else weight.float()
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * gamma).to(x.dtype)


class FusedNormColumnParallelLinear(ColumnParallelLinear):
    """TELayerNormColumnParallelLinear's parameters and arithmetic: norm(x) W^T."""

    def __init__(self, input_size: int, output_size: int, *, config, init_method, gather_output: bool, bias: bool,
                 skip_bias_add: bool, is_expert: bool, skip_weight_param_allocation: bool = False,
                 tp_comm_buffer_name=None, tp_group=None, stride: int = 1):  # fmt: skip
        super().__init__(
            input_size, output_size, config=config, init_method=init_method, bias=bias,
            gather_output=gather_output, stride=stride, skip_bias_add=skip_bias_add, is_expert=is_expert,
            tp_group=tp_group,
        )  # fmt: skip
        self.normalization = config.normalization
        self.eps = config.layernorm_epsilon
        self.zero_centered_gamma = config.layernorm_zero_centered_gamma
        self.layer_norm_weight = torch.nn.Parameter(torch.ones(input_size, dtype=config.params_dtype))
        self.layer_norm_weight.sequence_parallel = config.sequence_parallel

    def forward(self, x, *args, **kwargs):
        normed = rms_norm(x, self.layer_norm_weight, self.eps, self.zero_centered_gamma)
        return super().forward(normed, *args, **kwargs)


class ExtraStateNorm(torch.nn.RMSNorm):
    """te.pytorch.RMSNorm's state: `weight` and an `_extra_state` tensor (quantizer metadata)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5):
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        self.weight.sequence_parallel = config.sequence_parallel

    def get_extra_state(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state) -> None:
        pass


def _explicit_expert_communication(config, is_expert: bool) -> bool:
    """megatron TELinear: `is_expert and (tp_size > 1 or expert_parallel)` (then parallel_mode=None)."""
    tp = parallel_state.get_expert_tensor_parallel_world_size()
    return is_expert and (tp > 1 or config.expert_model_parallel_size > 1)


class TEStyleRowParallelLinear(RowParallelLinear):
    """TERowParallelLinear's attributes: experts with explicit communication report partition_dim 0."""

    def __init__(self, *args, config, is_expert: bool = False, **kwargs):
        super().__init__(*args, config=config, is_expert=is_expert, **kwargs)
        if _explicit_expert_communication(config, is_expert):
            self.weight.partition_dim = 0


class StandinTESpecProvider:
    """TESpecProvider (megatron `extensions/transformer_engine_spec_provider.py`) with the CPU
    stand-ins in place of TE's modules."""

    def linear(self):
        # TELinear, which MLA's spec uses in duplicated mode (its down-projections whole on every TP
        # rank): megatron's own non-parallel Linear, which MLA accepts there too
        return ModelOptLinear

    def column_parallel_linear(self):
        return ColumnParallelLinear

    def row_parallel_linear(self):
        return TEStyleRowParallelLinear

    def fuse_layernorm_and_linear(self) -> bool:
        return True

    def column_parallel_layer_norm_linear(self):
        return FusedNormColumnParallelLinear

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False):
        return ExtraStateNorm

    def core_attention(self):
        return PackedDotProductAttention

    def grouped_mlp_modules(self, moe_use_grouped_gemm: bool, moe_use_legacy_grouped_gemm: bool):
        if moe_use_grouped_gemm:
            raise NotImplementedError("the stand-ins have no grouped GEMM")
        return SequentialMLP, MLPSubmodules(
            linear_fc1=ColumnParallelLinear, linear_fc2=TEStyleRowParallelLinear
        )

    def activation_func(self):
        return None


@contextlib.contextmanager
def _standin_te_modules():
    """megatron's spec function and block with the stand-ins where TE's classes would be."""
    saved = (getattr(gpt_layer_specs, "TESpecProvider", None), transformer_block.LayerNormImpl)
    gpt_layer_specs.TESpecProvider = StandinTESpecProvider
    transformer_block.LayerNormImpl = ExtraStateNorm
    try:
        yield
    finally:
        if saved[0] is None:
            del gpt_layer_specs.TESpecProvider
        else:
            gpt_layer_specs.TESpecProvider = saved[0]
        transformer_block.LayerNormImpl = saved[1]


def te_layer_spec(arch: Architecture):
    """megatron's TE layer spec for `arch`, built with the stand-ins."""
    with _standin_te_modules():
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=arch.num_experts or None, moe_grouped_gemm=False,
            # as the builder: MLA's q/kv latent norms fused into its up-projections
            qk_layernorm=arch.qk_norm or arch.multi_latent_attention,
            multi_latent_attention=arch.multi_latent_attention,
        )  # fmt: skip


def build_te_style_model(arch: Architecture, model_class=None, **config_kwargs):
    """A GPTModel (or `model_class`) with megatron's TE spec and the stand-in modules; an MoE
    model's dense first layers dense (the builder's `layered_block_spec`)."""
    config = transformer_config(arch, **config_kwargs)
    with _standin_te_modules():
        spec = layered_block_spec(arch, config, te_layer_spec)
        return (model_class or GPTModel)(
            config,
            spec,
            vocab_size=arch.vocab_size,
            max_sequence_length=arch.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(),
            post_process=parallel_state.is_pipeline_last_stage(),
            share_embeddings_and_output_weights=arch.tie_word_embeddings,
            position_embedding_type=position_embedding_type(config.context_parallel_size),
            rotary_base=int(arch.rope_theta),
            rotary_percent=arch.partial_rotary_factor,
        )
