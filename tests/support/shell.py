"""Shell scripts the project writes or ships: `checked_script(path, text)` writes a script and
asserts that `bash -n` parses it and shellcheck (required, as the SLURM tests install it) finds
nothing; it returns the text."""

from __future__ import annotations

import subprocess
from pathlib import Path


def assert_clean_shell(script: Path) -> None:
    """`bash -n` parses `script` and shellcheck passes it (its findings in the failure)."""
    parsed = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert parsed.returncode == 0, parsed.stderr
    lint = subprocess.run(["shellcheck", str(script)], capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout


def checked_script(path: Path, text: str) -> str:
    """Writes `text` to `path`, checks it as assert_clean_shell does, and returns it."""
    path.write_text(text)
    assert_clean_shell(path)
    return text
