"""Every example config says in its header the one command that makes it runnable ("# Runnable
after:") and how to launch it ("# Run"), and passes `megatron-rl run --dry-run` (the 3-node SLURM
one: `megatron-rl slurm` renders its job) after it:

- tiny CPU examples: the command (building the tiny random model under runs/tiny_model) is run
  here as written, from the repository root; the dry run then plans every component;
- Qwen3-30B-A3B examples: the command converts the user's HF checkpoint (not run here: it is the
  user's 60 GB); the test checks that it converts exactly the config's `inference.model_dir` into
  its `model.checkpoint` (and `value.model.checkpoint`), and dry-runs the config as the 8-GPU
  node would see it (CUDA_VISIBLE_DEVICES=0..7)."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.config import load_config
from tests.support.cli import run_cli

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples" / "configs").glob("*.yaml"))


def header(path: Path) -> dict[str, str]:
    """The example's "# Runnable after:" and "# Run...:" lines."""
    found = {}
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        if line.startswith("# Runnable after: "):
            found["after"] = line.removeprefix("# Runnable after: ").strip()
        elif line.startswith("# Run"):
            found["run"] = line.split(":", 1)[1].strip()
    return found


@pytest.fixture(scope="module")
def tiny_model_built():
    """Runs the tiny examples' command once, as their headers give it."""
    commands = {header(p)["after"] for p in EXAMPLES if p.name.startswith("tiny_cpu")}
    assert len(commands) == 1, commands  # every tiny example names the same model
    argv = shlex.split(commands.pop())
    assert argv[0] == ".venv/bin/python" and argv[1] == "tools/make_tiny_model.py"
    done = subprocess.run([sys.executable, *argv[1:]], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return ROOT / "runs" / "tiny_model"


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_every_example_says_what_makes_it_runnable_and_dry_runs_after_it(path, tmp_path, request):
    lines = header(path)
    assert "after" in lines and "run" in lines, f"{path.name}: header lacks '# Runnable after:' or '# Run'"
    assert path.name in lines["run"]
    resolved = load_config(path)
    if path.name.startswith("tiny_cpu"):
        model = request.getfixturevalue("tiny_model_built")
        assert Path(resolved.model.checkpoint) == model.resolve() == Path(resolved.inference.model_dir)
        if resolved.value is not None:
            assert Path(resolved.value.model.checkpoint) == model.resolve()
        # the inline architecture is the built model's: the weights load into it
        import json

        built = json.loads((model / "config.json").read_text())
        arch = resolved.model.architecture
        assert (arch.hidden_size, arch.intermediate_size, arch.head_dim, arch.vocab_size) == (
            built["hidden_size"], built["intermediate_size"], built["head_dim"], built["vocab_size"])  # fmt: skip
        done = run_cli("run", str(path), "--dry-run")
    else:
        commands = [shlex.split(c) for c in lines["after"].split("&&")]
        converted = {argv[argv.index("--out") + 1]: argv for argv in commands}
        assert all(argv[:2] == ["python", "tools/convert_hf_to_megatron.py"] for argv in commands)
        assert all(argv[argv.index("--hf") + 1] == resolved.inference.model_dir for argv in commands)
        assert "--value-model" not in converted[resolved.model.checkpoint]
        if resolved.value is not None:
            assert "--value-model" in converted[resolved.value.model.checkpoint]
        if "slurm" in lines["run"]:
            done = run_cli("slurm", str(path), "--out", str(tmp_path / "job.sbatch"))
            assert (tmp_path / "job.sbatch").is_file()
        else:
            visible = ",".join(str(i) for i in range(resolved.deployment.gpus_per_node))
            done = run_cli("run", str(path), "--dry-run", env={"CUDA_VISIBLE_DEVICES": visible})
    assert done.returncode == 0, f"{path.name}:\n{done.stdout[-1500:]}\n{done.stderr[-1500:]}"
