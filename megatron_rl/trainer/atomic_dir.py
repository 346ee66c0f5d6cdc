"""Directories that become visible all at once (checkpoints, published weights).

A writer fills `NAME.partial`, then `commit` renames it to `NAME`, points the `latest` file at it
(written to a temporary file and replaced atomically) and prunes older versions. Readers go
through `latest` and never see a partial directory. Single-process functions: the caller decides
which rank runs them.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

LATEST = "latest"


def begin(root: Path, name: str) -> Path:
    """A fresh `root/NAME.partial` (a stale one from an interrupted write is removed)."""
    partial = root / f"{name}.partial"
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    return partial


def commit(root: Path, partial: Path, keep_last: int, pattern: str) -> Path:
    """Renames `partial` to its final name, points `latest` at it, keeps the newest `keep_last`
    complete directories matching `pattern`. Returns the final path."""
    final = partial.with_name(partial.name.removesuffix(".partial"))
    if final.exists():
        shutil.rmtree(final)
    os.rename(partial, final)
    pointer = root / f"{LATEST}.tmp"
    pointer.write_text(final.name)
    os.replace(pointer, root / LATEST)
    complete = sorted(p for p in root.glob(pattern) if p.is_dir() and not p.name.endswith(".partial"))
    for old in complete[:-keep_last]:
        if old != final:
            shutil.rmtree(old)
    return final


def latest(root: Path, required_file: str) -> Path | None:
    """The directory `latest` names, or None when there is no `latest`; an error when it names a
    directory without `required_file`."""
    pointer = Path(root) / LATEST
    if not pointer.is_file():
        return None
    path = Path(root) / pointer.read_text().strip()
    if not (path / required_file).is_file():
        raise FileNotFoundError(f"{pointer} names {path}, which is not complete (no {required_file})")
    return path
