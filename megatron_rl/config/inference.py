"""The inference section: the vLLM servers, the router in front of them and how new weights
reach them."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from megatron_rl.config.base import Strict, secret_from_env


class InferenceConfig(Strict):
    """The vLLM servers, the router in front of them and how new weights reach them."""

    backend: Literal["vllm", "vllm-cpu"] = Field(default="vllm", description="vLLM on GPUs, or vLLM's CPU build.")
    num_servers: int = Field(default=1, ge=1, description="vLLM servers (data-parallel replicas).")
    tp: int = Field(default=1, ge=1, description="Tensor-parallel degree of each server.")
    host: str = Field(default="127.0.0.1", description="Address the servers listen on.")
    server_hosts: list[str] | None = Field(default=None, description="One address per server when they run on several nodes (a SLURM job sets them); null: host.")
    base_port: int = Field(default=8000, gt=0, lt=65536, description="Port of server 0; server i listens on base_port + i.")
    weight_update: Literal["nccl", "safetensors"] = Field(default="nccl", description="How new weights reach the servers: broadcast from policy rank 0 (nccl, path (b)) or files in publish_dir (safetensors, path (a)).")
    update_mode: Literal["keep", "interrupt"] = Field(default="keep", description="What a weight update does to requests in flight: 'keep' holds them (vLLM's pause mode keep) and they finish under the new weights, re-prefilled, each completion stamped with the version it was sent under; 'interrupt' ends them (mode abort) and the rollout client resumes each with its tokens so far as the prompt (partial rollouts), so every token carries the version that sampled it.")
    weight_broadcast_port: int = Field(default=29600, gt=0, lt=65536, description="Port of the weight broadcast's process group (nccl).")
    weight_broadcast_host: str | None = Field(default=None, description="Address of policy rank 0 that inference workers connect to for path (b); null: 127.0.0.1 (a SLURM job sets policy node 0's address).")
    weight_bucket_mb: int = Field(default=256, gt=0, description="Size of one weight broadcast bucket, in MB.")
    publish_dir: str | None = Field(default=None, description="Where the policy publishes safetensors weights (path (a)); null: <checkpoint.dir>/published.")
    gpu_memory_utilization: float = Field(default=0.85, gt=0, le=1, description="vLLM's fraction of each GPU's memory.")
    extra_args: list[str] = Field(default_factory=list, description="Arguments appended to every vLLM server's command.")
    model_dir: str | None = Field(default=None, description="The HF directory (weights, config, tokenizer) the servers start from and the orchestrator takes the tokenizer from (relative to the config file); null: model.hf_config.")
    served_model_name: str = Field(default="policy", description="The model name the servers answer /v1/models with.")
    api_key_env: str | None = Field(default=None, description="The name of an environment variable holding an API key: passed to vLLM and the router as --api-key and sent by every client of ours.")

    def api_key(self) -> str | None:
        """The API key (from the variable `api_key_env` names), or None."""
        return secret_from_env(self.api_key_env, "inference.api_key_env")
    cpu_kv_cache_gib: int = Field(default=1, ge=1, description="KV cache of a vllm-cpu server, in GiB (VLLM_CPU_KVCACHE_SPACE).")
    router_port: int = Field(default=8050, gt=0, lt=65536, description="Port of the vllm-router in front of the servers (rollout traffic; admin traffic goes to each server).")
    router_policy: Literal["consistent_hash", "sticky_least_loaded"] = Field(default="consistent_hash", description="How the router assigns requests to servers.")
    router_health_failure_threshold: int = Field(default=3, ge=2, description="Failed health checks before the router takes a server out.")
    startup_timeout_s: float = Field(default=1800.0, gt=0, description="How long the servers may take to start, in seconds (first compiles on a GPU take many minutes).")
    shutdown_timeout_s: int = Field(default=1, ge=0, description="vLLM's --shutdown-timeout in seconds: on SIGTERM a server waits this long for requests in flight; 0 leaves the option out (for a vLLM from before 2026-03).")
    request_timeout_s: float = Field(default=3600.0, gt=0, description="Timeout of one rollout request, in seconds (router and client); longer than the longest rollout.")


class ServeConfig(Strict):
    """vLLM servers and a vllm-router that the run starts for a model beside the policy (a
    distillation teacher, an LLM judge), on GPUs of their own: `megatron-rl run` and the SLURM
    job start them as they start the policy's (inference.backend; deployment.device), the memory
    plan and check-config count their GPUs (num_servers x tp), preflight checks their ports."""

    num_servers: int = Field(default=1, ge=1, description="vLLM servers of this model (data-parallel replicas); its GPUs are num_servers x tp.")
    tp: int = Field(default=1, ge=1, description="Tensor-parallel degree of each server.")
    host: str = Field(default="127.0.0.1", description="Address the servers and the router listen on (a SLURM job sets the nodes' addresses).")
    server_hosts: list[str] | None = Field(default=None, description="One address per server when they run on several nodes (a SLURM job sets them); null: host.")
    base_port: int = Field(gt=0, lt=65536, description="Port of server 0; server i listens on base_port + i.")
    router_port: int = Field(gt=0, lt=65536, description="Port of the vllm-router in front of the servers: the run's requests go there.")
    gpu_memory_utilization: float = Field(default=0.85, gt=0, le=1, description="vLLM's fraction of each GPU's memory.")
    cpu_kv_cache_gib: int = Field(default=1, ge=1, description="KV cache of a vllm-cpu server, in GiB (VLLM_CPU_KVCACHE_SPACE).")
    max_model_len: int | None = Field(default=None, gt=0, description="vLLM's --max-model-len; null: the longest sequence the run sends (a teacher: model.seq_len + 1; a judge: the model's max_position_embeddings).")
    extra_args: list[str] = Field(default_factory=list, description="Arguments appended to every server's command.")
