"""The one interface both publishing paths share, `WeightPublisher`, and `make_publisher`, which
builds the one `inference.weight_update` names from the resolved config."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch.distributed as dist

from megatron_rl.config import ResolvedConfig
from megatron_rl.inference.vllm_control import VllmControl
from megatron_rl.policy.publish.broadcast import BroadcastPublisher
from megatron_rl.policy.publish.files import SafetensorsPublisher


class WeightPublisher(Protocol):
    """Collective over the policy's ranks: makes `model`'s weights policy version `version` on
    every inference server (or in the directory they load from)."""

    def publish(self, model, version: int) -> object: ...

    def close(self) -> None: ...


def make_publisher(resolved: ResolvedConfig) -> WeightPublisher:
    """Collective: the publisher `inference.weight_update` names. Path (b) forms its group with
    every inference server's workers here (policy rank 0), so a wrong address or port fails at
    startup. With `lora` both paths publish merged weights (`lora.alpha` reaches the merge)."""

    inference, arch = resolved.inference, resolved.layout.policy_architecture
    lora_alpha = resolved.lora.alpha if resolved.lora is not None else None
    if inference.weight_update == "safetensors":
        side_files = Path(resolved.model.hf_config) if resolved.model.hf_config else None
        return SafetensorsPublisher(arch, inference.publish_dir, side_files, lora_alpha=lora_alpha)
    if not resolved.layout.inference_urls:
        raise ValueError("inference.weight_update 'nccl': there are no inference servers to broadcast to")
    api_key = inference.api_key()
    publisher = BroadcastPublisher(
        arch,
        [VllmControl(url, api_key=api_key) for url in resolved.layout.inference_urls],
        resolved.layout.weight_broadcast_host,
        inference.weight_broadcast_port,
        workers_per_server=inference.tp,
        bucket_bytes=inference.weight_bucket_mb << 20,
        lora_alpha=lora_alpha,
    )
    if dist.get_rank() == 0:
        publisher.connect()
    return publisher
