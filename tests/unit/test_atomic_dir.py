"""atomic_dir: a committed name stays readable at every instant, also while a redone step
replaces it, and a process killed in the middle of that leaves a state readers accept."""

from __future__ import annotations

import os
import subprocess
import sys

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
