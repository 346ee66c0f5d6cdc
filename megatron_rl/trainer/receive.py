"""The trainers' end of a model's ZMQ grid stream (shared by the policy and the critic)."""

from __future__ import annotations

import megatron_rl.compat  # noqa: F401  (megatron-core on CPU needs its patches first)

from megatron.core import parallel_state as ps

from megatron_rl.config import TransportConfig
from megatron_rl.transport import GridReceiver


def receiver_id_in_replica() -> int:
    """This rank's index among the ranks of its data-parallel replica (TP x CP x PP)."""

    tp, cp = ps.get_tensor_model_parallel_world_size(), ps.get_context_parallel_world_size()
    return ps.get_tensor_model_parallel_rank() + tp * (
        ps.get_context_parallel_rank() + cp * ps.get_pipeline_model_parallel_rank()
    )


def grid_receiver(
    transport: TransportConfig,
    port: int,
    wait_for_sender: bool = True,
    vocab_size: int | None = None,
    num_experts: int | None = None,
):
    """This rank's GridReceiver on a model's ZMQ stream on `transport.host` (its data rank, its
    index in the replica); without `wait_for_sender` the handshake completes at the first receive."""

    return GridReceiver(
        transport.host,
        port,
        data_rank=ps.get_data_parallel_rank(),
        receiver_id=receiver_id_in_replica(),
        timeout_s=transport.receive_timeout_s,
        handshake_timeout_s=transport.handshake_timeout_s if wait_for_sender else None,
        vocab_size=vocab_size,
        num_experts=num_experts,
    )
