"""Checkpoint keys of the local and the TransformerEngine layer specs, and loading across them.

The two specs save the same weights under the same dist_checkpointing keys, except
(megatron-core 0.16.1, `models/gpt/gpt_layer_specs.py`):

- MoE layers. The local spec maps its `pre_mlp_layernorm.` to `mlp.linear_fc1.layer_norm_`
  (its `sharded_state_dict_keys_map`, written for dense layers, where TE fuses that norm into
  `linear_fc1`), so a local MoE layer stores the pre-MLP norm as
  `mlp.linear_fc1.layer_norm_weight`; the TE MoE spec has a separate `TENorm` there and no key
  map entry: `pre_mlp_layernorm.weight`.
- `_extra_state`. Every TE module saves one (TE's quantizer metadata: empty without fp8):
  TENorm (`pre_mlp_layernorm`, `q_layernorm`, `k_layernorm`, and the block's
  `final_layernorm` whenever TE is installed) has one where the local norms have none. Linear
  layers save one in both specs (megatron's own linears save None).

- Multi-latent attention (DeepSeek-V3). megatron's local MLA spec has no key map: its layers
  save `pre_mlp_layernorm.weight` dense or MoE, and the q/kv latents' norms as
  `self_attention.q_layernorm.weight` / `kv_layernorm.weight`, which TE fuses into the
  up-projections (`self_attention.linear_q_up_proj.layer_norm_weight`,
  `linear_kv_up_proj.layer_norm_weight`); a TE dense layer fuses its pre-MLP norm
  (`mlp.linear_fc1.layer_norm_weight`). The input norm is `input_layernorm.weight` in both.

Other dense layers need no rename: the local key map gives `self_attention.linear_qkv.layer_norm_weight`
and `mlp.linear_fc1.layer_norm_weight`, the names of TE's fused parameters. Keys are the
layer-stacked ones (`decoder.layers.` without an index, the layer number being an offset), or
per layer (`decoder.layers.{L}.`) in a model whose layers differ (dense first layers of an MoE
model: megatron's non-homogeneous layers).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import megatron_rl.compat  # noqa: F401  (megatron-core on CPU needs its patches first)

from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

# (local spec key, TE spec key) of the tensors the specs name differently.
LOCAL_AND_TE_KEYS: tuple[tuple[str, str], ...] = (
    ("decoder.layers.mlp.linear_fc1.layer_norm_weight", "decoder.layers.pre_mlp_layernorm.weight"),
    ("decoder.layers.mlp.linear_fc1.layer_norm_bias", "decoder.layers.pre_mlp_layernorm.bias"),
    # multi-latent attention: the q/kv latents' norms, fused by TE into the up-projections
    ("decoder.layers.self_attention.q_layernorm.weight", "decoder.layers.self_attention.linear_q_up_proj.layer_norm_weight"),
    ("decoder.layers.self_attention.kv_layernorm.weight", "decoder.layers.self_attention.linear_kv_up_proj.layer_norm_weight"),
)
OTHER_SPEC_KEY: dict[str, str] = {
    **{local: te for local, te in LOCAL_AND_TE_KEYS},
    **{te: local for local, te in LOCAL_AND_TE_KEYS},
}
EXTRA_STATE = "_extra_state"
_LAYER_INDEX = re.compile(r"^(decoder\.layers\.)(\d+\.)(.*)$")


def other_spec_key(key: str) -> str | None:
    """The other spec's checkpoint key for `key`, stacked or per layer; None when both specs
    name the tensor alike."""
    match = _LAYER_INDEX.match(key)
    if match is None:
        return OTHER_SPEC_KEY.get(key)
    other = OTHER_SPEC_KEY.get(match[1] + match[3])
    return None if other is None else other.replace(match[1], match[1] + match[2], 1)


def checkpoint_keys(dist_dir: str | Path) -> set[str]:
    """The tensor and object keys saved in a dist_checkpointing directory (metadata only)."""
    return {entry.key for entry in load_sharded_metadata(str(dist_dir)).values()}


@dataclasses.dataclass
class LoadPlan:
    """A sharded state dict to load from a checkpoint written with either spec."""

    state_dict: dict  # the model's sharded state dict with keys renamed to the checkpoint's
    renamed: dict[str, str]  # state-dict key -> the checkpoint key it loads from
    left_out: list[str]  # `_extra_state` entries the checkpoint lacks (the module keeps its own)


def plan_load(sharded_state_dict: dict, saved_keys: set[str]) -> LoadPlan:
    """Maps a model's sharded state dict onto a checkpoint's keys: an entry whose key the
    checkpoint lacks loads from the other spec's name for it when the checkpoint has that, and
    is left out when it is an `_extra_state` object; anything else is kept (the load then
    names it as missing). Entries are not modified; renamed ones are copies."""
    state, renamed, left_out = {}, {}, []
    for name, entry in sharded_state_dict.items():
        key = getattr(entry, "key", None)
        if key is None or key in saved_keys:
            state[name] = entry
        elif other_spec_key(key) in saved_keys:
            state[name] = dataclasses.replace(entry, key=other_spec_key(key))
            renamed[name] = other_spec_key(key)
        elif isinstance(entry, ShardedObject) and key.endswith(EXTRA_STATE):
            left_out.append(name)
        else:
            state[name] = entry
    return LoadPlan(state, renamed, left_out)
