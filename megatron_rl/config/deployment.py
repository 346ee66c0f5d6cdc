"""The deployment section: where each process group runs (the launcher and the layout read it)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

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
    host_memory_gib: float = Field(default=1800.0, gt=0, description="Host memory of one node in GiB that the training ranks may take (a DGX H200 has 2 TB, 1862 GiB; leave the OS and the page cache theirs); check-config's memory plan sums the offloaded optimizer state of a node's training ranks, pinned allocations rounded up to powers of two as torch's pinned allocator takes them, and refuses a layout over it (device cuda).")
    gpu_memory_gib: float = Field(default=140.4, gt=0, description="Memory of one GPU in GiB (2^30 bytes), as torch.cuda.mem_get_info reports its total (an H200, sold as 141 GB: 140.4); check-config's memory plan, in GiB, must fit in it (device cuda).")

    @model_validator(mode="before")
    @classmethod
    def _renamed_budget(cls, data: Any) -> Any:
        """The old `gpu_memory_gb` is refused, naming the new key: its number was compared with
        GiB totals (an H200's "141" is 140.4 GiB), so taking it as it is would overstate the budget."""
        if isinstance(data, dict) and "gpu_memory_gb" in data:
            raise ValueError(
                f"deployment.gpu_memory_gb (= {data['gpu_memory_gb']}) is now deployment.gpu_memory_gib, in GiB "
                "(2^30 bytes) like the memory plan: an H200 (sold as 141 GB) has 140.4 GiB; set gpu_memory_gib"
            )
        return data
