"""Policy snapshots for the critic: the policy's weights in megatron's reshardable format.

The policy exports version v (its weights after v optimizer steps) as
    DIR/version_0000000v/dist/   megatron dist_checkpointing of the policy model
    DIR/version_0000000v/meta.json {"version", "architecture", "layout"}
written atomically (atomic_dir: a partial export is never visible). The critic waits for the
version it needs and loads the backbone with `trainer.weights.load_backbone`, which reshards
to the critic's own TP/EP (dist_checkpointing stores global shapes, so TP/CP/EP/GPU counts of the
two models may differ). The export is the plain model's state (transforms/base.PLAIN_MODEL): a
model transform's tensors are folded into the weights they change (a LoRA policy's merged weights,
W + (alpha / rank) B A, under the plain model's keys, without adapters), so the critic loads a
plain model's backbone.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import megatron_rl.compat  # noqa: F401  (megatron-core on CPU needs its patches first)

from megatron.core import dist_checkpointing

from megatron_rl.config import ValueConfig
from megatron_rl.trainer import atomic_dir
from megatron_rl.transforms.base import PLAIN_MODEL


def snapshot_versions(value: ValueConfig | None) -> list[int]:
    """The policy versions the critic will load (empty without a value section or value.snapshot)."""
    snapshot = value.snapshot if value is not None else None
    return sorted(snapshot.steps) if snapshot is not None else []


def _version_dir(root: Path, version: int) -> Path:
    return root / atomic_dir.name("version", version)


def export_snapshot(
    model, directory: str | Path, version: int, info: dict | None = None, keep_last: int = 2
) -> Path:
    """Collective over the model's ranks; returns the complete version directory."""

    final = _version_dir(Path(directory), version)

    def finish(partial: Path) -> None:
        (partial / "meta.json").write_text(json.dumps({"version": version, **(info or {})}, indent=2))

    with atomic_dir.collective_write(
        final.parent, final.name, keep_last, "snapshot.written", finish, subdirs=("dist",)
    ) as partial:
        dist_checkpointing.save(model.sharded_state_dict(metadata={PLAIN_MODEL: True}), str(partial / "dist"))
    return final


def wait_for_snapshot(directory: str | Path, version: int, timeout_s: float, poll_s: float = 0.5) -> Path:
    """The `dist/` directory of snapshot `version` once it is complete; TimeoutError naming the
    directory when it does not appear within `timeout_s`."""
    name = _version_dir(Path(directory), version).name
    deadline = time.monotonic() + timeout_s
    while (path := atomic_dir.resolve(Path(directory), name, "meta.json")) is None:
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"policy snapshot version {version} did not appear in {directory} within {timeout_s}s "
                "(value.snapshot.wait_timeout_s); is the policy trainer running with the same value.snapshot?"
            )
        time.sleep(poll_s)
    return path / "dist"
