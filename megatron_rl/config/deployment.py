"""The deployment section: where each process group runs (the launcher and the layout read it)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from megatron_rl.config.base import Strict


class DeploymentConfig(Strict):
    """Where each process group runs. On CPU a 'GPU' is one process."""

    device: Literal["cuda", "cpu"] = Field(default="cuda", description="GPUs, or CPU processes (one per 'GPU').")
    nodes: int = Field(default=1, ge=1, description="Machines of the run.")
    gpus_per_node: int = Field(default=8, ge=1, description="GPUs of each machine.")
    inference_gpus: int = Field(default=1, ge=0, description="GPUs of the inference servers (num_servers x tp).")
    policy_gpus: int = Field(ge=1, description="GPUs of the policy trainer.")
    num_value_nodes: int = Field(default=0, ge=0, description="Dedicated critic nodes.")
    num_value_gpus_per_train_node: int = Field(default=0, ge=0, description="Critic GPUs on each policy node (the critic shares policy nodes).")
    stop_grace_s: float = Field(default=60.0, gt=0, description="On a failure or Ctrl-C: SIGTERM, then SIGKILL after this many seconds (a checkpoint in progress finishes).")
    collective_timeout_s: float = Field(default=1800.0, gt=0, description="A collective not finished after this many seconds fails (the gloo/NCCL process-group timeout).")
    heartbeat_timeout_s: float = Field(default=60.0, gt=0, description="A rank whose heartbeat stops this many seconds is lost: the other ranks of its group exit naming it.")
    gpu_memory_gb: float = Field(default=141.0, gt=0, description="Memory of one GPU in GB (H200: 141); check-config's memory plan must fit in it (device cuda).")
