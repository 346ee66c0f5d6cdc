"""tools/*.py as their command lines run them (`main(argv)`, its exit code, what it prints), in a
rank forked from the session's forkserver instead of a fresh interpreter each (a converter
process spends ~10 s importing torch and megatron-core on the 2-core machine)."""

from __future__ import annotations

import contextlib
import io
import runpy
import subprocess
from pathlib import Path

from tests.support.spawn import run_ranks

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def tools_rank(rank, world_size, calls):
    """Each (tool, argv) of `calls` in this process as its command line runs it (`main(argv)`,
    what `sys.exit` it would make): [(exit code, stdout, stderr)]."""
    results = []
    for name, argv in calls:
        main = runpy.run_path(str(TOOLS / name), run_name="tool")["main"]
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(argv)
            except SystemExit as exit_:  # argparse
                code = exit_.code
        results.append((code or 0, out.getvalue(), err.getvalue()))
    return results


def run_tools(*calls: tuple) -> list[subprocess.CompletedProcess]:
    """Each call (tool name, *args) in one rank, in order: what its process would have returned."""
    argvs = [(name, [str(a) for a in args]) for name, *args in calls]
    results = run_ranks(tools_rank, 1, argvs)[0]
    return [
        subprocess.CompletedProcess([name, *argv], *result) for (name, argv), result in zip(argvs, results)
    ]
