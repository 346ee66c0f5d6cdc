"""`megatron-rl ARGS` in the test's own process: `megatron_rl.launch.cli.main` with stdout and
stderr captured, environment variables set for the call only, from a given directory. Its
result reads like `subprocess.run(..., capture_output=True, text=True)`'s. A subprocess starts a
fresh interpreter that imports torch (config resolution imports the algorithm registry) for
each call, about 3 s on the 2-core machine; `python -m megatron_rl.launch.cli` as a process is
what the end-to-end tests run (tests/e2e/test_launch_run.py, test_train_policy.py, test_demo.py)."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
from pathlib import Path
from unittest import mock

from megatron_rl.launch.cli import main

ROOT = Path(__file__).resolve().parents[2]


def run_cli(*args: str, env: dict[str, str] | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), mock.patch.dict(os.environ, env or {}), \
            contextlib.chdir(cwd):  # fmt: skip
        try:
            code = main(list(args))
        except SystemExit as exc:  # argparse's usage errors, sys.exit in a command
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if isinstance(exc.code, str):
                print(exc.code, file=err)
    return subprocess.CompletedProcess(["megatron-rl", *args], code, out.getvalue(), err.getvalue())
