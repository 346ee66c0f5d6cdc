"""LoRA adapters in PEFT's format, which transformers + PEFT and vLLM load: a directory with
`adapter_config.json` and `adapter_model.safetensors`, tensors named
`base_model.model.<HF module>.lora_A.weight` [rank, in] and `.lora_B.weight` [out, rank], and
the scale lora_alpha / r, the same as ours (transforms/lora.py).

Megatron fuses some HF linears into one (linear_qkv = q, k, v per query group; linear_fc1 =
[gate; up]); its adapter is one A and one B over the fused output. On HF's modules that is the
same A for each part and B split like the weight (`hf_mapping`'s split of the fused tensor, on
B's rows): q = W_q x + s B_q A x is exactly the fused layer's q rows. So the export is exact, and
its reverse (`peft_to_megatron_adapters`) exact for adapters whose parts share A (ours); an
adapter trained elsewhere with a separate A per part has no fused equivalent and is refused.

Expert linears export under HF's per-expert names (`mlp.experts.{E}.gate_proj`, as released
checkpoints store experts). transformers 5 holds the routed experts fused (`mlp.experts.gate_up_proj`,
`down_proj`), and PEFT (0.21) converts a per-expert adapter to them when it loads it: every
`gate_proj`/`up_proj`/`down_proj` of target_modules becomes a target parameter of the fused
experts, so the plain linears of those names (a dense first layer's MLP, the shared experts of
glm4_moe and deepseek_v3) would be left unwrapped and their adapters dropped. The config names
their weights in `target_parameters` as well (`hf_target_parameters`), which wraps them again
(tests/distributed/test_peft_families.py); vLLM reads target_modules and ignores the key.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from megatron_rl.config import Architecture
from megatron_rl.conversion.hf_mapping import family_mapping

PREFIX = "base_model.model."
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTER_SUFFIXES = (".lora_a", ".lora_b")


class PeftFormatError(ValueError):
    pass


def is_adapter(name: str) -> bool:
    return name.endswith(ADAPTER_SUFFIXES)


def _adapted(arch: Architecture):
    """(megatron layer name, its HF module names, split) for every linear that can carry an adapter."""
    for mapped in family_mapping(arch).tensors:
        if mapped.megatron.endswith(".weight") and mapped.megatron.split(".")[-2].startswith("linear_"):
            modules = tuple(name[: -len(".weight")] for name in mapped.hf)
            yield mapped.megatron[: -len(".weight")], modules, mapped.split


def megatron_adapters_to_peft(adapters: Mapping[str, torch.Tensor], arch: Architecture,
                              partial: bool = False) -> dict[str, torch.Tensor]:  # fmt: skip
    """PEFT's tensors from full (gathered) megatron adapters (`layer.lora_a`, `layer.lora_b`).
    Each part of a fused layer gets its own copy of A (safetensors stores no shared memory).
    Every adapter must be used, unless `partial` (no check that all the model's are there either)."""
    out, used = {}, set()
    for layer, modules, split in _adapted(arch):
        a, b = adapters.get(f"{layer}.lora_a"), adapters.get(f"{layer}.lora_b")
        if a is None and b is None:
            continue
        if a is None or b is None:
            raise PeftFormatError(f"{layer}: lora_a without lora_b, or the reverse")
        parts = split(b, arch) if split is not None else (b,)
        for module, part in zip(modules, parts, strict=True):
            out[f"{PREFIX}{module}.lora_A.weight"] = a.detach().clone().contiguous()
            out[f"{PREFIX}{module}.lora_B.weight"] = part.detach().clone().contiguous()
        used.update({f"{layer}.lora_a", f"{layer}.lora_b"})
    unused = sorted(set(n for n in adapters if is_adapter(n)) - used)
    if unused and not partial:
        raise PeftFormatError(f"adapters of layers PEFT's format has no module for: {unused[:4]}")
    return out


def peft_to_megatron_adapters(peft: Mapping[str, torch.Tensor], arch: Architecture) -> dict[str, torch.Tensor]:
    """The reverse of `megatron_adapters_to_peft`: megatron's fused adapters from PEFT tensors.
    The parts of a fused layer must share A (a PeftFormatError names the layer otherwise) and be
    all present or all absent."""
    out, used = {}, set()
    for layer, modules, _ in _adapted(arch):
        names = [(f"{PREFIX}{m}.lora_A.weight", f"{PREFIX}{m}.lora_B.weight") for m in modules]
        present = [a in peft and b in peft for a, b in names]
        if not any(present):
            continue
        if not all(present):
            leaf = [m.rsplit(".", 1)[-1] for m in modules]
            has = sorted(n for n, ok in zip(leaf, present) if ok)
            missing = sorted(n for n, ok in zip(leaf, present) if not ok)
            raise PeftFormatError(f"{layer}: the adapter has {has} but not {missing}; megatron fuses them "
                                  f"into one layer")  # fmt: skip
        a = peft[names[0][0]]
        if any(not torch.equal(peft[name_a], a) for name_a, _ in names[1:]):
            raise PeftFormatError(f"{layer}: {list(modules)} have different lora_A; megatron's fused layer "
                                  f"has one A (train with the parts' A shared, or merge the adapter)")  # fmt: skip
        bs = [peft[name_b] for _, name_b in names]
        fuse = next(m.fuse for m in family_mapping(arch).tensors if m.megatron == f"{layer}.weight")
        out[f"{layer}.lora_a"] = a
        out[f"{layer}.lora_b"] = fuse(*bs, arch) if fuse is not None else bs[0]
        used.update(n for pair in names for n in pair)
    unused = sorted(set(peft) - used)
    if unused:
        raise PeftFormatError(f"PEFT tensors with no megatron layer of this architecture: {unused[:4]}")
    return out


def hf_target_modules(tensors: Iterable[str]) -> list[str]:
    """The module leaf names (q_proj, gate_proj, ...) PEFT tensors adapt."""
    return sorted({name.split(".")[-3] for name in tensors if name.endswith(".lora_A.weight")})


EXPERT_LEAVES = ("gate_proj", "up_proj", "down_proj")


def hf_target_parameters(tensors: Iterable[str]) -> list[str]:
    """The weights (`mlp.gate_proj.weight`, `mlp.shared_experts.down_proj.weight`, ...) of the plain
    MLP linears PEFT tensors adapt beside routed experts' (`mlp.experts.{E}.`): what PEFT's
    conversion to transformers' fused experts would otherwise leave unwrapped (the module
    docstring); [] when the adapter has no routed experts."""
    modules = {name[len(PREFIX) : -len(".lora_A.weight")] for name in tensors if name.endswith(".lora_A.weight")}
    if not any(".mlp.experts." in module for module in modules):
        return []
    plain = {module[module.index("mlp.") :] + ".weight" for module in modules
             if ".mlp." in module and ".mlp.experts." not in module and module.rsplit(".", 1)[-1] in EXPERT_LEAVES}  # fmt: skip
    return sorted(plain)


def adapter_config(rank: int, alpha: float, target_modules: list[str], base_model: str | None = None,
                   target_parameters: list[str] | None = None) -> dict:  # fmt: skip
    """adapter_config.json of a plain LoRA adapter (no dropout, no bias, no rsLoRA: our forward);
    `target_parameters` (`hf_target_parameters`) only when there are some."""
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model, "r": rank,
        "lora_alpha": alpha, "lora_dropout": 0.0, "bias": "none", "target_modules": target_modules,
        "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "modules_to_save": None,
        "init_lora_weights": True, "inference_mode": True,
    }  # fmt: skip
    if target_parameters:
        config["target_parameters"] = target_parameters
    return config


def write_peft_adapter(directory: str | Path, tensors: Mapping[str, torch.Tensor], rank: int, alpha: float,
                       base_model: str | None = None) -> Path:  # fmt: skip
    """Writes PEFT tensors (`megatron_adapters_to_peft`) and their adapter_config.json into
    `directory` (created); returns it."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    ranks = {t.shape[0] for n, t in tensors.items() if n.endswith(".lora_A.weight")}
    if ranks != {rank}:
        raise PeftFormatError(f"lora_A tensors of rank {sorted(ranks)}, the adapter config says {rank}")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
    config = adapter_config(rank, alpha, hf_target_modules(tensors), base_model, hf_target_parameters(tensors))
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return directory


def read_peft_adapter(directory: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, adapter_config) of a PEFT adapter directory, checked to be the plain LoRA our
    forward computes (its dropout only acted in training: not checked)."""
    directory = Path(directory)
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (directory / name).is_file():
            raise PeftFormatError(f"{directory}: no {name} (not a PEFT adapter directory)")
    config = json.loads((directory / CONFIG_FILE).read_text())
    problems = [f"{key}={config.get(key)!r}" for key, plain in
                (("peft_type", "LORA"), ("bias", "none"), ("use_rslora", False), ("use_dora", False))
                if config.get(key, plain) != plain]  # fmt: skip
    if problems:
        raise PeftFormatError(f"{directory / CONFIG_FILE}: {', '.join(problems)}: only plain LoRA is supported")
    return load_file(str(directory / WEIGHTS_FILE)), config
