"""Every example config says in its header the one command that makes it runnable ("# Runnable
after:") and how to launch it ("# Run"), and passes `megatron-rl run --dry-run` (the 3-node SLURM
one: `megatron-rl slurm` renders its job) after it:

- tiny CPU examples: the command (building the tiny random model under runs/tiny_model) is run
  here as written, from the repository root; the dry run then plans every component;
- real-scale examples (Qwen3-30B-A3B, GLM-4.5-Air): the command converts the user's HF checkpoint
  (not run here: it is the user's 60 GB, 220 GB for GLM-4.5-Air); the test checks that it converts
  exactly the config's `inference.model_dir` into its `model.checkpoint` (and
  `value.model.checkpoint`), and dry-runs the config as the 8-GPU node would see it
  (CUDA_VISIBLE_DEVICES=0..7), or renders the multi-node ones' SLURM job.

Every launch script (`launch/*.sh`) passes `bash -n` and shellcheck; each example launcher
renders its config's job with `--dry-run --out`."""

from __future__ import annotations

import os
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


LAUNCHERS = sorted((ROOT / "launch").glob("*.sh"))
EXAMPLE_LAUNCHERS = [p for p in LAUNCHERS if p.name not in ("_submit.sh", "demo.sh")]


@pytest.mark.parametrize("script", LAUNCHERS, ids=lambda p: p.name)
def test_every_launch_script_passes_bash_n_and_shellcheck(script):
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True).returncode == 0
    # shellcheck is required, as by the rendered SLURM scripts' tests (tests/slurm/test_render.py)
    lint = subprocess.run(["shellcheck", str(script)], capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout


@pytest.mark.parametrize("script", EXAMPLE_LAUNCHERS, ids=lambda p: p.name)
def test_every_example_launcher_renders_its_examples_job(script, tmp_path):
    """`bash launch/X.sh --dry-run --out FILE` renders the SLURM job of the example it names (an
    existing one: the script's config path) without submitting it."""
    config = next(line for line in script.read_text().splitlines() if line.startswith("config="))
    name = config.split("/examples/configs/", 1)[1].rstrip('"')
    assert (ROOT / "examples" / "configs" / name).is_file(), name
    out = tmp_path / "job.sbatch"
    done = subprocess.run(["bash", str(script), "--dry-run", "--out", str(out)], capture_output=True, text=True,
                          env={**os.environ, "MEGATRON_RL_PYTHON": sys.executable}, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"CONFIG={ROOT / 'examples' / 'configs' / name}" in out.read_text()
