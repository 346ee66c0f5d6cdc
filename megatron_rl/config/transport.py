"""The transport section: the ZMQ channels from the orchestrator to the trainers."""

from __future__ import annotations

from pydantic import Field

from megatron_rl.config.base import Strict


class TransportConfig(Strict):
    """The ZMQ channels that carry training batches from the orchestrator to the trainers."""

    host: str = Field(default="127.0.0.1", description="Address of the orchestrator's senders.")
    policy_port: int = Field(default=5555, gt=0, lt=65536, description="Port of the batches sent to the policy.")
    critic_port: int = Field(default=5556, gt=0, lt=65536, description="Port of the batches sent to the critic.")
    receive_timeout_s: float = Field(default=600.0, gt=0, description="How long a receiver waits for a batch (and the orchestrator for critic values and weights), in seconds.")
    handshake_timeout_s: float = Field(default=120.0, gt=0, description="How long a trainer's receiver waits for the readiness handshake with the orchestrator, in seconds.")
