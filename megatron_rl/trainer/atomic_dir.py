"""Directories that become visible all at once (checkpoints, published weights, snapshots).

A writer fills `NAME.partial`, then `commit` renames it to `NAME`, points the `latest` file at it
(written to a temporary file and replaced atomically) and prunes older versions. Readers go
through `latest` (or `resolve`) and never see a partial directory.

A step done again after a restart writes a `NAME` that may already exist: `commit` first moves
the old one to `NAME.replaced`, puts the new one in place, then deletes the old. A process killed
between those two renames leaves `NAME.replaced` and no `NAME`: readers take `NAME.replaced`
for `NAME` (it is complete), and the writer's next `begin` renames it back. So at every instant
each committed name is readable, and `latest` never names a missing version.

Pruning and replacing delete whole trees, which is not atomic: a directory is first renamed to
`NAME.stale` (one rename: the name is gone for readers at once), then deleted; a process killed
while deleting leaves a `.stale` directory, which no reader takes and the next `begin` removes.

Names: `step_%08d` for training checkpoints (a training step), `version_%08d` for policy
versions (published weights, snapshots: version v = the weights after step v - 1); `name()`
makes both.

`begin`, `commit` and friends are single-process functions (one writer per root);
`collective_write` wraps them for a directory that every rank of a model writes into.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch.distributed as dist

from megatron_rl.faults import kill_point

LATEST = "latest"
PARTIAL = ".partial"
REPLACED = ".replaced"
STALE = ".stale"


def name(kind: str, number: int) -> str:
    """`step_00000012` (kind "step") or `version_00000013` (kind "version")."""
    if kind not in ("step", "version"):
        raise ValueError(f"atomic directory kind {kind!r}: expected 'step' or 'version'")
    return f"{kind}_{number:08d}"


def number(directory_name: str) -> int:
    """The number in a `name()` (also of its `.partial` / `.replaced` forms)."""
    return int(directory_name.split(".")[0].rsplit("_", 1)[1])


@contextmanager
def collective_write(
    root: Path,
    final_name: str,
    keep_last: int,
    written: str,
    finish: Callable[[Path], None],
    subdirs: tuple[str, ...] = (),
) -> Iterator[Path]:
    """Collective over the default group: rank 0 begins `root/NAME.partial` (with `subdirs`);
    every rank writes
    its part inside the `with` block; after a barrier the kill point `written` fires, rank 0
    runs `finish(partial)` (index, manifest, meta: the file whose presence marks it complete)
    and commits it; a last barrier, so every rank returns after the commit."""
    partial = Path(root) / f"{final_name}{PARTIAL}"
    rank0 = dist.get_rank() == 0
    if rank0:
        begin(Path(root), final_name)
        for sub in subdirs:
            (partial / sub).mkdir()
    dist.barrier()
    yield partial
    dist.barrier()
    kill_point(written)
    if rank0:
        finish(partial)
        commit(Path(root), partial, keep_last, f"{final_name.rsplit('_', 1)[0]}_*")
    dist.barrier()


def remove(path: Path) -> None:
    """Deletes the directory `path` so that its name disappears at once: renamed to
    `NAME.stale` first (an interrupted deletion leaves only that), then removed."""
    doomed = path.with_name(path.name + STALE)
    if doomed.exists():
        shutil.rmtree(doomed)
    os.rename(path, doomed)
    shutil.rmtree(doomed)


def recover(root: Path) -> None:
    """Writer side: finishes or undoes an interrupted replacement (see the module docstring) and
    finishes interrupted deletions."""
    for doomed in Path(root).glob(f"*{STALE}"):
        shutil.rmtree(doomed)
    for old in Path(root).glob(f"*{REPLACED}"):
        final = old.with_name(old.name.removesuffix(REPLACED))
        if final.exists():
            remove(old)
        else:
            os.rename(old, final)


def begin(root: Path, name: str) -> Path:
    """A fresh `root/NAME.partial` (a stale one from an interrupted write is removed)."""
    root.mkdir(parents=True, exist_ok=True)
    recover(root)
    partial = root / f"{name}{PARTIAL}"
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    return partial


def commit(root: Path, partial: Path, keep_last: int, pattern: str) -> Path:
    """Renames `partial` to its final name (moving an existing one aside first), points `latest`
    at it, keeps the newest `keep_last` complete directories matching `pattern`. Returns the
    final path."""
    final = partial.with_name(partial.name.removesuffix(PARTIAL))
    old = final.with_name(final.name + REPLACED)
    if final.exists():
        if old.exists():
            remove(old)
        os.rename(final, old)
        kill_point("commit.replacing")
    os.rename(partial, final)
    pointer = root / f"{LATEST}.tmp"
    pointer.write_text(final.name)
    os.replace(pointer, root / LATEST)
    if old.exists():
        remove(old)
    complete = sorted(p for p in root.glob(pattern) if p.is_dir() and is_committed_name(p.name))
    for stale in complete[:-keep_last]:
        if stale != final:
            remove(stale)
    return final


def is_committed_name(name: str) -> bool:
    return not name.endswith((PARTIAL, REPLACED, STALE))


def resolve(root: Path, name: str, required_file: str) -> Path | None:
    """`root/NAME` when it is complete (has `required_file`), else its complete `NAME.replaced`
    (a replacement cut short), else None."""
    for path in (Path(root) / name, Path(root) / f"{name}{REPLACED}"):
        if (path / required_file).is_file():
            return path
    return None


def committed(root: Path, pattern: str, required_file: str) -> dict[str, Path]:
    """Every complete committed name matching `pattern` -> the directory to read it from."""
    names = {p.name.removesuffix(REPLACED) for p in Path(root).glob(pattern) if not p.name.endswith((PARTIAL, STALE))}
    found = {name: resolve(root, name, required_file) for name in names}
    return {name: path for name, path in sorted(found.items()) if path is not None}


def latest(root: Path, required_file: str) -> Path | None:
    """The directory `latest` names, or None when there is no `latest`; an error when it names a
    directory without `required_file`."""
    pointer = Path(root) / LATEST
    if not pointer.is_file():
        return None
    name = pointer.read_text().strip()
    path = resolve(root, name, required_file)
    if path is None:
        raise FileNotFoundError(
            f"{pointer} names {Path(root) / name}, which is not complete (no {required_file})"
        )
    return path
