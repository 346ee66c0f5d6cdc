"""The GPU checks of the sigmoid-router MoE families (issue 51): a tiny GLM-4.5-style model
(glm4_moe: q/k/v biases, half-rotary heads, a dense first layer, a shared expert, grouped sigmoid
routing with a frozen expert bias) and a tiny DeepSeek-V3-style one (deepseek_v3: multi-latent
attention with YaRN, two shared experts), each built from its HF config (megatron_rl/models/tiny.py,
the distributed tests' models) on one rank:

- parity: the megatron model (TransformerEngine's spec on CUDA where TE imports, else the local
  spec) in float32 with TF32 off gives transformers' logits on the same weights; in bfloat16 its
  log-probabilities stay within the bf16 checks' 0.02 (mean) of transformers' float32 ones;
- a LoRA step: adapters on every linear (every MLA linear; the dense MLP, the shared experts and
  each routed expert, one linear per expert as the policy trainer builds them), two SAO steps on
  one batch (bf16 on CUDA, float32 on CPU): the loss falls, every attention/MLA adapter of every
  layer, the dense MLP's, the shared experts' and some routed experts' moved, no base weight did.

With two GPUs, `multi_moe_families` runs deepseek_v3 at TP = 2 and glm4_moe at EP = 2 against
transformers (tests/gpu/multi_gpu.py's rules). On CPU (--cpu) the one-GPU checks run the local
spec: tests/distributed/test_gpu_check.py. The CPU twins of what the GPU adds (TE's spec) are
tests/distributed/test_hf_parity.py and test_policy_lora.py's TE-stand-in steps."""

from __future__ import annotations

import tempfile
from pathlib import Path

# float32, TF32 off: transformers and megatron sum in other orders (and TE's kernels on CUDA);
# on CPU the distributed tests' 1e-4.
CPU_LOGIT_ATOL, GPU_LOGIT_ATOL = 1e-4, 1e-3
BF16_MEAN_LOGPROB_ERR = 0.02  # bf16_policy's criterion
RANK, ALPHA = 4, 8.0


def check_glm4_moe(cpu: bool) -> dict:
    return _family_check("glm4_moe", cpu)


def check_deepseek_v3(cpu: bool) -> dict:
    return _family_check("deepseek_v3", cpu)


def _family_check(family: str, cpu: bool) -> dict:
    import json

    import torch
    from safetensors.torch import load_file

    from megatron_rl.config import Architecture
    from megatron_rl.conversion.hf_mapping import hf_to_megatron
    from megatron_rl.models.tiny import make_tiny_model
    from tests.gpu.checks import _installed

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cuda = torch.cuda.is_available() and not cpu
    te = cuda and _installed("transformer_engine")
    with tempfile.TemporaryDirectory() as tmp:
        directory = make_tiny_model(family, Path(tmp) / family, seed=3, layers=2, tokenizer="char")
        arch = Architecture.from_hf_config(json.loads((directory / "config.json").read_text()), str(directory))
        full = hf_to_megatron(load_file(directory / "model.safetensors"), arch)
        input_ids = torch.randint(1, arch.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
        reference = _hf_logits(directory, input_ids, "cuda" if cuda else "cpu")
    figures = {"spec": "te" if te else "local", "family": family, "layers": arch.num_layers,
               "experts": arch.num_experts, "multi_latent_attention": arch.multi_latent_attention}  # fmt: skip
    logits = {dtype: _megatron_logits(arch, full, input_ids, dtype, te) for dtype in ("float32", "bfloat16")}
    figures["max_abs_logit_err_fp32"] = (logits["float32"] - reference).abs().max().item()
    expected = torch.log_softmax(reference, dim=-1)
    bf16_err = (torch.log_softmax(logits["bfloat16"], dim=-1) - expected).abs()
    figures["mean_abs_logprob_err_bf16"] = bf16_err.mean().item()
    figures["max_abs_logprob_err_bf16"] = bf16_err.max().item()
    figures.update(_lora_steps(arch, full, "bfloat16" if cuda else "float32", te))
    limit = GPU_LOGIT_ATOL if cuda else CPU_LOGIT_ATOL
    problems = []
    if not figures["max_abs_logit_err_fp32"] <= limit:
        problems.append(f"float32 logits differ from transformers' by more than {limit:g}")
    if not figures["mean_abs_logprob_err_bf16"] <= BF16_MEAN_LOGPROB_ERR:
        problems.append(f"bf16 log-probs are more than {BF16_MEAN_LOGPROB_ERR} from transformers' on average")
    problems += figures.pop("lora_problems")
    if problems:
        raise AssertionError(f"{family}: {'; '.join(problems)}: {figures}")
    return figures


def _hf_logits(directory: Path, input_ids, device: str):
    """transformers' float32 logits [batch, seq, vocab] on `device`, returned on the CPU; its
    experts computed one at a time (`eager`)."""
    import torch
    from transformers import AutoModelForCausalLM

    # the plain per-expert loop (transformers' default on CUDA is torch's grouped_mm)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, experts_implementation="eager")
    model = model.to(device).eval()
    with torch.no_grad():
        logits = model(input_ids.to(device)).logits.float().cpu()
    del model
    return logits


def _build(arch, full, dtype: str, te: bool):
    from megatron_rl.models.builder import build_gpt_model
    from megatron_rl.models.sharding import load_full_state_dict

    # one linear per expert: what LoRA on the experts needs (TE's grouped GEMM has no single weight)
    model = build_gpt_model(arch, dtype=dtype, transformer_engine=te, moe_grouped_gemm=False)
    load_full_state_dict(model, full)
    return model


def _megatron_logits(arch, full, input_ids, dtype: str, te: bool):
    """The megatron model's logits [batch, seq, vocab] in float32 on the CPU (eval, causal)."""
    import torch

    model = _build(arch, full, dtype, te).eval()
    device = next(model.parameters()).device
    ids = input_ids.to(device)
    positions = torch.arange(ids.shape[1], device=device).expand_as(ids)
    with torch.no_grad():
        logits = model(ids, positions, attention_mask=None).float().cpu()
    del model
    return logits


def _adapter_kind(name: str) -> str:
    """attention (every MLA linear, or qkv/proj), dense_mlp, shared_experts or routed_experts."""
    if ".self_attention." in name:
        return "attention"
    if ".shared_experts." in name:
        return "shared_experts"
    return "routed_experts" if ".experts." in name else "dense_mlp"


def _lora_steps(arch, full, dtype: str, te: bool) -> dict:
    """Two SAO steps with LoRA on every linear: the losses, which adapters moved, the problems."""
    import torch

    from megatron_rl.config import AlgorithmConfig, OptimizerConfig
    from megatron_rl.policy.loss import policy_loss_func
    from megatron_rl.trainer.optimizer import build_trainable
    from megatron_rl.trainer.step import train_step
    from megatron_rl.transforms.lora import apply_lora
    from tests.gpu.checks import _micro_batches

    model = _build(arch, full, dtype, te)
    wrapped = apply_lora(model, RANK, ALPHA, seed=5)
    names = dict(model.named_parameters())
    base = {n: p.detach().clone() for n, p in names.items() if ".lora_" not in n}
    trainable = build_trainable(model, OptimizerConfig(lr=1e-2, grad_clip=1e6), total_steps=4)
    micro_batches = _micro_batches(arch, seed=4, count=4, seq_len=64)
    loss_func = policy_loss_func(AlgorithmConfig(type="sao"))
    first = train_step(trainable, micro_batches, loss_func)
    second = train_step(trainable, micro_batches, loss_func)
    moved = {f"{layer}.lora_b" for layer in wrapped if names[f"{layer}.lora_b"].detach().abs().max() > 0}
    kinds = {kind: [layer for layer in wrapped if _adapter_kind(layer) == kind]
             for kind in ("attention", "dense_mlp", "shared_experts", "routed_experts")}  # fmt: skip
    figures = {
        "lora_losses": [first["loss"], second["loss"]],
        "lora_grad_norm": first["grad_norm"],
        "adapters": {kind: len(layers) for kind, layers in kinds.items()},
        "adapters_moved": {kind: sum(f"{layer}.lora_b" in moved for layer in layers) for kind, layers in kinds.items()},
        "attention_linears": sorted({layer.rsplit(".", 1)[-1] for layer in kinds["attention"]}),
    }
    problems = []
    losses = figures["lora_losses"]
    if not all(v is not None and torch.isfinite(torch.tensor(v)) for v in [*losses, first["grad_norm"]]):
        problems.append("non-finite LoRA loss or grad norm")
    elif not losses[1] < losses[0]:
        problems.append("the LoRA step did not lower the loss on its batch")
    for kind in ("attention", "dense_mlp", "shared_experts"):
        if not kinds[kind] or figures["adapters_moved"][kind] != len(kinds[kind]):
            problems.append(f"not every {kind} adapter trained ({figures['adapters_moved'][kind]} of {len(kinds[kind])})")
    if not figures["adapters_moved"]["routed_experts"]:
        problems.append("no routed expert's adapter trained")
    changed = sorted(n for n, t in base.items() if not torch.equal(names[n].detach(), t))
    if changed:
        problems.append(f"base weights changed under LoRA: {changed[:3]}")
    figures["lora_problems"] = problems
    del trainable, model
    return figures


# ---------------------------------------------------------------------------------------------
# Two GPUs (tests/gpu/multi_gpu.py's rules: NCCL ranks as fresh interpreters, TF32 off)

# deepseek_v3 at TP = 2 (on TE's spec its down-projections are duplicated on both ranks), glm4_moe
# at EP = 2 (three of its six experts a rank, the all-to-all dispatcher)
MULTI_LAYOUTS = {"deepseek_v3": (2, 1), "glm4_moe": (1, 2)}


def layout_logits(rank, world_size, cases, input_ids):
    """Per family: the full-vocabulary logits [batch, seq, vocab] of its model at its (tp, ep) of
    MULTI_LAYOUTS, eval; TE's spec where TE imports on CUDA, else the local spec (forward only:
    megatron's local MLA at TP > 1 is refused for training, not for this)."""
    import torch

    from megatron_rl import compat, parallel
    from megatron_rl.models.builder import build_gpt_model
    from megatron_rl.models.sharding import load_full_state_dict
    from tests.gpu.checks import _installed
    from tests.support.ranks import gather_vocab

    te = torch.cuda.is_available() and not compat.CPU_MODE and _installed("transformer_engine")
    out = {}
    for family, (arch, full) in cases.items():
        tp, ep = MULTI_LAYOUTS[family]
        parallel.initialize_model_parallel(tp=tp, ep=ep)
        model = build_gpt_model(arch, tp=tp, ep=ep, transformer_engine=te)
        load_full_state_dict(model, full)
        model.eval()
        device = compat.device()
        ids = input_ids.to(device)
        positions = torch.arange(ids.shape[1], device=device).expand_as(ids)
        with torch.no_grad():
            out[family] = (gather_vocab(model(ids, positions, attention_mask=None)).float(), "te" if te else "local")
        del model
    return out


def check_multi_moe_families(cpu: bool) -> dict:
    """deepseek_v3 at TP = 2 and glm4_moe at EP = 2 on two ranks give transformers' logits on the
    same weights (float32, TF32 off): GPU 1e-3, CPU 1e-4 (test_hf_parity.py's layouts)."""
    import json

    import torch
    from safetensors.torch import load_file

    from megatron_rl.config import Architecture
    from megatron_rl.conversion.hf_mapping import hf_to_megatron
    from megatron_rl.models.tiny import make_tiny_model
    from tests.gpu.multi_gpu import ranks

    cases, references = {}, {}
    input_ids = torch.randint(1, 512, (2, 48), generator=torch.Generator().manual_seed(1))
    with tempfile.TemporaryDirectory() as tmp:
        for family in MULTI_LAYOUTS:
            directory = make_tiny_model(family, Path(tmp) / family, seed=3, layers=2, tokenizer="char")
            arch = Architecture.from_hf_config(json.loads((directory / "config.json").read_text()), str(directory))
            cases[family] = (arch, hf_to_megatron(load_file(directory / "model.safetensors"), arch))
            references[family] = _hf_logits(directory, input_ids, "cpu")
    results = ranks(cpu, layout_logits, 2, cases, input_ids)
    limit = CPU_LOGIT_ATOL if cpu else GPU_LOGIT_ATOL
    figures: dict = {"logit_atol": limit}
    for family, (tp, ep) in MULTI_LAYOUTS.items():
        figures[f"{family}_tp{tp}_ep{ep}_spec"] = results[0][family][1]
        figures[f"{family}_tp{tp}_ep{ep}_max_abs_logit_err"] = max(
            (rank[family][0] - references[family]).abs().max().item() for rank in results
        )
    bad = [k for k, v in figures.items() if k.endswith("_max_abs_logit_err") and not v <= limit]
    if bad:
        raise AssertionError(f"{bad}: logits differ from transformers' by more than {limit:g}: {figures}")
    return figures
