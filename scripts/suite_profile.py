"""The suite's profile from pytest's `--durations=0` output: seconds per test file (setup, call and
teardown summed; a session or module fixture's start is in the setup of the first test that uses
it), the slowest setups (what starts a server, a cluster or a forkserver) and the total.

    .venv/bin/python -m pytest -q --durations=0 -m "not slow" tests > fast.log
    .venv/bin/python -m pytest -q --durations=0 -m slow tests > slow.log
    python scripts/suite_profile.py fast.log slow.log [--top 30]      (Markdown tables)
    python scripts/suite_profile.py fast.log slow.log --write-durations tests/durations.json
    MEGATRON_RL_TEST_DURATIONS=0 bash tests/run.sh > suite.log 2>&1     (both groups, one log)
    python scripts/suite_profile.py suite.log --write-durations tests/durations.json

`--write-durations` writes the seconds per test file of all the logs given, which tests/conftest.py
reads to hand the longest work to pytest-xdist's workers first (tests/run.sh runs two).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

LINE = re.compile(r"^([0-9.]+)s (call|setup|teardown)\s+(\S+)")
SUMMARY = re.compile(r"(\d+) passed.* in ([0-9.]+)s")


def profile(text: str) -> tuple[dict[str, list[float]], list[tuple[float, str]], tuple[int, float] | None]:
    """({file: [seconds, tests]}, [(seconds, test) of each setup], (tests passed, wall seconds))."""
    files: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    setups = []
    for line in text.splitlines():
        match = LINE.match(line)
        if not match:
            continue
        seconds, phase, test = float(match.group(1)), match.group(2), match.group(3)
        path = test.split("::")[0]
        files[path][0] += seconds
        if phase == "call":
            files[path][1] += 1
        if phase == "setup":
            setups.append((seconds, test))
    summary = SUMMARY.search(text)
    return dict(files), sorted(setups, reverse=True), (int(summary[1]), float(summary[2])) if summary else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("logs", nargs="+", type=Path)
    parser.add_argument("--top", type=int, default=30, help="files listed per log")
    parser.add_argument("--write-durations", type=Path, metavar="JSON",
                        help="write {test file: seconds} of all the logs to JSON instead of the tables")  # fmt: skip
    args = parser.parse_args(argv)
    if args.write_durations:
        seconds = {}
        for log in args.logs:
            for path, (file_seconds, _) in profile(log.read_text())[0].items():
                seconds[path] = round(seconds.get(path, 0.0) + file_seconds, 1)
        args.write_durations.write_text(json.dumps(dict(sorted(seconds.items())), indent=1) + "\n")
        print(f"{args.write_durations}: {len(seconds)} test files, {sum(seconds.values()):.0f} s")
        return 0
    for log in args.logs:
        files, setups, summary = profile(log.read_text())
        total = sum(seconds for seconds, _ in files.values())
        head = f"{summary[0]} tests, {summary[1] / 60:.1f} min wall" if summary else "no pytest summary line"
        print(f"\n### {log.name}: {head}, {total:.0f} s in tests\n")
        print("| file | tests | s | share |\n|---|---:|---:|---:|")
        for path, (seconds, count) in sorted(files.items(), key=lambda item: -item[1][0])[: args.top]:
            print(f"| `{path}` | {count} | {seconds:.0f} | {seconds / total:.0%} |")
        print("\n| slowest setups (fixtures starting) | s |\n|---|---:|")
        for seconds, test in setups[:8]:
            print(f"| `{test}` | {seconds:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
