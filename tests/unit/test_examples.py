"""Every example config says in its header the one command that makes it runnable ("# Runnable
after:") and how to launch it ("# Run"), and passes `megatron-rl run --dry-run` (the 3-node SLURM
one: `megatron-rl slurm` renders its job) after it:

- tiny CPU examples: the command (building the tiny random model under runs/tiny_model) is run
  here as written, from the repository root; the dry run then plans every component;
- real-scale examples (Qwen3-30B-A3B, GLM-4.5-Air, Moonlight-16B-A3B): the command converts the
  user's HF checkpoint (not run here: it is the user's 60 GB, 220 GB for GLM-4.5-Air, 32 GB for
  Moonlight); the test checks that it converts
  exactly the config's `inference.model_dir` into its `model.checkpoint` (and
  `value.model.checkpoint`), and dry-runs the config as the 8-GPU node would see it
  (CUDA_VISIBLE_DEVICES=0..7), or renders the multi-node ones' SLURM job.

Every launch script (`launch/*.sh`) passes `bash -n` and shellcheck; each example launcher
renders its config's job with `--dry-run --out`. The Moonlight example's architecture is the
published config.json's and its memory plan the figures its header gives (GLM-4.5-Air's:
tests/unit/test_memory_plan.py)."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.config import Architecture, ConfigError, load_config
from megatron_rl.config.host_memory import GIB
from megatron_rl.config.layout import ModelLayout
from megatron_rl.config.memory_plan import (
    kv_bytes_per_token,
    memory_plan,
    node_host_memory,
    rank_parameters,
    weight_update_gib,
)
from tests.support.cli import run_cli
from tests.support.hf_configs import MOONLIGHT
from tests.support.shell import assert_clean_shell

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
    assert_clean_shell(script)  # shellcheck is required, as by the rendered SLURM scripts' tests


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


MOONLIGHT_EXAMPLE = ROOT / "examples" / "configs" / "moonlight_16b_a3b_sao_1node.yaml"


@pytest.fixture(scope="module")
def moonlight():
    return load_config(MOONLIGHT_EXAMPLE)


def test_moonlight_example_is_the_published_model(moonlight):
    """The example's inline architecture, the policy's and the critic's, is what the builder reads
    from Moonlight-16B-A3B's config.json (tests/support/hf_configs.py): 15.96B parameters."""
    arch = moonlight.layout.policy_architecture
    assert arch == Architecture.from_hf_config(MOONLIGHT, "Moonlight-16B-A3B")
    assert moonlight.value.model.architecture == arch
    single = ModelLayout(world_size=1, tp=1, cp=1, pp=1, ep=1, dp=1, expert_dp=1)
    assert rank_parameters(arch, single).total == pytest.approx(15.96e9, rel=1e-3)


def test_moonlight_example_fits_on_one_h200_node_and_adam_on_its_gpus_is_refused(moonlight):
    """The layout its header explains, as check-config plans it: 4 vLLM servers at TP=1, the policy
    and the critic at EP=2 on 2 GPUs each, their Adam state on the host; every figure the header
    quotes is the plan's. Adam on the policy's or the critic's GPUs is refused, naming the model."""
    layout = moonlight.layout
    assert layout.deployment_style == "shared" and moonlight.deployment.nodes == 1
    assert (layout.policy.ep, layout.policy.dp, layout.policy.expert_dp) == (2, 2, 1)
    assert (layout.critic.world_size, layout.critic.ep) == (2, 2)
    assert (moonlight.inference.num_servers, moonlight.inference.tp) == (4, 1)
    gpus = memory_plan(moonlight)
    plan = {gpu.role: gpu for gpu in gpus}
    peaks = {role: {peak.name: round(peak.total, 2) for peak in gpu.all_peaks()} for role, gpu in plan.items()}
    assert peaks == {"policy": {"steady": 88.29, "start-up": 68.37, "resume": 54.97},
                     "critic": {"steady": 78.66, "start-up": 64.11, "resume": 50.71},
                     "inference": {"steady": 119.34, "start-up": 119.34, "weight update": 121.43}}  # fmt: skip
    hosts = {name: round(gib) for name, gib, _ in node_host_memory(moonlight, gpus)}
    assert hosts == {"policy node": 530}
    # vLLM caches MLA's kv latent and shared rotary key, whole on every TP rank: 30.4 KiB a token
    arch = layout.policy_architecture
    assert kv_bytes_per_token(arch, 1) == kv_bytes_per_token(arch, 2) == 27 * (512 + 64) * 2 == 31104
    tokens = plan["inference"].parts["kv_cache"] * GIB / 31104
    share = moonlight.orchestrator.batch_size // moonlight.inference.num_servers * moonlight.model.seq_len
    assert (round(tokens / 1e6, 1), int(tokens // share)) == (3.0, 22)
    update = weight_update_gib(moonlight)[0]
    header = "".join(line for line in MOONLIGHT_EXAMPLE.read_text().splitlines() if line.startswith("#"))
    quoted = [peaks["policy"]["steady"], peaks["critic"]["steady"], peaks["inference"]["weight update"],
              plan["inference"].parts["kv_cache"], update, plan["policy"].host_gib]  # fmt: skip
    for figure in quoted:
        assert f"{figure:.1f}" in header, figure
    assert "30.4 KiB a token" in header and "530 of its 1800" in header
    with pytest.raises(ConfigError, match=r"- model: the policy needs about 177.5 GiB per GPU .* more than "
                                          r"deployment.gpu_memory_gib = 140.4; options: optimizer.cpu_offload: true"):  # fmt: skip
        load_config(MOONLIGHT_EXAMPLE, ["optimizer.cpu_offload=false"])
    with pytest.raises(ConfigError, match=r"- value.model: the critic needs about 163.9 GiB per GPU"):
        load_config(MOONLIGHT_EXAMPLE, ["value.optimizer.cpu_offload=false"])
    assert "177.5" in header and "163.9" in header
