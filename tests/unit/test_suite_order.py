"""How tests/run.sh spreads the suite over two pytest-xdist workers (tests/conftest.py): the
units of work (a group, or a test alone) are queued longest first, by the seconds per file that
scripts/suite_profile.py writes from pytest's --durations output."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest

from tests.conftest import longest_first, unit_of

ROOT = Path(__file__).resolve().parents[2]
profile_main = runpy.run_path(str(ROOT / "scripts" / "suite_profile.py"), run_name="suite_profile")["main"]


class Item:
    """What the ordering reads of a pytest item: its node id and its xdist_group mark."""

    def __init__(self, nodeid: str, group: str | None = None):
        self.nodeid, self.group = nodeid, group

    def get_closest_marker(self, name):
        return pytest.mark.xdist_group(self.group).mark if name == "xdist_group" and self.group else None

    def __repr__(self):
        return self.nodeid


def test_longest_units_first_each_in_collection_order():
    items = [Item("a.py::t1"), Item("a.py::t2"), Item("b.py::t1", "pool"), Item("c.py::t1", "pool"),
             Item("d.py::t1"), Item("e.py::t1")]  # fmt: skip
    seconds = {"a.py": 10.0, "b.py": 30.0, "c.py": 20.0, "d.py": 40.0}  # e.py unmeasured: 1 s
    ordered = [item.nodeid for item in longest_first(items, seconds)]
    # pool (b + c: 50 s) before d (40), then a's tests (5 s each, in their order), e last
    assert ordered == ["b.py::t1", "c.py::t1", "d.py::t1", "a.py::t1", "a.py::t2", "e.py::t1"]
    assert unit_of(items[2]) == "pool" and unit_of(items[0]) == "a.py::t1"


def test_durations_are_written_per_file_from_the_logs(tmp_path, capsys):
    (tmp_path / "fast.log").write_text(
        "2.50s call     tests/unit/test_a.py::test_x\n0.50s setup    tests/unit/test_a.py::test_x\n"
        "1.00s call     tests/unit/test_a.py::test_y\n3 passed in 5.00s\n"
    )
    (tmp_path / "slow.log").write_text("60.00s call     tests/e2e/test_b.py::test_z[1]\n1 passed in 61.00s\n")
    out = tmp_path / "durations.json"
    assert profile_main([str(tmp_path / "fast.log"), str(tmp_path / "slow.log"), "--write-durations", str(out)]) == 0
    assert json.loads(out.read_text()) == {"tests/e2e/test_b.py": 60.0, "tests/unit/test_a.py": 4.0}
    assert "2 test files, 64 s" in capsys.readouterr().out
