"""Publishing the policy's weights for inference, behind one interface: a `WeightPublisher`
(`publish(model, version)`, `close()`) built from the resolved config by `make_publisher`, which
checks the setting when it is built (path (b) joins every inference worker then), not mid-run.

    publisher.py   the WeightPublisher protocol and make_publisher
    ownership.py   which rank publishes which HF tensors (owned_hf_tensors), for both paths
    files.py       path (a), `inference.weight_update: safetensors` (SafetensorsPublisher):
                   HF safetensors + manifest in a version directory that vLLM loads with
                   `collective_rpc reload_weights` (publish_hf_weights, verify_published,
                   latest_published)
    broadcast.py   path (b), `inference.weight_update: nccl` (BroadcastPublisher): a broadcast
                   from policy rank 0 to every inference worker in a WeightUpdateGroup (NCCL on
                   GPU, gloo on CPU), one decoder layer at a time (stream_parts)
    adapters.py    a LoRA policy's adapter-only versions (`lora.serve: adapter`), on either
                   path: the adapters alone in PEFT's format, loaded in place with
                   /v1/load_lora_adapter (AdapterPublisher, AdapterBroadcastPublisher,
                   publish_adapter, owned_adapter_tensors)
"""

from megatron_rl.policy.publish.broadcast import BroadcastPublisher, stream_parts
from megatron_rl.policy.publish.files import (
    SafetensorsPublisher,
    latest_published,
    publish_hf_weights,
    verify_published,
)
from megatron_rl.policy.publish.ownership import owned_hf_tensors
from megatron_rl.policy.publish.publisher import WeightPublisher, make_publisher

__all__ = [
    "BroadcastPublisher", "SafetensorsPublisher", "WeightPublisher", "latest_published", "make_publisher",
    "owned_hf_tensors", "publish_hf_weights", "stream_parts", "verify_published",
]  # fmt: skip
