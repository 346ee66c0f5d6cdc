"""The critic: a GPT backbone whose vocabulary projection is replaced by a value head.

`value_head = Linear(in_features, 1)` where `in_features` is read from the policy-style output
layer the backbone builds (never hard-coded, never gated on a model name). The model returns one
float32 value per token position, `[batch, seq]`: position t holds the head applied to the final
hidden state at t, i.e. the value of the state before token t + 1
(docs/concepts/critic-alignment.md). On pipeline parallel the head lives on the last stage.
"""

from __future__ import annotations

import functools

import megatron_rl.compat  # noqa: F401  (megatron-core on CPU needs its patches first)

import torch
from megatron.core import tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

from megatron_rl.config import Architecture
from megatron_rl.models.builder import build_gpt_model


def initial_value_head(in_features: int, std: float = 0.0, seed: int = 0) -> dict[str, torch.Tensor]:
    """The value head's initial {"weight": [1, in_features], "bias": [1]}, float32: zeros, or a
    normal(0, std) weight from its own generator (the same head on every rank and at every
    layout: the global RNG has drawn differently by now on each pipeline stage)."""
    weight = torch.zeros(1, in_features)
    if std > 0:
        weight = torch.randn(1, in_features, generator=torch.Generator().manual_seed(seed)) * std
    return {"weight": weight, "bias": torch.zeros(1)}


class MegatronValueModel(GPTModel):
    """GPTModel with `output_layer` replaced by a float32 `value_head`."""

    def __init__(self, *args, head_init_std: float = 0.0, head_init_seed: int = 0, **kwargs):
        kwargs["share_embeddings_and_output_weights"] = False
        super().__init__(*args, **kwargs)
        if self.post_process:
            in_features = self.output_layer.input_size
            del self.output_layer
            self.value_head = torch.nn.Linear(in_features, 1, dtype=torch.float32)
            with torch.no_grad():
                for name, tensor in initial_value_head(in_features, head_init_std, head_init_seed).items():
                    getattr(self.value_head, name).copy_(tensor)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        # LanguageModule's version adjusts `output_layer.weight`, which a value model does not
        # have; the generic traversal covers the backbone and the (replicated) value head.

        return MegatronModule.sharded_state_dict(
            self, prefix, sharded_offsets, ensure_metadata_has_dp_cp_group(metadata)
        )

    def _postprocess(self, hidden_states, *args, **kwargs):
        if not self.post_process:
            return hidden_states
        if self.config.sequence_parallel:
            # The head and the loss after it run on the whole sequence on every TP rank alike, so
            # each rank's gradient for its own sequence slice is already complete: backward takes
            # that slice (the default, a reduce-scatter, would add TP identical copies).
            hidden_states = tensor_parallel.gather_from_sequence_parallel_region(
                hidden_states, tensor_parallel_output_grad=False
            )
        values = self.value_head(hidden_states.float()).squeeze(-1)  # [seq, batch]
        return values.transpose(0, 1).contiguous()


def build_value_model(
    arch: Architecture,
    config: TransformerConfig | None = None,
    seq_len: int | None = None,
    head_init_std: float = 0.0,
    head_init_seed: int = 0,
    **config_kwargs,
):
    """A value model for this pipeline stage (pre/post process from parallel_state)."""
    model_class = functools.partial(
        MegatronValueModel, head_init_std=head_init_std, head_init_seed=head_init_seed
    )
    return build_gpt_model(arch, config, seq_len, model_class=model_class, **config_kwargs)


# TE fuses the layer's input norm into the QKV projection (`linear_qkv.layer_norm_weight`); the
# local spec keeps it as `input_layernorm.weight`. It is not attention: it stays trainable in both.
_FUSED_INPUT_NORM = (".linear_qkv.layer_norm_weight", ".linear_qkv.layer_norm_bias")


def freeze_attention(model: torch.nn.Module) -> list[str]:
    """Freezes every `self_attention.*` parameter but the input norm TE fuses into `linear_qkv`
    (so that both layer specs, and the memory plan, freeze the same weights); returns the frozen
    names."""
    frozen = []
    for name, param in model.named_parameters():
        if ".self_attention." in name and not name.endswith(_FUSED_INPUT_NORM):
            param.requires_grad_(False)
            frozen.append(name)
    return frozen


def set_head_only(model: torch.nn.Module, head_only: bool, frozen: frozenset[str] = frozenset()) -> list[str]:
    """With head_only, only `value_head.*` trains; otherwise every parameter not in `frozen`
    (attention frozen for good, LoRA's base weights). Returns the trainable names."""
    for name, param in model.named_parameters():
        if name not in frozen:
            param.requires_grad_(name.startswith("value_head.") or not head_only)
    return [n for n, p in model.named_parameters() if p.requires_grad]
