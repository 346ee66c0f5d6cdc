"""Per-module line coverage of megatron_rl: extract it from coverage.py's JSON report, and compare
two runs module by module (what scripts/coverage.sh measures before and after a change).

    python scripts/coverage_compare.py --modules OUT/coverage.json > OUT/modules.json
    python scripts/coverage_compare.py BEFORE/modules.json AFTER/modules.json [--moved OLD[+OLD]=NEW[+NEW] ...]

A module is named by its path inside the package (`critic/service.py`). `--moved` names a module
that a change moved (`testing/sim.py=sim/cluster.py`), split (`policy/publish.py=
policy/publish/files.py+policy/publish/broadcast.py`) or redistributed among several
(`trainer/step.py+trainer/batches.py=trainer/step.py+trainer/batches.py+policy/loss.py`): the old
modules taken together are compared with the new ones taken together (statements and covered
lines summed). The comparison prints every module's
percentage before and after and exits 1 when any module present in both runs is covered less
afterwards (a module that left the package is listed, not failed).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def module_figures(report: dict) -> dict[str, dict]:
    """{module path inside megatron_rl: {"statements", "covered", "percent"}} of a coverage.py
    JSON report (`coverage json`)."""
    modules = {}
    for path, entry in report["files"].items():
        parts = Path(path).parts
        if "megatron_rl" not in parts:
            continue
        name = "/".join(parts[len(parts) - parts[::-1].index("megatron_rl") :])
        summary = entry["summary"]
        modules[name] = {
            "statements": summary["num_statements"],
            "covered": summary["covered_lines"],
            "percent": round(summary["percent_covered"], 2),
        }
    return dict(sorted(modules.items()))


def _summed(parts: list[dict]) -> dict:
    statements, covered = sum(p["statements"] for p in parts), sum(p["covered"] for p in parts)
    return {"statements": statements, "covered": covered,
            "percent": round(100.0 * covered / statements, 2) if statements else 100.0}  # fmt: skip


def compare(before: dict, after: dict, moved: list[tuple[list[str], list[str]]]) -> tuple[list[str], list[str]]:
    """(table lines, the modules covered less afterwards). Each move (OLD modules, NEW modules)
    compares the OLD taken together before with the NEW taken together after."""
    before, after = dict(before), dict(after)
    for olds, news in moved:
        key = "+".join(olds) + " -> " + "+".join(news)
        parts = [before.pop(o) for o in olds if o in before]
        if parts:
            before[key] = _summed(parts)
        parts = [after.pop(n) for n in news if n in after]
        if parts:
            after[key] = _summed(parts)
    renamed = before
    before = renamed
    lines = [f"{'module':48} {'before %':>9} {'after %':>9} {'change':>8}"]
    width = max([48, *map(len, set(before) | set(after))])
    lines[0] = f"{'module':{width}} {'before %':>9} {'after %':>9} {'change':>8}"
    drops = []
    for name in sorted(set(before) | set(after)):
        old, new = before.get(name), after.get(name)
        if old is None:
            lines.append(f"{name:{width}} {'(new)':>9} {new['percent']:9.2f}")
            continue
        if new is None:
            lines.append(f"{name:{width}} {old['percent']:9.2f} {'(gone)':>9}")
            continue
        change = new["percent"] - old["percent"]
        lines.append(f"{name:{width}} {old['percent']:9.2f} {new['percent']:9.2f} {change:+8.2f}")
        if change < 0:
            drops.append(name)
    return lines, drops


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modules", type=Path, help="a coverage.py JSON report: print its per-module figures")
    parser.add_argument("before", type=Path, nargs="?")
    parser.add_argument("after", type=Path, nargs="?")
    parser.add_argument("--moved", action="append", default=[], metavar="OLD=NEW")
    args = parser.parse_args(argv)
    if args.modules is not None:
        print(json.dumps(module_figures(json.loads(args.modules.read_text())), indent=1))
        return 0
    if args.before is None or args.after is None:
        parser.error("give --modules REPORT, or BEFORE and AFTER modules.json files")
    moved = []
    for item in args.moved:
        old, sep, new = item.partition("=")
        if not sep or not old or not new:
            parser.error(f"--moved {item!r}: expected OLD[+OLD...]=NEW[+NEW...] (module paths inside megatron_rl)")
        moved.append((old.split("+"), new.split("+")))
    lines, drops = compare(json.loads(args.before.read_text()), json.loads(args.after.read_text()), moved)
    print("\n".join(lines))
    if drops:
        print(f"covered less afterwards: {', '.join(drops)}", file=sys.stderr)
        return 1
    print("no module is covered less")
    return 0


if __name__ == "__main__":
    sys.exit(main())
