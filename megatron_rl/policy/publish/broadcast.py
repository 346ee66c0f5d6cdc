"""Path (b), `inference.weight_update: nccl` (`BroadcastPublisher`): a broadcast from policy
rank 0 to every inference worker in a WeightUpdateGroup (NCCL on GPU, gloo on CPU), streamed one
decoder layer at a time (`stream_parts`)."""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
import torch.distributed as dist

from megatron_rl import compat
from megatron_rl.config import Architecture
from megatron_rl.conversion.hf_mapping import EMBEDDING_RENAMES, decoder_layer_of
from megatron_rl.policy.publish.ownership import owned_hf_tensors
from megatron_rl.transport import weight_buckets as wb
from megatron_rl.transport.weight_buckets import WeightUpdateGroup


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
    A transformed policy's weights are sent merged with `merge` (its transforms', `owned_hf_tensors`).
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
        merge: Callable[[dict], dict] | None = None,
        pause_mode: str = "keep",
    ):
        self.arch = arch
        self.merge = merge
        self.pause_mode = pause_mode  # vLLM's: "keep" (inference.update_mode keep) or "abort" (interrupt)
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

    def owned_tensors(self, model) -> dict[str, torch.Tensor]:
        """Collective: the HF-named tensors this rank sends (the whole model's, its transforms merged)."""
        return owned_hf_tensors(model, self.arch, self.merge)

    def receive(self, index: int, control, version: int):
        """What server `index` runs to take one update (its workers' side of the stream)."""
        return control.collective_rpc("receive_weights", {"version": version})

    def installed(self, version: int) -> None:
        """After every server received the stream (rank 0, servers still paused): nothing more
        for full weights (the workers loaded them and recorded the version)."""

    def publish(self, model, version: int) -> int:
        """Collective over the policy's ranks; returns the number of tensors sent (rank 0)."""

        parts = stream_parts(self.owned_tensors(model), self.arch.num_layers)
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
                control.pause(mode=self.pause_mode, clear_cache=True)
            try:
                threads, _, errors = self._on_every_server(lambda i, c: self.receive(i, c, version))
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
                self.installed(version)
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
