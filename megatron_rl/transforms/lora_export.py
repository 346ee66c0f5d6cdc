"""The LoRA export tool (`megatron-rl export-lora`, and the conversion of a LoRA training checkpoint
step to HF weights): a step's adapters (and a critic's value head) as full tensors at TP = 1
(`trainable_tensors`, under the names `gather_full_parameters` gives), written in PEFT's format
(`export_peft`, transforms/peft.py) or folded into the base's HF tensors, W + (alpha / rank) B A,
one decoder layer at a time, with the HF side files (`export_merged`). `export_hf` writes any
checkpoint as HF weights: a LoRA step merged into the base its meta.json names, any other through
conversion/convert.py. What every save and resume runs (the base's identity) is
transforms/lora_base.py.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path

import megatron_rl.compat  # noqa: F401  (megatron-core on CPU needs its patches first)

import torch

from megatron_rl.config import Architecture
from megatron_rl.config.model import EXPERT_LORA_TARGETS
from megatron_rl.conversion import checkpoint_io as io
from megatron_rl.conversion.convert import (
    checkpoint_to_hf,
    layer_of,
    load_checkpoint_tensors,
    load_structure_tensors,
    single_process_group,
    write_hf_by_layer,
)
from megatron_rl.conversion.hf_mapping import MegatronStateFromHF
from megatron_rl.models.builder import build_gpt_model
from megatron_rl.models.value_model import build_value_model
from megatron_rl.transforms.lora import apply_lora, merge_adapter_tensors
from megatron_rl.transforms.lora_base import (
    TRAINING_META,
    BaseMismatch,
    base_identity,
    check_base,
    is_trainable_key,
    read_lora_meta,
)
from megatron_rl.transforms.peft import megatron_adapters_to_peft, write_peft_adapter


def _adapted_structure(arch: Architecture, lora: Mapping, value_model: bool) -> dict:
    """The trainable entries of the sharded state dict of the LoRA-wrapped local-spec model at
    TP = PP = EP = 1 on the meta device (the names of `gather_full_parameters`)."""

    experts = bool(arch.num_experts) and any(t in EXPERT_LORA_TARGETS for t in lora["target_modules"])
    builder = build_value_model if value_model else build_gpt_model
    with torch.device("meta"):
        model = builder(arch, transformer_engine=False, device="meta", use_cpu_initialization=True,
                        perform_initialization=False, **({"moe_grouped_gemm": False} if experts else {}))  # fmt: skip
        apply_lora(model, lora["rank"], lora["alpha"], tuple(lora["target_modules"]))
    return {k: v for k, v in model.sharded_state_dict().items() if is_trainable_key(k)}


def trainable_tensors(step_dir: str | Path, arch: Architecture, value_model: bool = False) -> dict[str, torch.Tensor]:
    """The full (TP = 1) adapters, and a critic's value head, of a LoRA training checkpoint step
    written at any layout, in their saved dtypes: `decoder.layers.0.self_attention.linear_qkv.lora_a`, ..."""

    lora = read_lora_meta(step_dir)
    if lora is None:
        raise io.CheckpointError(f"{step_dir}: not a LoRA checkpoint (its meta.json has no lora section)")
    single_process_group()
    structure = _adapted_structure(arch, lora, value_model)
    return load_structure_tensors(Path(step_dir) / "dist", structure)


def hf_base_dir(base: str | Path | None, fallback: str | Path | None = None) -> str | None:
    """The HF directory (config.json and safetensors) of a base: the base itself, or the HF
    directory a converted checkpoint was made from, or `fallback`, when it holds weights."""

    def has_weights(directory) -> bool:
        d = Path(directory)
        return (d / "config.json").is_file() and any(d.glob("*.safetensors"))

    candidates = []
    if base:
        candidates.append(base)
        if (Path(base) / io.META_FILE).is_file():
            candidates.append(json.loads((Path(base) / io.META_FILE).read_text()).get("source"))
    candidates.append(fallback)
    for candidate in candidates:
        if candidate and has_weights(candidate):
            return str(Path(candidate).absolute())
    return None


def export_peft(step_dir: str | Path, out: str | Path, arch: Architecture, base_model: str | None) -> list[str]:
    """Writes a policy checkpoint step's adapters as a PEFT adapter directory (adapter_config.json,
    adapter_model.safetensors) with `base_model` as base_model_name_or_path."""

    lora = read_lora_meta(step_dir)
    if lora is not None and lora.get("key") == "value.lora":
        raise io.CheckpointError(
            f"{step_dir}: a critic checkpoint (value.lora): its value head has no place in a PEFT causal-LM "
            "adapter; export it merged (--merged)"
        )
    adapters = trainable_tensors(step_dir, arch)
    tensors = megatron_adapters_to_peft(adapters, arch)
    write_peft_adapter(out, tensors, lora["rank"], lora["alpha"], base_model=base_model)
    size = sum(t.nbytes for t in tensors.values())
    return [f"wrote {Path(out)} (PEFT adapter: {len(tensors)} tensors, {size:,} bytes; base {base_model})"]


def _base_megatron_tensors(base: Path, arch: Architecture) -> tuple[Mapping[str, torch.Tensor], bool]:
    """(the base's full megatron tensors, whether it is a value model): a converted checkpoint
    loaded in its dtype, or an HF directory's tensors mapped lazily."""

    if (base / io.META_FILE).is_file():
        value_model = bool(io.read_meta(base)["value_model"])
        return load_checkpoint_tensors(base, arch, value_model), value_model
    if (base / "config.json").is_file():
        return MegatronStateFromHF(io.read_hf_state_dict(base), arch, value_model=False), False
    raise io.CheckpointError(f"{base}: neither a converted checkpoint nor an HF directory (the LoRA base)")


def export_merged(step_dir: str | Path, out: str | Path, hf_config_dir: str | Path, base: str | Path | None = None,
                  value_model: bool | None = None) -> list[str]:  # fmt: skip
    """Writes HF safetensors of a LoRA checkpoint step merged into its base (`base`, default the
    one its meta.json names; checked against the saved fingerprint): W + (alpha / rank) B A in
    W's dtype (computed in float32), plain HF names, one decoder layer at a time, with the config
    and tokenizer files of `hf_config_dir`. A critic's (`value.lora`) gets its trained value head."""

    lora = read_lora_meta(step_dir)
    if lora is None:
        raise io.CheckpointError(f"{step_dir}: not a LoRA checkpoint (its meta.json has no lora section)")
    saved = lora["base"]
    where = saved.get("where", "model.checkpoint")
    base = base or saved.get("checkpoint")
    if not base:
        raise BaseMismatch(
            f"{step_dir}: its adapters were trained on a random initialisation ({where} null): there are no base "
            "weights to merge them into; export the adapters alone"
        )
    check_base(saved, base_identity(str(base), where, saved.get("seed")), step_dir)
    if value_model is None:
        value_model = lora.get("key") == "value.lora"
    arch = io.read_architecture(Path(hf_config_dir))
    single_process_group()
    trained = trainable_tensors(step_dir, arch, value_model)
    base_tensors, _ = _base_megatron_tensors(Path(base), arch)
    names = sorted({n for n in base_tensors if value_model or not n.startswith("value_head.")}
                   | {n for n in trained if not n.endswith((".lora_a", ".lora_b"))})  # fmt: skip

    def layers():
        for group in sorted({layer_of(n) for n in names}):
            layer = {n: trained[n] if n in trained else base_tensors[n] for n in names if layer_of(n) == group}
            layer.update({n: t for n, t in trained.items() if layer_of(n) == group and n.endswith((".lora_a", ".lora_b"))})
            yield merge_adapter_tensors(layer, lora["alpha"])

    paths = write_hf_by_layer(layers(), arch, value_model, Path(out), f"{step_dir}: the checkpoint and its base give")
    copied = io.copy_hf_side_files(Path(hf_config_dir), Path(out))
    adapters = sum(n.endswith(".lora_a") for n in trained)
    return [
        f"merged {adapters} adapters (alpha {lora['alpha']:g}, rank {lora['rank']}) into the base {base}",
        f"wrote {', '.join(str(p) for p in paths)}",
        f"copied {', '.join(copied)} from {hf_config_dir}",
    ]


def export_lora(resolved, step_dir: str | Path, out: str | Path, merged: bool = False) -> list[str]:
    """`megatron-rl export-lora`: a LoRA checkpoint step of the run `resolved` (the policy's, or
    the critic's with `value.lora`: meta.json says which) as a PEFT adapter directory, or with
    `merged` as merged HF weights with the config and tokenizer files. The base is the config's
    (`model.checkpoint` / `value.model.checkpoint`), checked against the one the checkpoint
    names. `out` is written as `out.partial` and renamed when complete; an existing non-empty
    `out` is refused."""
    step_dir, out = Path(step_dir), Path(out)
    lora = read_lora_meta(step_dir)
    if lora is None:
        raise io.CheckpointError(
            f"{step_dir}: its meta.json has no lora section: a full fine-tuning checkpoint (every tensor), not "
            "LoRA adapters; convert it with tools/convert_megatron_to_hf.py"
        )
    critic = lora.get("key") == "value.lora"
    if critic and resolved.value is None:
        raise ValueError(f"{step_dir}: a critic checkpoint (value.lora), and the config has no value section")
    model_config = resolved.value.model if critic else resolved.model
    where = "value.model.checkpoint" if critic else "model.checkpoint"
    base = model_config.checkpoint
    check_base(lora["base"], base_identity(base, where, lora["base"].get("seed")), step_dir)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"--out {out}: not empty; refusing to overwrite it")
    served = None if critic else resolved.inference.model_dir
    hf_dir = hf_base_dir(base, served or model_config.hf_config)
    partial = out.with_name(out.name + ".partial")
    if partial.exists():
        shutil.rmtree(partial)
    if merged:
        config_dir = served or model_config.hf_config or hf_dir
        if not config_dir or not (Path(config_dir) / "config.json").is_file():
            raise io.CheckpointError(
                f"{'inference.model_dir / ' if not critic else ''}{where.replace('checkpoint', 'hf_config')}: no HF "
                "directory with config.json to take the merged model's config and tokenizer from"
            )
        lines = export_merged(step_dir, partial, config_dir, base=base, value_model=critic)
    else:
        arch = resolved.layout.critic_architecture if critic else resolved.layout.policy_architecture
        lines = export_peft(step_dir, partial, arch, hf_dir)
    if out.exists():
        out.rmdir()
    partial.rename(out)
    return [line.replace(str(partial), str(out)) for line in lines]


def export_hf(checkpoint_dir: str | Path, out_dir: str | Path, hf_config_dir: str | Path,
              value_model: bool | None = None) -> list[str]:  # fmt: skip
    """Writes HF safetensors of a converted checkpoint or of one training checkpoint step: a LoRA
    step (adapters only) merged into the base its meta.json names (`export_merged`), any other
    through `checkpoint_to_hf` (whose `value_model` says what a training step's meta.json does not)."""
    checkpoint_dir = Path(checkpoint_dir)
    if (checkpoint_dir / TRAINING_META).is_file() and read_lora_meta(checkpoint_dir) is not None:
        return export_merged(checkpoint_dir, out_dir, hf_config_dir, value_model=value_model)
    return checkpoint_to_hf(checkpoint_dir, Path(out_dir), Path(hf_config_dir), value_model=value_model)
