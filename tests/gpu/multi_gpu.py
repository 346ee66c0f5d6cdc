"""The multi-GPU checks (issue 36): what several GPUs of one node show, run by tests/gpu/check.py
only where `torch.cuda.device_count() >= MIN_GPUS` (else NOT RUN, "needs 2 GPUs, found N").

Each check spawns its ranks as fresh interpreters (tests/support/spawn.py `run_ranks`,
start method "spawn": NCCL ranks never fork a process that asked CUDA anything), one GPU a rank
(`parallel.initialize_distributed` binds LOCAL_RANK), float32 with TF32 off. The same functions
with `cpu=True` are their gloo twins (tests/distributed/test_multi_gpu_twins.py), built on the
distributed tests' own rank functions:

- multi_train_step: `one_training_step` of tests/distributed/test_train_step.py at DP=2 and
  TP=2 against one process, and `moe_training_step` (here) at EP=2 on a small MoE;
- multi_weight_broadcast: path (b), `BroadcastPublisher` from policy ranks into a receiver
  process holding the real `WeightReceiverExtension` around a transformers model (vLLM is not
  needed: tests/distributed/test_weight_publish_broadcast.py's stand-in server, on its own GPU
  and NCCL here);
- multi_expert_all_to_all: `moe_logits` (here: tests/support/ranks.py's `model_logits`, which
  test_megatron_cpu.py's test_ep2_moe_equals_ep1 runs, with the tokens on the rank's device) at
  EP=2 against one process, the all-to-alls counted.

- multi_moe_families (tests/gpu/family_checks.py): deepseek_v3 at TP=2 and glm4_moe at EP=2
  against transformers' logits, with this module's `ranks`.

They have a budget of their own (`MULTI_GPU_BUDGET_S`), spent only where they run.
"""

from __future__ import annotations

import json
import multiprocessing
import tempfile
import time
import urllib.request
from pathlib import Path

MIN_GPUS = 2
# Float32 on a GPU with TF32 off: TP and DP sum in another order than one process, about 1e-6
# relative per matmul. A lost or doubled reduction moves a weight by a whole Adam step (lr 1e-3).
GPU_METRIC_REL, GPU_PARAM_ATOL, GPU_LOGIT_ATOL = 1e-4, 1e-4, 1e-4
CPU_METRIC_REL, CPU_PARAM_ATOL, CPU_LOGIT_ATOL = 1e-5, 1e-5, 1e-5  # the distributed tests' own


def not_run_reason(cpu: bool) -> str | None:
    """Why the multi-GPU checks cannot run here, or None when they can."""
    import torch

    found = 0 if cpu or not torch.cuda.is_available() else torch.cuda.device_count()
    if found >= MIN_GPUS:
        return None
    twin = "; their gloo twins: tests/distributed/test_multi_gpu_twins.py"
    return f"needs {MIN_GPUS} GPUs, found {found}{' (--cpu)' if cpu else ''}{twin}"


def exact_float32(rank: int, world_size: int, fn, *args):
    """`fn(rank, world_size, *args)` with TF32 off, its tensors moved to the CPU (the result file
    is then loadable without CUDA)."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    return _to_cpu(fn(rank, world_size, *args))


def _to_cpu(value):
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value


# On GPUs a spawn's ranks must end within this (imports, CUDA and NCCL start-up, the fused swiglu's
# compile, a tiny model), so that a check's two spawns end before its limit (tests/gpu/checks.py)
# and none is left running on a GPU when the driver kills the check.
GPU_SPAWN_TIMEOUT_S = 50.0


def ranks(cpu: bool, fn, world_size: int, *args) -> list:
    """`fn` on `world_size` ranks: gloo ranks forked from the test forkserver on CPU, fresh NCCL
    interpreters on GPUs (killed after GPU_SPAWN_TIMEOUT_S); TF32 off."""
    from tests.support.spawn import run_ranks

    return run_ranks(exact_float32, world_size, fn, *args, timeout_s=300.0 if cpu else GPU_SPAWN_TIMEOUT_S,
                     start_method="forkserver" if cpu else "spawn")  # fmt: skip


def _tolerances(cpu: bool) -> tuple[float, float, float]:
    return (
        (CPU_METRIC_REL, CPU_PARAM_ATOL, CPU_LOGIT_ATOL)
        if cpu
        else (GPU_METRIC_REL, GPU_PARAM_ATOL, GPU_LOGIT_ATOL)
    )


def _largest_difference(params: dict, reference: dict) -> float:
    """The largest absolute difference over the tensors `params` holds (an EP rank holds its own
    experts); each must be in `reference`."""
    unknown = sorted(set(params) - set(reference))
    if unknown:
        raise AssertionError(f"parameters the reference does not have: {unknown[:3]}")
    return max(float((value - reference[n]).abs().max()) for n, value in params.items())


def _covers(ranks_params: list[dict], reference: dict, layout: str) -> list[str]:
    missing = sorted(set(reference) - {n for params in ranks_params for n in params})
    return [f"{layout}: no rank holds {missing[:3]}"] if missing else []


def _metric_problems(metrics: dict, reference: dict, rel: float, layout: str) -> list[str]:
    problems = []
    for key, value in reference.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if abs(metrics[key] - value) > rel * abs(value) + 1e-6:
            problems.append(f"{layout} {key} {metrics[key]} vs one process {value}")
    return problems


# ---------------------------------------------------------------------------------------------
# (a) a policy train step at DP=2, TP=2 and EP=2 equals one process


def _moe_arch():
    from tests.support.ranks import DENSE

    return DENSE.model_copy(update=dict(family="qwen3_moe", num_layers=2, num_experts=4, num_experts_per_tok=2,
                                        moe_intermediate_size=32))  # fmt: skip


def moe_training_step(rank, world_size, arch, full, ep, count=7):
    """One SAO train_step of the MoE `arch` at expert parallel `ep` (DP = world / 1 for the dense
    weights), on `count` samples packed for this layout; (metrics, full parameters)."""
    from megatron.core import parallel_state

    from megatron_rl import parallel
    from megatron_rl.config import AlgorithmConfig, OptimizerConfig
    from megatron_rl.data.packing import pack_into_grid
    from megatron_rl.models.builder import build_gpt_model
    from megatron_rl.models.sharding import gather_full_parameters, load_full_state_dict
    from megatron_rl.policy.loss import policy_loss_func
    from megatron_rl.trainer.optimizer import build_trainable
    from megatron_rl.trainer.step import train_step
    from tests.support.samples import training_samples

    parallel.initialize_model_parallel(ep=ep)
    model = build_gpt_model(arch, ep=ep)
    load_full_state_dict(model, full)
    # adam_eps 1e-6 as in test_train_step.py: rows with near-zero gradients stay near zero
    trainable = build_trainable(model, OptimizerConfig(lr=1e-3, grad_clip=1.0, adam_eps=1e-6), total_steps=10)
    dp = parallel_state.get_data_parallel_world_size()
    grid = pack_into_grid(training_samples(count, arch.vocab_size, seed=4), 64, dp)
    metrics = train_step(trainable, grid[parallel_state.get_data_parallel_rank()],
                         policy_loss_func(AlgorithmConfig(type="sao")))  # fmt: skip
    return metrics, gather_full_parameters(model)


def train_step_references(rank, world_size, dense, moe):
    """One process (each spawn costs seconds of imports and CUDA start-up): the dense and MoE
    reference weights (tests/support/ranks.py) and one train step from each; CPU tensors."""
    from tests.distributed.test_train_step import one_training_step
    from tests.support.ranks import reference_weights

    dense_weights = _to_cpu(reference_weights(rank, world_size, dense, 5))
    dense_step = one_training_step(rank, world_size, dense, dense_weights, 1, 1, "sao", 5)[:2]
    moe_weights = _to_cpu(reference_weights(rank, world_size, moe, 11))
    moe_step = moe_training_step(rank, world_size, moe, moe_weights, 1)
    return dense_weights, _to_cpu(dense_step), moe_weights, _to_cpu(moe_step)


def train_step_layouts(rank, world_size, dense, dense_weights, moe, moe_weights):
    """Two ranks: one train step at DP=2, then TP=2 (test_train_step.py's one_training_step), then
    EP=2 on the MoE, in turn in the same processes; [(metrics, this rank's parameters)] x 3."""
    from tests.distributed.test_train_step import one_training_step

    results = [
        _to_cpu(one_training_step(rank, world_size, dense, dense_weights, tp, 1, "sao", 5)[:2])
        for tp in (1, 2)
    ]
    return results + [_to_cpu(moe_training_step(rank, world_size, moe, moe_weights, 2))]


def check_multi_train_step(cpu: bool) -> dict:
    from tests.distributed.test_train_step import ARCH

    moe = _moe_arch()
    [(weights, (ref_metrics, ref_params), moe_weights, (moe_metrics, moe_params))] = ranks(
        cpu, train_step_references, 1, ARCH, moe
    )
    layouts = ranks(cpu, train_step_layouts, 2, ARCH, weights, moe, moe_weights)
    rel, atol, _ = _tolerances(cpu)
    figures, problems = {}, []
    figures["dense_step_moved"] = _largest_difference(ref_params, weights)
    figures["moe_step_moved"] = _largest_difference(moe_params, moe_weights)
    references = {
        "dp2": (ref_metrics, ref_params),
        "tp2": (ref_metrics, ref_params),
        "ep2": (moe_metrics, moe_params),
    }
    for index, (layout, (metrics_1, params_1)) in enumerate(references.items()):
        results = [rank_results[index] for rank_results in layouts]
        for metrics, _ in results:
            problems += _metric_problems(metrics, metrics_1, rel, layout)
        problems += _covers([params for _, params in results], params_1, layout)
        figures[f"{layout}_max_param_diff"] = max(_largest_difference(p, params_1) for _, p in results)
    figures["loss_one_process"], figures["param_atol"] = ref_metrics["loss"], atol
    problems += [
        f"{k} {v:.3g} > {atol:g}" for k, v in figures.items() if k.endswith("_max_param_diff") and v > atol
    ]
    # the comparison is not vacuous: Adam's first step moves weights by about lr (1e-3), at least 5x
    # the tolerance
    problems += [
        f"{k} {v:.3g}: the step hardly moved"
        for k, v in figures.items()
        if k.endswith("moved") and v < 5 * atol
    ]
    if problems:
        raise AssertionError(f"{'; '.join(problems[:6])}: {figures}")
    return figures


# ---------------------------------------------------------------------------------------------
# (b) the weight broadcast (path (b)) from policy ranks into a receiver on NCCL


def receiver_worker(hf_dir: str, http_port: int, out_path: str, gpu: int | None) -> None:
    """A stand-in vLLM server around the real `WeightReceiverExtension`, on GPU `gpu` (None:
    the CPU): tests/distributed/test_weight_publish_broadcast.py's, with a device."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    import torch
    from transformers import AutoModelForCausalLM

    from megatron_rl.inference.vllm_extension import WeightReceiverExtension
    from tests.distributed.test_weight_publish_broadcast import _HFLoader

    device = torch.device("cpu") if gpu is None else torch.device("cuda", gpu)
    if gpu is not None:
        torch.cuda.set_device(gpu)

    class Worker(WeightReceiverExtension):
        def __init__(self):
            self.rank = 0
            self.device = device
            self.model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).to(device)
            self.loader = _HFLoader(self.model)

        def reload_weights(self, weights_iterator=None, weights_path=None, is_checkpoint_format=True):
            self.loader.load_weights(weights_iterator)

    worker = Worker()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            result = {"success": True} if self.path == "/reset_prefix_cache" else None  # vLLM's reply
            if self.path == "/collective_rpc":
                request = json.loads(body)
                result = {"results": [getattr(worker, request["method"])(**request["kwargs"])]}
                if request["method"] == "receive_weights":
                    worker.model.save_pretrained(out_path + ".model")
                    with open(out_path, "w") as f:
                        json.dump({"loaded": worker.loader.loaded, "version": worker.weights_version,
                                   "device": str(next(worker.model.parameters()).device)}, f)  # fmt: skip
            data = json.dumps(result).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    ThreadingHTTPServer(("127.0.0.1", http_port), Handler).serve_forever()


def policy_publish(rank, world_size, hf_dir, http_port, group_port, ep, backend):
    """Policy ranks at expert parallel `ep` publish perturbed initial weights (version 7) over
    `backend`; (tensors sent, this rank's HF-named share of the full weights)."""
    import torch

    from megatron_rl import parallel
    from megatron_rl.conversion.checkpoint_io import read_architecture
    from megatron_rl.conversion.hf_mapping import megatron_to_hf
    from megatron_rl.inference.vllm_control import VllmControl
    from megatron_rl.models.builder import build_gpt_model
    from megatron_rl.models.sharding import gather_full_parameters
    from megatron_rl.policy.publish import BroadcastPublisher
    from megatron_rl.trainer.weights import load_initial_weights

    parallel.initialize_model_parallel(ep=ep)
    arch = read_architecture(hf_dir)
    model = build_gpt_model(arch, ep=ep)
    load_initial_weights(model, hf_dir, arch)
    torch.manual_seed(7)  # the same noise on every replica of a tensor
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn(p.shape).to(p.device))
    control = VllmControl(f"http://127.0.0.1:{http_port}", timeout_s=120)
    publisher = BroadcastPublisher(arch, [control], "127.0.0.1", group_port, backend=backend, bucket_bytes=4096,
                                   timeout_s=120)  # fmt: skip
    if rank == 0:
        publisher.connect()
    sent = publisher.publish(model, version=7)
    return sent, megatron_to_hf(gather_full_parameters(model), arch, partial=True)


def _wait_for_server(port: int, process, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            request = urllib.request.Request(f"http://127.0.0.1:{port}/resume", data=b"", method="POST")
            urllib.request.urlopen(request, timeout=2)
            return
        except OSError:
            if time.monotonic() > deadline or not process.is_alive():
                raise AssertionError(f"the receiver did not start within {timeout_s:g} s") from None
            time.sleep(0.3)


def check_multi_weight_broadcast(cpu: bool) -> dict:
    import torch
    from safetensors.torch import load_file

    from megatron_rl.models.tiny import make_tiny_model
    from megatron_rl.parallel import free_port

    gpus = 0 if cpu else torch.cuda.device_count()
    # NCCL keeps one rank a GPU: the receiver takes the GPU after the policy's; EP=2 needs 3 GPUs
    ep = 2 if cpu or gpus >= 3 else 1
    backend = "gloo" if cpu else "nccl"
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = str(make_tiny_model("qwen3_moe", Path(tmp) / "model", seed=3))
        out, http_port = Path(tmp) / "receiver.json", free_port()
        receiver = multiprocessing.get_context("spawn").Process(
            target=receiver_worker, args=(hf_dir, http_port, str(out), None if cpu else ep), daemon=True
        )
        receiver.start()
        try:
            _wait_for_server(http_port, receiver, 120 if cpu else GPU_SPAWN_TIMEOUT_S)
            began = time.perf_counter()
            results = ranks(cpu, policy_publish, ep, hf_dir, http_port, free_port(), ep, backend)
            seconds = time.perf_counter() - began
        finally:
            receiver.kill()
            receiver.join()
        received = json.loads(out.read_text())
        state = {}
        for shard in sorted((Path(tmp) / "receiver.json.model").glob("*.safetensors")):
            state.update(load_file(shard))
    expected = {}
    for _, share in results:
        expected.update(share)
    differ = sorted(n for n, t in expected.items() if n not in state or not torch.equal(state[n], t))
    layers = [_layer_of(n) for n in received["loaded"]]
    figures = {"backend": backend, "policy_ranks": ep, "receiver_device": received["device"],
               "tensors_sent": results[0][0], "tensors_expected": len(expected), "version": received["version"],
               "tensors_differing": len(differ), "layer_by_layer": layers == sorted(layers),
               "seconds": seconds}  # fmt: skip
    if (
        differ
        or figures["tensors_sent"] != len(expected)
        or received["version"] != 7
        or layers != sorted(layers)
    ):
        raise AssertionError(
            f"the receiver did not get the policy's weights (first differing: {differ[:3]}): {figures}"
        )
    return figures


def _layer_of(name: str) -> int:
    if name.startswith("model.layers."):
        return int(name.split(".")[2])
    return -1 if name == "model.embed_tokens.weight" else 10**6


# ---------------------------------------------------------------------------------------------
# (c) the expert all-to-all at EP=2 equals a one-process MoE layer


def counted_all_to_all(rank, world_size, fn, *args):
    """`fn(rank, world_size, *args)`, and how many all_to_all_single calls it made (megatron's
    alltoall token dispatcher sends tokens to their experts' ranks and back with it)."""
    import torch.distributed as dist

    calls = 0
    original = dist.all_to_all_single

    def counting(*a, **k):
        nonlocal calls
        calls += 1
        return original(*a, **k)

    dist.all_to_all_single = counting
    try:
        return fn(rank, world_size, *args), calls
    finally:
        dist.all_to_all_single = original


def moe_logits(rank, world_size, arch, full, ep):
    """Full-vocabulary logits [batch, seq, vocab] of the MoE `arch` at expert parallel `ep`, eval
    mode: tests/support/ranks.py's `model_logits` (test_megatron_cpu.py's EP=2 test) with the
    tokens on this rank's device."""
    import torch

    from megatron_rl import compat, parallel
    from megatron_rl.models.builder import build_gpt_model
    from megatron_rl.models.sharding import load_full_state_dict
    from tests.support.ranks import gather_vocab
    from tests.support.tensors import tokens

    parallel.initialize_model_parallel(ep=ep)
    model = build_gpt_model(arch, ep=ep)
    load_full_state_dict(model, full)
    model.eval()
    device = compat.device()
    input_ids = tokens().to(device)
    positions = torch.arange(input_ids.shape[1], device=device).expand_as(input_ids)
    with torch.no_grad():
        return gather_vocab(model(input_ids, positions, attention_mask=None))


def all_to_all_reference(rank, world_size, moe):
    """One process: the MoE's reference weights and (its logits, all-to-all calls)."""
    from tests.support.ranks import reference_weights

    weights = _to_cpu(reference_weights(rank, world_size, moe, 11))
    return weights, counted_all_to_all(rank, world_size, moe_logits, moe, weights, 1)


def all_to_all_ep2(rank, world_size, moe, weights, swapped):
    """Two ranks at EP=2: (logits, all-to-all calls) of `weights`, then of `swapped`."""
    return [counted_all_to_all(rank, world_size, moe_logits, moe, full, 2) for full in (weights, swapped)]


def check_multi_expert_all_to_all(cpu: bool) -> dict:
    _, _, logit_atol = _tolerances(cpu)
    moe = _moe_arch()
    [(weights, (reference, _))] = ranks(cpu, all_to_all_reference, 1, moe)
    swapped = dict(weights)  # expert 3's weights on expert 0: routed tokens meet other weights
    for key in [k for k in weights if ".local_experts.0." in k]:
        swapped[key] = weights[key.replace(".local_experts.0.", ".local_experts.3.")]
    ep2 = ranks(cpu, all_to_all_ep2, 2, moe, weights, swapped)
    changed = ep2[0][1][0]
    ep2 = [plain for plain, _ in ep2]
    figures = {
        "max_abs_logit_diff_ep2": max(float((logits - reference).abs().max()) for logits, _ in ep2),
        "all_to_all_calls_ep2": [calls for _, calls in ep2],
        "swapped_experts_logit_change": float((changed - reference).abs().max()),
        "logit_atol": logit_atol,
    }
    if not figures["max_abs_logit_diff_ep2"] <= logit_atol:
        raise AssertionError(f"EP=2 logits differ from one process: {figures}")
    if not all(calls > 0 for calls in figures["all_to_all_calls_ep2"]):
        raise AssertionError(f"the EP=2 forward made no all-to-all: {figures}")
    if not figures["swapped_experts_logit_change"] > 100 * logit_atol:
        raise AssertionError(f"swapping two experts' weights hardly changed the logits (vacuous): {figures}")
    return figures
