"""The one interface both publishing paths share, `WeightPublisher`, and `make_publisher`, which
builds the one `inference.weight_update` names from the resolved config and the policy's model
transforms (for a transform served alone, e.g. LoRA adapters, the adapter publishers of
adapters.py)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Protocol

import torch.distributed as dist

from megatron_rl.config import LoggingConfig, ResolvedConfig
from megatron_rl.inference.pool import PAUSE_MODES, adapter_name
from megatron_rl.inference.vllm_control import VllmControl
from megatron_rl.policy.publish.adapters import AdapterBroadcastPublisher, AdapterPublisher
from megatron_rl.policy.publish.broadcast import BroadcastPublisher
from megatron_rl.policy.publish.files import SafetensorsPublisher
from megatron_rl.transforms.base import ModelTransform, merged, served_alone

log = logging.getLogger("megatron_rl.policy")


class WeightPublisher(Protocol):
    """Collective over the policy's ranks: makes `model`'s weights policy version `version` on
    every inference server (or in the directory they load from)."""

    def publish(self, model, version: int) -> object: ...

    def close(self) -> None: ...


def versions_kept(max_async_level: int) -> int:
    """How many published versions path (a) keeps: the inference side may still be loading
    version v + 1 (v live) while the policy, which may train every batch shipped under the lead
    gate (batches up to v + L), publishes up to v + L + 1; so the newest L + 1 versions, and one
    more for the file poll's latency, stay on disk (at least 2)."""
    return max(2, max_async_level + 2)


def make_publisher(resolved: ResolvedConfig, transforms: list[ModelTransform] = ()) -> WeightPublisher:
    """Collective: the publisher `inference.weight_update` names. Path (b) forms its group with
    every inference server's workers here (policy rank 0), so a wrong address or port fails at
    startup. With model `transforms` (the policy trainer's), each version is their tensors alone
    in a transform's external format when one is served alone (`served_alone`: LoRA adapters,
    the layout's `policy_lora.serve`), else the weights with every transform merged; rank 0 says
    which at start-up."""

    inference, arch = resolved.inference, resolved.layout.policy_architecture
    if dist.get_rank() == 0:
        for line in filter(None, (t.serving_line() for t in transforms)):
            log.info("policy %s", line)
    alone, merge = served_alone(transforms), merged(transforms)
    keep = versions_kept(resolved.orchestrator.max_async_level)  # none deleted while a server may load it
    base_model = inference.model_dir or resolved.model.hf_config  # the HF model the servers serve
    if alone is not None and inference.weight_update == "safetensors":
        return AdapterPublisher(arch, inference.publish_dir, alone, base_model=base_model, keep_last=keep)
    if inference.weight_update == "safetensors":
        side_files = Path(resolved.model.hf_config) if resolved.model.hf_config else None
        return SafetensorsPublisher(arch, inference.publish_dir, side_files, keep_last=keep, merge=merge)
    if not resolved.layout.inference_urls:
        raise ValueError("inference.weight_update 'nccl': there are no inference servers to broadcast to")
    api_key = inference.api_key()
    controls = [VllmControl(url, api_key=api_key) for url in resolved.layout.inference_urls]
    options = {"workers_per_server": inference.tp, "bucket_bytes": inference.weight_bucket_mb << 20,
               "pause_mode": PAUSE_MODES[inference.update_mode]}  # fmt: skip
    if alone is not None:
        publisher = AdapterBroadcastPublisher(
            arch, controls, resolved.layout.weight_broadcast_host, inference.weight_broadcast_port, alone,
            adapter_name(inference.served_model_name), adapter_server_dir(resolved.logging), base_model=base_model,
            **options,
        )  # fmt: skip
    else:
        publisher = BroadcastPublisher(arch, controls, resolved.layout.weight_broadcast_host,
                                       inference.weight_broadcast_port, merge=merge, **options)  # fmt: skip
    if dist.get_rank() == 0:
        publisher.connect()
    return publisher


def adapter_server_dir(logging_config: LoggingConfig) -> str:
    """Where path (b)'s servers write the adapters they receive before loading them: under
    `logging.dir` (which every node of a run writes its logs to), `adapters/`."""
    return str(Path(logging_config.dir).resolve() / "adapters")
