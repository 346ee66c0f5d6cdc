"""The checks that need ranks of a process group, run in processes of their own on this host
(forked from a forkserver that imported megatron-core once; NCCL with CUDA, gloo on the CPU):

- collectives: for the policy's and the critic's layout, world-size ranks and megatron's groups of
  that layout (tp, cp, pp, ep, dp, expert dp, and the whole world); on each group all-reduce,
  all-to-all and broadcast with the data checked, and the all-reduce bus bandwidth in GB/s
  (the bytes each rank moves, 2(n-1)/n of the payload, over the time) beside the GPU's nominal
  NVLink figure (`NOMINAL_LINK_GBPS`); below `MIN_LINK_FRACTION` of it is a FAIL. On the
  gloo twin the figure is printed, not judged.
- layer_step: one forward/backward of the configured architecture trimmed to one layer, on the
  layer spec the builder picks here (TE where its torch extension imports), for each role.
- weight_update: policy rank 0's broadcast (`BroadcastPublisher`, the path of
  `inference.weight_update: nccl`) of the config's initial weights into one running vLLM server,
  keeping the version the server reports; the server must report it again afterwards.

Results come back as JSON files (no pickle across processes).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
import traceback
from pathlib import Path

from megatron_rl.config import ModelLayout
from megatron_rl.launch.preflight.base import CheckFailed, Context, NotRun

# One direction of NVLink per GPU, GB/s (NVLink 3: A100; 4: H100/H200; 5: B200), by device name.
NOMINAL_LINK_GBPS = {"A100": 300.0, "H100": 450.0, "H200": 450.0, "H20": 450.0, "B200": 900.0, "GB200": 900.0}
MIN_LINK_FRACTION = 0.2  # below this the group is not on the link it should be (PCIe, sockets)
PAYLOAD_BYTES = {"nccl": 256 << 20, "gloo": 4 << 20}
PRELOAD = [
    "megatron_rl.compat",
    "megatron.core.parallel_state",
    "megatron.core.models.gpt",
    "megatron_rl.parallel",
]


def spawn_ranks(target, world_size: int, args: tuple, limit_s: float) -> list[dict]:
    """`target(rank, world_size, *args) -> dict` on `world_size` fresh ranks of a group; the
    results in rank order. Raises CheckFailed naming the rank that failed or ran past `limit_s`."""
    import torch.multiprocessing as mp

    from megatron_rl.parallel import free_port

    mp.set_forkserver_preload(PRELOAD)
    context = mp.get_context("forkserver")
    port = free_port()
    with tempfile.TemporaryDirectory() as out:
        processes = [context.Process(target=_rank_main, args=(target, rank, world_size, port, out, args))
                     for rank in range(world_size)]  # fmt: skip
        for process in processes:
            process.start()
        deadline = time.monotonic() + limit_s
        for process in processes:
            process.join(max(deadline - time.monotonic(), 0))
        late = [rank for rank, p in enumerate(processes) if p.exitcode is None]
        for process in processes:
            if process.exitcode is None:
                process.kill()
                process.join()
        results = []
        for rank in range(world_size):
            path = Path(out) / f"rank{rank}.json"
            record = json.loads(path.read_text()) if path.exists() else None
            if record is not None and "error" in record:
                raise CheckFailed(f"rank {rank}: {record['error']}")
            if record is None:
                why = (
                    f"ran past {limit_s:g} s"
                    if rank in late
                    else f"exited {processes[rank].exitcode} without a result"
                )
                raise CheckFailed(f"rank {rank} of {world_size} {why}")
            results.append(record["result"])
    return results


def _rank_main(target, rank: int, world_size: int, port: int, out: str, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size))  # fmt: skip
    import megatron_rl.compat  # noqa: F401  (before megatron-core)

    from megatron_rl import parallel

    path = Path(out) / f"rank{rank}.json"
    try:
        parallel.initialize_distributed(timeout_s=120)
        record = {"result": target(rank, world_size, *args)}
        parallel.finished()
    except Exception as exc:  # noqa: BLE001  (the parent reports it as the check's FAIL)
        record = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
    finally:
        parallel.destroy()
    path.write_text(json.dumps(record))


def _roles(context: Context) -> list[tuple[str, ModelLayout]]:
    """Every torchrun group's layout: the policy's, the critic's, the Megatron teacher's."""
    layout = context.resolved.layout
    teacher = layout.services.get("teacher")
    return ([("policy", layout.policy)] + ([("critic", layout.critic)] if layout.critic is not None else [])
            + ([("teacher", teacher.megatron)] if teacher is not None and teacher.megatron is not None else []))  # fmt: skip


def _fits_here(context: Context, world_size: int, role: str) -> None:
    """NotRun when the role's ranks need more GPUs than one node has (CUDA: this host's count;
    the gloo twin: `deployment.gpus_per_node`, so that it reports what a GPU node would)."""
    if context.cuda:
        import torch

        here = torch.cuda.device_count()
    else:
        here = context.resolved.deployment.gpus_per_node
    if world_size > here:
        raise NotRun(f"the {role} needs {world_size} GPUs, a node has {here}: `megatron-rl preflight --slurm` "
                     f"runs its collectives across the role's nodes")  # fmt: skip


# ---------------------------------------------------------------------------------------------
# collectives


def _groups() -> dict[str, object]:
    from megatron.core import parallel_state as ps

    return {"world": None, "tp": ps.get_tensor_model_parallel_group(), "cp": ps.get_context_parallel_group(),
            "pp": ps.get_pipeline_model_parallel_group(), "dp": ps.get_data_parallel_group(),
            "ep": ps.get_expert_model_parallel_group(), "expert_dp": ps.get_expert_data_parallel_group()}  # fmt: skip


def collectives_rank(rank: int, world_size: int, layout: dict, payload_bytes: int) -> dict:
    """On every group of `layout`: all-reduce, all-to-all and broadcast checked against what the
    ranks sent, and the all-reduce's bus bandwidth; {group: figures} (every rank the same)."""
    import torch
    import torch.distributed as dist

    from megatron_rl import parallel

    parallel.initialize_model_parallel(tp=layout["tp"], cp=layout["cp"], pp=layout["pp"], ep=layout["ep"])
    device = parallel.collective_device()
    out = {}
    for name, group in _groups().items():
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world_size))
        n = len(ranks)
        me = ranks.index(rank)
        summed = torch.full((4,), float(rank + 1), device=device)
        dist.all_reduce(summed, group=group)
        if summed.tolist() != [float(sum(r + 1 for r in ranks))] * 4:
            raise CheckFailed(f"all-reduce on {name} {ranks} gave {summed.tolist()}")
        sent = torch.arange(n, dtype=torch.float32, device=device) + 1000 * rank
        received = torch.empty_like(sent)
        dist.all_to_all_single(received, sent, group=group)
        if received.tolist() != [float(me + 1000 * r) for r in ranks]:
            raise CheckFailed(f"all-to-all on {name} {ranks} gave {received.tolist()}")
        value = torch.full((4,), float(rank + 7), device=device)
        dist.broadcast(value, src=ranks[0], group=group)
        if value.tolist() != [float(ranks[0] + 7)] * 4:
            raise CheckFailed(f"broadcast on {name} {ranks} gave {value.tolist()}")
        out[name] = {"ranks": n, "members": ranks, "bus_gbps": _bus_gbps(group, n, payload_bytes, device)}
    return out


def _bus_gbps(group, n: int, payload_bytes: int, device) -> float | None:
    """All-reduce bus bandwidth in GB/s (None for one rank: nothing crosses a link)."""
    import torch
    import torch.distributed as dist

    if n == 1:
        return None
    tensor = torch.ones(payload_bytes // 4, dtype=torch.float32, device=device)
    dist.all_reduce(tensor, group=group)  # warm-up (NCCL builds its rings on the first call)
    iterations = 5
    _synchronize(device)
    began = time.perf_counter()
    for _ in range(iterations):
        dist.all_reduce(tensor, group=group)
    _synchronize(device)
    seconds = (time.perf_counter() - began) / iterations
    return payload_bytes * 2 * (n - 1) / n / seconds / 1e9


def _synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def nominal_link_gbps() -> tuple[str, float | None]:
    """(device name, its NVLink figure or None when the table does not know it)."""
    import torch

    name = torch.cuda.get_device_name(0)
    known = [key for key in NOMINAL_LINK_GBPS if key in name.split()]
    return name, NOMINAL_LINK_GBPS[known[0]] if known else None


def check_collectives(context: Context) -> str:
    _config_device_here(context)
    lines, problems, elsewhere = [], [], []
    device, nominal = nominal_link_gbps() if context.cuda else ("cpu", None)
    for role, layout in _roles(context):
        try:
            _fits_here(context, layout.world_size, role)
        except NotRun as exc:
            elsewhere.append(str(exc))
            continue
        [figures, *_] = spawn_ranks(collectives_rank, layout.world_size,
                                    (layout.model_dump(), PAYLOAD_BYTES[context.backend]), limit_s=120)  # fmt: skip
        line, found = describe_collectives(role, layout.world_size, figures, device, nominal)
        lines.append(line)
        problems += found
    if problems:
        raise CheckFailed("; ".join(problems))
    if not lines:
        raise NotRun("; ".join(elsewhere))
    return (f"all-reduce, all-to-all, broadcast on {context.backend}: " + "; ".join(lines)
            + _judged(context, device, nominal) + "".join(f"; NOT RUN here: {why}" for why in elsewhere))  # fmt: skip


def describe_collectives(role: str, world_size: int, figures: dict, device: str, nominal: float | None,
                         hosts: list[str] | None = None, network: float | None = None) -> tuple[str, list[str]]:  # fmt: skip
    """One role's `collectives_rank` figures as a line, and the groups below `MIN_LINK_FRACTION`
    of their link's figure: `nominal` (NVLink) for a group within one host, `network` (the
    inter-node network per GPU, GB/s; None: printed, not judged) for a group that crosses hosts
    (`hosts`: the host of each rank)."""
    cells, problems = [], []
    for name, f in figures.items():
        cell = f"{name} x{f['ranks']}"
        spans = len({hosts[r] for r in f["members"]}) if hosts else 1
        if spans > 1:
            cell += f" over {spans} nodes"
        if f["bus_gbps"] is None:
            cells.append(cell)
            continue
        cell += f" {f['bus_gbps']:.2f} GB/s"
        link, what = (nominal, f"{device}'s NVLink") if spans == 1 else (network, "the network's")
        if link is not None:
            ratio = f["bus_gbps"] / link
            cell += f" ({ratio:.0%} of {link:g})"
            if ratio < MIN_LINK_FRACTION:
                problems.append(f"{role} {name} group: {f['bus_gbps']:.1f} GB/s is below {MIN_LINK_FRACTION:.0%} "
                                f"of {what} {link:g} GB/s")  # fmt: skip
        cells.append(cell)
    return f"{role} ({world_size} rank{'s' if world_size > 1 else ''}): " + ", ".join(cells), problems


def _judged(context: Context, device: str, nominal: float | None) -> str:
    if not context.cuda:
        return " (gloo: bandwidth not judged)"
    if nominal is None:
        return f" ({device}: no nominal link figure in the table, not judged)"
    return ""


def _config_device_here(context: Context) -> None:
    if context.resolved.deployment.device == "cuda" and not context.cuda:
        raise CheckFailed("deployment.device is cuda but this host has no CUDA device for torch "
                          "(--cpu runs the gloo twins)")  # fmt: skip


# ---------------------------------------------------------------------------------------------
# one forward/backward of the layer spec


def layer_step_rank(rank: int, world_size: int, resolved_json: str, role: str) -> dict:
    """Forward and backward of the role's model as the trainer builds it (its layer spec, dtype,
    recomputation and model transforms: LoRA, routing replay), trimmed to one layer, on a packed
    row of random tokens: the spec used, the transforms, the loss, finite gradients on every
    parameter that trains. The Megatron teacher ("teacher": forward-only, its own dtype and spec):
    finite negative log-probabilities of the row's tokens, no backward."""
    import numpy as np
    import torch

    from megatron_rl import compat, parallel
    from megatron_rl.config import ResolvedConfig
    from megatron_rl.data.packing import pack_into_grid
    from megatron_rl.data.types import TrainingSample
    from megatron_rl.models.builder import build_gpt_model, transformer_engine_choice
    from megatron_rl.models.logprobs import megatron_vocab_parallel_logprobs
    from megatron_rl.models.value_model import build_value_model
    from megatron_rl.policy.loss import policy_batch
    from megatron_rl.trainer.forward import passes, run_batch
    from megatron_rl.transforms.plan import build_options, role_transforms

    resolved = ResolvedConfig.model_validate_json(resolved_json)
    critic, teacher = role == "critic", role == "teacher"
    if teacher:  # the teacher's own model settings (distillation.teacher.megatron)
        model_config = resolved.distillation.teacher.megatron.as_model_config(
            resolved.layout.services["teacher"].model_dir, resolved.model.seq_len)
        full = resolved.layout.services["teacher"].architecture
    else:
        model_config = resolved.value.model if critic else resolved.model
        full = resolved.layout.critic_architecture if critic else resolved.layout.policy_architecture
    arch = full.model_copy(update={"num_layers": 1})
    parallel.initialize_model_parallel()
    torch.manual_seed(0)
    transforms = [] if teacher else role_transforms(resolved, role)
    where = {"critic": "value.model", "teacher": "distillation.teacher.megatron"}.get(role, "model") + ".transformer_engine"
    options = dict(dtype=model_config.dtype, **model_config.recompute.transformer_fields(), **build_options(transforms),
                   transformer_engine=transformer_engine_choice(model_config.transformer_engine,
                                                                resolved.deployment.device, 1, where))  # fmt: skip
    model = build_value_model(arch, head_init_std=0.02, **options) if critic else build_gpt_model(arch, **options)
    for transform in transforms:
        transform.apply(model)
    hooks = [hook for hook in (t.pass_hook() for t in transforms) if hook is not None]
    tokens = 64
    rng = np.random.default_rng(0)
    sample = TrainingSample(token_ids=rng.integers(0, arch.vocab_size, tokens), loss_mask=np.ones(tokens, dtype=bool),
                            inference_logprobs=np.zeros(tokens), reward=0.0)  # fmt: skip
    batch = policy_batch(pack_into_grid([sample], tokens, 1)[0][0])
    began = time.perf_counter()
    if teacher:
        model.eval()
        with torch.no_grad():
            logprobs = megatron_vocab_parallel_logprobs(run_batch(model, batch)[0], batch.targets)[0]
        seconds = time.perf_counter() - began
        if not (logprobs.isfinite().all() and (logprobs <= 0).all()):
            raise CheckFailed(f"the teacher's log-probabilities are not finite and <= 0: {logprobs[:4].tolist()}")
        return {"spec": "te" if compat.MACHINE.transformer_engine else "local", "loss": -logprobs.mean().item(),
                "seconds": seconds, "parameters": sum(p.numel() for p in model.parameters()), "transforms": []}  # fmt: skip
    with passes(hooks, training=True):
        output = run_batch(model, batch, hooks)
        loss = (
            output.float().square().mean()
            if critic
            else megatron_vocab_parallel_logprobs(output[0], batch.targets)[0].sum()
        )
        loss.backward()
    seconds = time.perf_counter() - began
    bad = [
        n
        for n, p in model.named_parameters()
        if p.requires_grad and (p.grad is None or not p.grad.isfinite().all())
    ]
    if not math.isfinite(loss.item()) or bad:
        raise CheckFailed(f"loss {loss.item()}, gradients missing or not finite for {bad[:3]}")
    return {"spec": "te" if compat.MACHINE.transformer_engine else "local", "loss": loss.item(), "seconds": seconds,
            "parameters": sum(p.numel() for p in model.parameters()),
            "transforms": [t.name for t in transforms]}  # fmt: skip


def check_layer_step(context: Context) -> str:
    _config_device_here(context)
    resolved, cells = context.resolved, []
    roles = [("policy", resolved.layout.policy_architecture, resolved.model.dtype)]
    if resolved.value is not None and resolved.layout.critic_architecture is not None:
        roles.append(("critic", resolved.layout.critic_architecture, resolved.value.model.dtype))
    teacher = resolved.layout.services.get("teacher")
    if teacher is not None and not teacher.is_vllm:  # forward-only: its loss is the mean negative log-probability
        roles.append(("teacher", teacher.architecture, resolved.distillation.teacher.megatron.dtype))
    for role, arch, dtype in roles:
        [f] = spawn_ranks(layer_step_rank, 1, (resolved.to_json(), role), limit_s=120)
        transforms = f", with {' and '.join(f['transforms'])}" if f["transforms"] else ""
        cells.append(f"{role} 1 of {arch.num_layers} layers ({f['spec']} spec, {dtype}{transforms}, "
                     f"{f['parameters']:,} parameters): loss {f['loss']:.4g}, {f['seconds']:.2f} s")  # fmt: skip
    return "; ".join(cells)


# ---------------------------------------------------------------------------------------------
# a weight update into one vLLM server


def weight_update_rank(rank: int, world_size: int, url: str, architecture: dict, dtype: str,
                       checkpoint: str | None, path: str, host: str, port: int, backend: str,
                       publish_dir: str, side_files: str | None) -> dict:  # fmt: skip
    """Policy rank 0 alone pushes the config's initial weights (in the policy's `dtype`) into the
    server at `url` under the version it reports, on the run's path: `nccl`, a broadcast
    (`BroadcastPublisher`); `safetensors`, a version directory under `publish_dir`
    (`publish_hf_weights`) that the server loads (`load_published_version`). The tensors, bytes,
    seconds and the version."""
    import shutil

    from megatron_rl import parallel
    from megatron_rl.config import Architecture
    from megatron_rl.inference.vllm_control import VllmControl
    from megatron_rl.models.builder import build_gpt_model
    from megatron_rl.policy.publish import BroadcastPublisher, publish_hf_weights, verify_published
    from megatron_rl.trainer.weights import load_initial_weights

    parallel.initialize_model_parallel()
    arch = Architecture.model_validate(architecture)
    model = build_gpt_model(arch, dtype=dtype)
    loaded = load_initial_weights(model, checkpoint, arch)
    control = VllmControl(url, timeout_s=120)
    version = control.weights_version()
    began = time.perf_counter()
    if path == "nccl":
        publisher = BroadcastPublisher(arch, [control], host, port, backend=backend, timeout_s=120)
        publisher.connect()
        began = time.perf_counter()
        sent = publisher.publish(model, version=version)
        publisher.close()
    else:
        try:
            written = publish_hf_weights(model, arch, publish_dir, version,
                                         hf_side_files=Path(side_files) if side_files else None, keep_last=1)  # fmt: skip
            sent = verify_published(written)["num_tensors"]
            control.load_version(str(written), version)
        finally:
            shutil.rmtree(publish_dir, ignore_errors=True)
    seconds = time.perf_counter() - began
    after = control.weights_version()
    if after != version:
        raise CheckFailed(f"{url} reports version {after} after the update, expected {version}")
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"tensors": sent, "bytes": size, "seconds": seconds, "version": version, "loaded": loaded}


def preflight_publish_dir(publish_dir: str) -> str:
    """Where the safetensors weight update writes: beside the run's `inference.publish_dir` (on
    the storage the servers read), never in it (a resumed run takes its newest version)."""
    directory = Path(publish_dir).resolve()
    return str(directory.parent / f"{directory.name}.preflight")


def check_weight_update(context: Context) -> str:
    resolved = context.resolved
    if context.inference_url is None:
        raise NotRun("needs a running vLLM server of this config's model (--inference-url http://HOST:PORT)")
    if not resolved.model.checkpoint:
        raise NotRun("model.checkpoint is not set: there are no initial weights to push")
    inference = resolved.inference
    [f] = spawn_ranks(weight_update_rank, 1, (
        context.inference_url, resolved.layout.policy_architecture.model_dump(), resolved.model.dtype,
        resolved.model.checkpoint, inference.weight_update, resolved.layout.weight_broadcast_host,
        inference.weight_broadcast_port, context.backend, preflight_publish_dir(inference.publish_dir),
        resolved.model.hf_config,
    ), limit_s=240)  # fmt: skip
    how = (f"broadcast on {context.backend}" if inference.weight_update == "nccl"
           else "safetensors files, loaded by the server")  # fmt: skip
    return (f"{f['tensors']} tensors, {f['bytes'] / 2**20:.1f} MiB from policy rank 0 into {context.inference_url} "
            f"({how}) in {f['seconds']:.2f} s ({f['bytes'] / f['seconds'] / 1e9:.2f} GB/s), version "
            f"{f['version']} kept")  # fmt: skip
