"""Rendered sbatch scripts for the shared, dedicated and no-critic layouts on 1, 2 and 4 nodes:
they pass `bash -n` and shellcheck, and the GPUs asked per node are disjoint per step and cover
what the config asks; preflight's script has an across-nodes collectives step for exactly the
roles placed on more than one node, on those nodes."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from megatron_rl.config import parse_config
from megatron_rl.launch.preflight import sbatch as preflight_sbatch
from megatron_rl.launch.slurm import SlurmError, gpu_use_per_node, place, render
from tests.support.shell import checked_script
from tests.support.slurm_cluster import install

ARCH = {"family": "qwen3", "hidden_size": 64, "num_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 512}  # fmt: skip
LAYOUTS = {  # (nodes, style): deployment
    (1, "shared"): {"inference_gpus": 4, "policy_gpus": 2, "num_value_gpus_per_train_node": 2},
    (1, "none"): {"inference_gpus": 6, "policy_gpus": 2},
    (2, "shared"): {"inference_gpus": 8, "policy_gpus": 6, "num_value_gpus_per_train_node": 2},
    (2, "dedicated"): {"inference_gpus": 4, "policy_gpus": 4, "num_value_nodes": 1},
    (2, "none"): {"inference_gpus": 8, "policy_gpus": 8},
    (4, "shared"): {"inference_gpus": 8, "policy_gpus": 18, "num_value_gpus_per_train_node": 2},
    (4, "dedicated"): {"inference_gpus": 8, "policy_gpus": 16, "num_value_nodes": 1},
    (4, "none"): {"inference_gpus": 16, "policy_gpus": 16},
}


def config_for(nodes: int, style: str, tmp_path: Path):
    deployment = {"nodes": nodes, "gpus_per_node": 8, **LAYOUTS[(nodes, style)]}
    data = {
        "model": {"architecture": ARCH, "seq_len": 256},
        "algorithm": {"type": "grpo" if style == "none" else "sao"},
        "orchestrator": {
            "batch_size": 4,
            "group_size": 2,
            "max_prompt_tokens": 64,
            "max_completion_tokens": 64,
        },
        "inference": {"num_servers": deployment["inference_gpus"] // 2, "tp": 2, "model_dir": "/models/hf"},
        "deployment": deployment,
        "logging": {"dir": str(tmp_path / "run")},
    }
    if style != "none":
        data["value"] = {"model": {"architecture": ARCH, "seq_len": 256}}
    return parse_config(data)


@pytest.fixture(scope="module", autouse=True)
def shellcheck_installed():
    install()


@pytest.mark.parametrize(("nodes", "style"), sorted(LAYOUTS))
def test_rendered_script_passes_bash_n_and_shellcheck_and_gpus_add_up(tmp_path, nodes, style):
    resolved = config_for(nodes, style, tmp_path)
    text = checked_script(tmp_path / "job.sbatch", render(resolved, tmp_path / "run.yaml"))
    assert f"#SBATCH --nodes={nodes}" in text and "set -euo pipefail" in text and "wait -n" in text
    assert (
        "--kill-on-bad-exit=1" in text and not re.search(r"^\s*pkill", text, re.M) and "localhost" not in text
    )
    placement = place(resolved)
    use = gpu_use_per_node(placement)
    assert all(sum(steps.values()) <= 8 for steps in use)  # disjoint: never more than the node has
    totals = {}
    for steps in use:
        for name, count in steps.items():
            totals[name.split("_")[0]] = totals.get(name.split("_")[0], 0) + count
    assert totals["inference"] == resolved.deployment.inference_gpus
    assert totals["policy"] == resolved.deployment.policy_gpus
    assert totals.get("critic", 0) == resolved.layout.value_gpus
    if style == "dedicated":
        assert placement["critic"].nodes == [nodes - 1] and nodes - 1 not in placement["policy"].nodes
    if style == "shared":
        assert placement["critic"].nodes == placement["policy"].nodes



@pytest.mark.parametrize(("nodes", "style"), sorted(LAYOUTS))
def test_preflight_script_passes_shellcheck_and_checks_spanning_roles_across_their_nodes(tmp_path, nodes, style):
    resolved = config_for(nodes, style, tmp_path)
    text = checked_script(tmp_path / "preflight.sbatch",
                          preflight_sbatch.render(resolved, tmp_path / "run.yaml", ["orchestrator.seed=3"]))
    placement = place(resolved)
    spanning = [role for role in ("policy", "critic") if role in placement and len(placement[role].nodes) > 1]
    steps = re.findall(r'^srun -w "([^"]*)" -N(\d+) -n\d+ --ntasks-per-node=1 \\\n\s+--gpus-per-node=(\d+)', text, re.M)
    roles = re.findall(r"across_nodes \"\$\{@:5\}\"'\s*\\\n\s*\"\$PY\" \d+ \d+ \S+ \"\$PORT\" (\w+)", text)
    assert roles == spanning
    for role, (nodelist, count, gpus) in zip(spanning, steps, strict=True):
        where = placement[role]
        assert nodelist == ",".join(f"${{NODES[{n}]}}" for n in where.nodes) and int(count) == len(where.nodes)
        assert int(gpus) == where.gpus_per_node
    assert 'SETS=(--set orchestrator.seed=3)' in text and "set -uo pipefail" in text
    if nodes == 4:
        assert "policy" in spanning  # the 4-node layouts all spread the policy



def test_preflight_script_passes_the_network_figure_to_each_across_nodes_step(tmp_path):
    resolved = config_for(4, "shared", tmp_path)  # policy and critic both on nodes 1-3
    text = preflight_sbatch.render(resolved, tmp_path / "run.yaml", [], network_gbytes_per_s=50)
    for role in ("policy", "critic"):
        assert re.search(rf'"\$PY" 3 \d "\$\{{ADDRS\[1\]\}}" "\$PORT" {role} "\$CONFIG" "\$\{{SETS\[@\]\}}" '
                         r"--network-gbytes-per-s 50 \\$", text, re.M), text  # fmt: skip


def test_a_layout_that_cannot_be_placed_says_why(tmp_path):
    data = {
        "model": {"architecture": ARCH, "seq_len": 256},
        "algorithm": {"type": "grpo"},
        "orchestrator": {
            "batch_size": 4,
            "group_size": 2,
            "max_prompt_tokens": 64,
            "max_completion_tokens": 64,
        },
        "inference": {"num_servers": 2, "tp": 2},
        "deployment": {"nodes": 2, "gpus_per_node": 8, "inference_gpus": 4, "policy_gpus": 6},
    }
    with pytest.raises(
        SlurmError,
        match=r"the policy would get \[4, 2\] GPUs on nodes \[0, 1\]; torchrun needs the same count",
    ):
        place(parse_config(data))


def test_training_steps_with_tensor_parallelism_export_cuda_device_max_connections_1(tmp_path):
    """The policy at TP=2 runs with CUDA_DEVICE_MAX_CONNECTIONS=1 (megatron's TP communication
    overlap relies on it; before: never set), the critic at TP=1 with the job's environment."""
    resolved = config_for(1, "shared", tmp_path)
    data = resolved.model_dump(exclude={"layout"}, exclude_none=True)
    data["model"]["tp"] = 2
    resolved = parse_config(data)
    script = tmp_path / "job.sbatch"
    script.write_text(render(resolved, tmp_path / "run.yaml"))
    lint = subprocess.run(["shellcheck", str(script)], capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout
    calls = {
        line.split()[1]: line for line in script.read_text().splitlines() if line.startswith("torchrun_step ")
    }
    assert calls["policy"].endswith(" train-policy ALL,CUDA_DEVICE_MAX_CONNECTIONS=1")
    assert calls["critic"].endswith(" critic ALL")
    assert '--export="$8"' in script.read_text()
