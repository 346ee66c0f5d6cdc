"""atomic_dir: a committed name stays readable at every instant, also while a redone step
replaces it, and a process killed in the middle of that leaves a state readers accept."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.trainer import atomic_dir


def write_version(root, name, content):
    partial = atomic_dir.begin(root, name)
    (partial / "data.txt").write_text(content)
    (partial / "manifest.json").write_text("{}")
    return atomic_dir.commit(root, partial, keep_last=2, pattern="v*")


def test_commit_replaces_a_redone_version_and_prunes(tmp_path):
    write_version(tmp_path, "v1", "one")
    write_version(tmp_path, "v2", "two")
    write_version(tmp_path, "v2", "two again")  # the step done again after a restart
    assert (tmp_path / "v2" / "data.txt").read_text() == "two again"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "v1", "v2"]
    write_version(tmp_path, "v3", "three")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "v2", "v3"]
    assert atomic_dir.latest(tmp_path, "manifest.json") == tmp_path / "v3"


def test_a_replacement_cut_short_stays_readable_and_the_writer_recovers(tmp_path):
    write_version(tmp_path, "v1", "one")
    write_version(tmp_path, "v2", "two")
    # What a kill between the two renames of a redone v2 leaves: the old v2 moved aside, the new
    # one still partial, `latest` naming v2.
    os.rename(tmp_path / "v2", tmp_path / "v2.replaced")
    (tmp_path / "v2.partial").mkdir()
    assert atomic_dir.latest(tmp_path, "manifest.json") == tmp_path / "v2.replaced"
    assert set(atomic_dir.committed(tmp_path, "v*", "manifest.json")) == {"v1", "v2"}
    assert atomic_dir.resolve(tmp_path, "v2", "manifest.json") == tmp_path / "v2.replaced"
    atomic_dir.begin(tmp_path, "v3")  # the writer's next write puts the old v2 back
    assert (tmp_path / "v2" / "data.txt").read_text() == "two"
    assert not (tmp_path / "v2.replaced").exists()


def test_killed_at_the_replacement_kill_point(tmp_path):
    write_version(tmp_path, "v1", "one")
    code = (
        "import sys; from pathlib import Path; from megatron_rl import faults; "
        "from tests.unit.test_atomic_dir import write_version; "
        "faults.set_step(5); write_version(Path(sys.argv[1]), 'v1', 'one again')"
    )
    env = {**os.environ, "MEGATRON_RL_KILL_AT": "commit.replacing@5"}
    result = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=env)
    assert result.returncode == -9
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "v1.partial", "v1.replaced"]
    assert (atomic_dir.latest(tmp_path, "manifest.json") / "data.txt").read_text() == "one"


def test_kill_points_are_checked():
    from megatron_rl import faults

    with pytest.raises(ValueError, match="MEGATRON_RL_KILL_AT='nowhere@1': expected POINT@STEP"):
        faults._parse("nowhere@1")
    assert faults._parse("checkpoint.written@3") == ("checkpoint.written", 3)


def test_a_prune_cut_short_leaves_no_committed_name_half_deleted(tmp_path, monkeypatch):
    """A process killed while deleting an old version (pruning at keep_last, or the old copy of a
    redone one) must not leave a committed name with some of its files gone: the name is
    renamed away before the tree is deleted (found by the kill/restart test: a committed
    version_00000001 without its manifest)."""
    write_version(tmp_path, "v1", "one")
    write_version(tmp_path, "v2", "two")
    real_rmtree = atomic_dir.shutil.rmtree

    def killed_midway(path, *args, **kwargs):  # deletes the manifest, then the process "dies"
        (Path(path) / "manifest.json").unlink()
        raise SystemExit("killed while deleting")

    monkeypatch.setattr(atomic_dir.shutil, "rmtree", killed_midway)
    partial = atomic_dir.begin(tmp_path, "v3")
    (partial / "data.txt").write_text("three")
    (partial / "manifest.json").write_text("{}")
    with pytest.raises(SystemExit):
        atomic_dir.commit(tmp_path, partial, keep_last=2, pattern="v*")  # prunes v1
    monkeypatch.setattr(atomic_dir.shutil, "rmtree", real_rmtree)
    for path in tmp_path.iterdir():
        if path.is_dir() and atomic_dir.is_committed_name(path.name):
            assert (path / "manifest.json").is_file(), path
    assert sorted(atomic_dir.committed(tmp_path, "v*", "manifest.json")) == ["v2", "v3"]
    assert atomic_dir.latest(tmp_path, "manifest.json") == tmp_path / "v3"
    atomic_dir.begin(tmp_path, "v4")  # the next writer finishes the deletion
    assert not list(tmp_path.glob(f"*{atomic_dir.STALE}"))
