"""Adapter-only updates: a model transform's own tensors published alone in its external format
(transforms/base.ExternalFormat, `served_alone`; a LoRA policy whose `lora.serve` resolves to
`adapter`: PEFT's format, transforms/lora_transform.PeftAdapters), which the servers load with
`/v1/load_lora_adapter` in place of the previous version's (inference/pool.WeightSync), so an
update moves the adapter's bytes, not the model's.

Path (a) (`AdapterPublisher`): collective over the policy's ranks like the full-weight path:
only the format's parameters are gathered over TP (`gather_full_parameters(select=fmt.select)`),
each owner (ownership.writer_roles: one rank per pipeline stage, one per (stage, expert rank))
writes its layers' converted tensors into `adapter-<tag>.safetensors` of `version_N.partial`, and
rank 0 joins them into one directory in the format (`fmt.write`: for PEFT `adapter_model.safetensors`
and `adapter_config.json` with rank, alpha, HF target modules, the base model) and `manifest.json`, then
commits the version as the full-weight path does (atomic_dir). A version directory is then a
PEFT adapter that transformers + PEFT load too.

Path (b) (`AdapterBroadcastPublisher`): the full-weight broadcast (BroadcastPublisher: group,
pause, stream from the owners through rank 0, resume) with the owners' PEFT adapter tensors
instead of the model's; each server's workers take them with `receive_adapter`, the server's
first worker writes them as an adapter directory (with `fmt.config`) on its node (`server_dir/server<i>/version_N`),
and rank 0 has each server load it in place (`/v1/load_lora_adapter`) under `adapter_name`.
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import load_file, save_file

from megatron_rl.config import Architecture
from megatron_rl.models.sharding import gather_full_parameters
from megatron_rl.policy.publish.broadcast import BroadcastPublisher
from megatron_rl.policy.publish.files import sha256_of
from megatron_rl.policy.publish.ownership import writer_roles
from megatron_rl.trainer import atomic_dir
from megatron_rl.transforms.base import ExternalFormat


def owned_adapter_tensors(model, arch: Architecture, fmt: ExternalFormat) -> dict:
    """Collective over the model's TP groups: the adapter tensors this rank owns (`writer_roles`)
    under the format's names, empty on the other ranks. Only the adapters are gathered."""
    full = gather_full_parameters(model, select=fmt.select)
    writes_dense, writes_experts, _ = writer_roles()
    mine = {k: v for k, v in full.items()
            if (".experts." in k and writes_experts) or (".experts." not in k and writes_dense)}  # fmt: skip
    return fmt.convert(mine, arch)


def publish_adapter(model, arch: Architecture, directory: str | Path, step: int, fmt: ExternalFormat,
                    base_model: str | None = None, keep_last: int = 2) -> Path:  # fmt: skip
    """Writes version `step` of the adapters under `directory` as an adapter directory in `fmt`
    with a manifest; returns its path (on every rank)."""
    root = Path(directory)
    version = atomic_dir.name("version", step)

    def finish(partial: Path) -> None:  # rank 0: one adapter file, its config, the manifest
        parts = sorted(partial.glob("adapter-*.safetensors"))
        tensors = {}
        for part in parts:
            tensors.update(load_file(str(part)))
        fmt.write(partial, tensors, base_model)
        for part in parts:
            part.unlink()
        written = {f.name: sha256_of(f) for f in sorted(partial.glob("*.safetensors"))}  # the format's weights
        manifest = {"step": step, "files": written, "num_tensors": len(tensors),
                    "bytes": sum(t.numel() * t.element_size() for t in tensors.values()), "adapter": True}  # fmt: skip
        (partial / "manifest.json").write_text(json.dumps(manifest, indent=2))

    with atomic_dir.collective_write(root, version, keep_last, "publish.written", finish) as partial:
        tensors = owned_adapter_tensors(model, arch, fmt)
        _, _, tag = writer_roles()
        if tensors:
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(partial / f"adapter-{tag}.safetensors"),
                      metadata={"format": "pt"})  # fmt: skip
    return root / version


class AdapterPublisher:
    """Path (a) for a policy served as an adapter: `publish_adapter` in `fmt` into `directory`."""

    def __init__(self, arch: Architecture, directory: str | Path, fmt: ExternalFormat,
                 base_model: str | None = None, keep_last: int = 2):  # fmt: skip
        self.arch, self.directory, self.fmt = arch, Path(directory), fmt
        self.base_model, self.keep_last = base_model, keep_last

    def publish(self, model, version: int) -> Path:
        return publish_adapter(model, self.arch, self.directory, version, self.fmt, self.base_model,
                               self.keep_last)  # fmt: skip

    def close(self) -> None:
        pass


class AdapterBroadcastPublisher(BroadcastPublisher):
    """Path (b) for a policy served as an adapter in `fmt` (see the module docstring).
    `server_dir`: an absolute directory each server's node can write and its API server read."""

    def __init__(self, arch: Architecture, controls: list, host: str, port: int, fmt: ExternalFormat,
                 adapter_name: str, server_dir: str, base_model: str | None = None, **options):  # fmt: skip
        super().__init__(arch, controls, host, port, **options)
        self.fmt, self.adapter_name = fmt, adapter_name
        self.server_dir, self.base_model = Path(server_dir), base_model
        self.targets: list[str] = []

    def owned_tensors(self, model) -> dict:
        tensors = owned_adapter_tensors(model, self.arch, self.fmt)
        self.targets = self.fmt.targets(tensors) if tensors else self.targets
        return tensors

    def _version_dir(self, index: int, version: int) -> Path:
        return self.server_dir / f"server{index}" / atomic_dir.name("version", version)

    def receive(self, index: int, control, version: int):
        config = self.fmt.config(self.targets, self.base_model)
        return control.collective_rpc("receive_adapter", {
            "version": version, "directory": str(self._version_dir(index, version)), "adapter_config": config})  # fmt: skip

    def installed(self, version: int) -> None:
        threads, _, errors = self._on_every_server(
            lambda i, c: c.load_adapter_version(self.adapter_name, str(self._version_dir(i, version)), version)
        )
        self._join(threads, errors, self.timeout_s)
