"""Reading experiment trackers back in tests, with the trackers' own readers: a W&B offline run's
transaction log (`run-<id>.wandb`, through `wandb leet inspect --json`) and TensorBoard's event
files (EventAccumulator); and the numbers of the metrics JSONL files under the keys the
Tracker (megatron_rl/orchestrator/tracking.py) logs them with. Each reader returns
{(key, step): value}."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from megatron_rl.orchestrator.tracking import flatten

PREFIXES = {"orchestrator": "orchestrator_metrics.jsonl", "policy": "policy_metrics.jsonl",
            "critic": "critic_metrics.jsonl"}  # fmt: skip


def jsonl_numbers(log_dir: Path, steps=None) -> dict[tuple[str, int], float]:
    """(key as the trackers log it, step) -> value, from the JSONL files in `log_dir` (the last
    line of a step wins)."""
    expected = {}
    for prefix, name in PREFIXES.items():
        path = Path(log_dir) / name
        if not path.is_file():
            continue
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if steps is None or record["step"] in steps:
                for key, value in flatten(record, f"{prefix}/").items():
                    expected[(key, record["step"])] = value
    return expected


def wandb_run_dirs(log_dir: Path) -> list[Path]:
    """The offline run directories under `log_dir/wandb`, oldest first."""
    return sorted((Path(log_dir) / "wandb").glob("offline-run-*"))


def wandb_records(run_dir: Path) -> list[dict]:
    """Every record of an offline run's transaction log (`run-<id>.wandb`), as wandb's own
    inspector prints them (`wandb leet inspect --json`: one JSON object a line, with `type`)."""
    (path,) = Path(run_dir).glob("run-*.wandb")
    done = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(path)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"wandb leet inspect {path} exited with {done.returncode}: {done.stderr[-2000:]}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]


def wandb_numbers(run_dir: Path) -> dict[tuple[str, int], float]:
    """The tracked metrics of the run's history rows at their `step` (raises on a key logged
    twice at one step)."""
    found = {}
    for record in wandb_records(run_dir):
        if record["type"] != "history":
            continue
        row = record["history"]["item"]
        for key, value in row.items():
            if key.split("/")[0] in PREFIXES:
                if (key, row["step"]) in found:
                    raise AssertionError(f"{key} logged twice at step {row['step']} in {run_dir}")
                found[(key, row["step"])] = value
    return found


def wandb_config(run_dir: Path) -> dict:
    """The run's config, as its run record sets it."""
    (run,) = [r["run"] for r in wandb_records(run_dir) if r["type"] == "run"]
    return run.get("config", {}).get("update", {})


def wandb_run_ids(run_dir: Path) -> set[str]:
    return {r["run"]["run_id"] for r in wandb_records(run_dir) if r["type"] == "run"}


def tensorboard_numbers(log_dir: Path) -> dict[tuple[str, int], float]:
    """Every scalar of the event files in `log_dir/tensorboard`."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(Path(log_dir) / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    return {(tag, e.step): e.value for tag in events.Tags()["scalars"] for e in events.Scalars(tag)}
