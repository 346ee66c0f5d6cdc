"""scripts/coverage_compare.py: per-module figures compared module by module; a module moved,
split or redistributed is compared taken together; a drop fails (exit 1), a gone module does not."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
compare_main = runpy.run_path(str(ROOT / "scripts" / "coverage_compare.py"), run_name="coverage_compare")["main"]


def figures(statements: int, covered: int) -> dict:
    return {"statements": statements, "covered": covered, "percent": round(100.0 * covered / statements, 2)}


def run(tmp_path, before, after, *moved, capsys) -> tuple[int, str, str]:
    (tmp_path / "b.json").write_text(json.dumps(before))
    (tmp_path / "a.json").write_text(json.dumps(after))
    argv = [str(tmp_path / "b.json"), str(tmp_path / "a.json")] + [f"--moved={m}" for m in moved]
    code = compare_main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_moves_and_splits_are_compared_taken_together(tmp_path, capsys):
    before = {"a.py": figures(10, 9), "old.py": figures(10, 8), "s.py": figures(10, 10), "t.py": figures(10, 6),
              "gone.py": figures(4, 4)}  # fmt: skip
    after = {"a.py": figures(10, 9), "n1.py": figures(4, 4), "n2.py": figures(6, 4),  # 8/10: equal
             "s.py": figures(6, 6), "t.py": figures(4, 4), "x.py": figures(10, 6)}  # 16/20 vs 16/20  # fmt: skip
    code, out, err = run(tmp_path, before, after, "old.py=n1.py+n2.py", "s.py+t.py=s.py+t.py+x.py", capsys=capsys)
    assert code == 0 and "no module is covered less" in out, out + err
    assert "old.py -> n1.py+n2.py" in out and "s.py+t.py -> s.py+t.py+x.py" in out and "(gone)" in out


def test_a_module_covered_less_fails_naming_it(tmp_path, capsys):
    before = {"a.py": figures(10, 9), "old.py": figures(10, 8)}
    after = {"a.py": figures(10, 8), "new.py": figures(10, 7)}
    code, out, err = run(tmp_path, before, after, "old.py=new.py", capsys=capsys)
    assert code == 1 and "a.py" in err and "old.py -> new.py" in err
