"""Experiment tracking (megatron_rl/orchestrator/tracking.py) without the stack: a Tracker fed
orchestrator records through the MetricsWriter while fake policy and critic JSONL lines are
written step by step, W&B offline (no network) and TensorBoard on. Read back with the trackers'
own readers (W&B's transaction log `run-<id>.wandb` through `wandb leet inspect --json`;
TensorBoard's EventAccumulator), both hold the same numbers as the JSONL files, at the same steps."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_rl.config import LoggingConfig, WandbConfig
from megatron_rl.orchestrator import tracking
from megatron_rl.orchestrator.metrics import MetricsWriter
from megatron_rl.orchestrator.tracking import Tracker, TrackingError, flatten
from tests.support.tracking import (
    jsonl_numbers,
    tensorboard_numbers,
    wandb_config,
    wandb_numbers,
    wandb_run_dirs,
    wandb_run_ids,
)


@pytest.fixture(autouse=True)
def wandb_offline(tmp_path, monkeypatch):
    """No network, nothing written outside tmp_path."""
    home = tmp_path / "wandb-home"
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(home / name.lower()))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_RUN_ID", raising=False)


def wandb_cfg(**kw) -> WandbConfig:
    return WandbConfig(project="megatron-rl-tests", mode="offline", name="tiny", tags=["unit"], **kw)


def orchestrator_record(step: int) -> dict:
    return {
        "step": step,
        "reward_mean": 0.25 * step + 0.125,
        "reward_std": None,  # nulls are skipped
        "group_ids": [3 * step, 3 * step + 1],  # lists are skipped
        "groups_rejected": {"identical_rewards": step},  # nested dicts become a/b
        "batch_partial": step == 1,  # booleans 0/1
        "value_mean": -0.5 + step,
        "time": {"total": 1.5 + step, "generate": 0.75},
    }


def critic_line(step: int) -> dict:
    return {"phase": "rl", "step": step, "loss": 2.0 / (step + 1), "final_loss": 1.0 / (step + 1),
            "epoch_losses": [2.0, 1.0], "grad_norm": None, "head_only": False, "lr": 1e-3}  # fmt: skip


def policy_line(step: int) -> dict:
    return {"step": step, "policy_version": step + 1, "loss": 0.1 * step - 0.05, "mismatch_kl": 1e-4 * (step + 1),
            "time": {"publish": 0.01}, "update_skipped": False}  # fmt: skip


def append(path: Path, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def run_steps(log_dir: Path, tracker: Tracker, steps) -> None:
    """The order of a real run: the critic trains step n before the orchestrator records it; the
    policy's line for step n lands after (read at the next record, or at close)."""
    writer = MetricsWriter(log_dir, console=False, num_steps=max(steps) + 1, tracker=tracker)
    for step in steps:
        append(log_dir / "critic_metrics.jsonl", critic_line(step))
        writer(orchestrator_record(step))
        append(log_dir / "policy_metrics.jsonl", policy_line(step))
    tracker.close(final_step=max(steps), timeout_s=5)


def assert_same(found: dict, expected: dict) -> None:
    assert set(found) == set(expected)
    for key, value in expected.items():
        assert found[key] == pytest.approx(value, rel=1e-6, abs=1e-7), key


RUN_CONFIG = {
    "orchestrator": {"num_steps": 3, "batch_size": 3},
    "logging": {"dir": "logs", "tensorboard": True},
}


def test_offline_wandb_and_tensorboard_hold_every_steps_numbers_of_the_jsonl(tmp_path):
    log_dir = tmp_path / "logs"
    tracker = Tracker(log_dir, wandb=wandb_cfg(), tensorboard=True, run_config=RUN_CONFIG)
    assert [b.key for b in tracker.backends] == ["logging.wandb", "logging.tensorboard"]
    run_steps(log_dir, tracker, range(3))

    expected = jsonl_numbers(log_dir)
    for step in range(3):  # the numbers the issue names, at every step, under the JSONL keys
        assert ("orchestrator/reward_mean", step) in expected and ("critic/loss", step) in expected
        assert ("policy/loss", step) in expected and ("orchestrator/time/total", step) in expected
    assert ("orchestrator/group_ids", 0) not in expected and ("orchestrator/reward_std", 0) not in expected
    assert expected[("orchestrator/batch_partial", 1)] == 1.0
    (run_dir,) = wandb_run_dirs(log_dir)
    assert_same(wandb_numbers(run_dir), expected)
    assert_same(tensorboard_numbers(log_dir), expected)
    # The resolved config, once, as the run's config.
    config = wandb_config(run_dir)
    assert config["orchestrator"] == RUN_CONFIG["orchestrator"] and config["logging"] == RUN_CONFIG["logging"]
    assert wandb_run_ids(run_dir) == {(log_dir / "wandb_run_id").read_text()}


def test_a_resumed_run_continues_the_same_wandb_run_and_logs_only_new_lines(tmp_path):
    log_dir = tmp_path / "logs"
    first = Tracker(log_dir, wandb=wandb_cfg(), tensorboard=True, run_config=RUN_CONFIG)
    run_id = first.wandb_run_id
    run_steps(log_dir, first, range(2))

    second = Tracker(log_dir, wandb=wandb_cfg(), tensorboard=True, run_config=RUN_CONFIG, resume=True)
    assert second.wandb_run_id == run_id == (log_dir / "wandb_run_id").read_text()
    run_steps(log_dir, second, range(2, 3))

    # W&B writes an offline session per process, both under the one run id.
    dirs = wandb_run_dirs(log_dir)
    assert len(dirs) == 2 and all(f"-{run_id}" in d.name for d in dirs)  # a "-1" suffix within one second
    assert all(wandb_run_ids(d) == {run_id} for d in dirs)
    # Each line was logged once: the resumed tracker starts where the first stopped reading.
    assert_same(wandb_numbers(dirs[0]), jsonl_numbers(log_dir, steps={0, 1}))
    assert_same(wandb_numbers(dirs[1]), jsonl_numbers(log_dir, steps={2}))
    assert_same(tensorboard_numbers(log_dir), jsonl_numbers(log_dir))

    # checkpoint.resume false: a new W&B run.
    third = Tracker(log_dir, wandb=wandb_cfg(), run_config=RUN_CONFIG, resume=False)
    assert third.wandb_run_id != run_id and (log_dir / "wandb_run_id").read_text() == third.wandb_run_id
    third.close()


def test_a_failing_tracker_is_reported_once_and_the_records_still_reach_jsonl(tmp_path, monkeypatch, caplog):
    calls = []

    def broken(self, step, metrics):
        calls.append(step)
        raise OSError("No space left on device")

    monkeypatch.setattr(tracking.TensorBoardBackend, "log", broken)
    log_dir = tmp_path / "logs"
    tracker = Tracker(log_dir, wandb=wandb_cfg(), tensorboard=True)
    with caplog.at_level(logging.WARNING, logger=tracking.__name__):
        run_steps(log_dir, tracker, range(3))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and len(calls) == 1
    assert "logging.tensorboard failed (OSError: No space left on device)" in warnings[0]
    assert tracker.failures == ["logging.tensorboard"]
    assert [
        json.loads(line)["step"] for line in (log_dir / "orchestrator_metrics.jsonl").read_text().splitlines()
    ] == [0, 1, 2]
    # The other tracker goes on.
    (run_dir,) = wandb_run_dirs(log_dir)
    assert_same(wandb_numbers(run_dir), jsonl_numbers(log_dir))


def test_wandb_that_cannot_start_online_is_reported_once_and_training_goes_on(tmp_path, monkeypatch, caplog):
    import wandb

    def no_network(**kwargs):
        raise wandb.errors.CommError("Network error (ConnectionError), entering retry loop")

    monkeypatch.setattr(wandb, "init", no_network)
    log_dir = tmp_path / "logs"
    with caplog.at_level(logging.WARNING, logger=tracking.__name__):
        tracker = Tracker(log_dir, wandb=WandbConfig(project="p"), tensorboard=True)
        run_steps(log_dir, tracker, range(2))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith("logging.wandb failed (CommError")
    assert_same(tensorboard_numbers(log_dir), jsonl_numbers(log_dir))


@pytest.mark.parametrize("package, key", [("wandb", "logging.wandb"), ("tensorboard", "logging.tensorboard")])
def test_a_missing_package_is_an_error_naming_the_key(tmp_path, monkeypatch, package, key):
    monkeypatch.setitem(sys.modules, package, None)  # import raises ImportError
    kwargs = {"wandb": wandb_cfg()} if package == "wandb" else {"tensorboard": True}
    with pytest.raises(
        TrackingError, match=rf"{key} needs the {package} package: pip install megatron_rl\[tracking\]"
    ):
        Tracker(tmp_path / "logs", **kwargs)


def test_from_config_is_none_without_a_tracker_and_disabled_wandb_imports_nothing(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)

    def resolved(**logging_kw):
        return SimpleNamespace(logging=LoggingConfig(dir=str(tmp_path / "logs"), **logging_kw),
                               checkpoint=SimpleNamespace(resume=True), to_json=lambda: "{}")  # fmt: skip

    assert Tracker.from_config(resolved()) is None
    assert Tracker.from_config(resolved(wandb={"project": "p", "mode": "disabled"})) is None


def test_flatten_keeps_numbers_under_slash_keys():
    record = {"step": 4, "a": 1, "b": {"c": 2.5, "step": 7, "d": {"e": True}}, "s": "x", "n": None, "l": [1]}
    assert flatten(record, "orchestrator/") == {"orchestrator/a": 1.0, "orchestrator/b/c": 2.5,
                                                "orchestrator/b/step": 7.0, "orchestrator/b/d/e": 1.0}  # fmt: skip


def test_a_partial_line_waits_and_a_replaced_file_is_read_again(tmp_path):
    path = tmp_path / "policy_metrics.jsonl"
    follower = tracking._Follower(path)
    assert follower.read() == []
    path.write_text('{"step": 0, "loss": 1.0}\n{"step": 1, "lo')
    assert follower.read() == [{"step": 0, "loss": 1.0}]
    with open(path, "a") as f:
        f.write('ss": 2.0}\n')
    assert follower.read() == [{"step": 1, "loss": 2.0}] and follower.last_step == 1
    path.write_text('{"step": 5}\n')  # shorter than the offset: a new file
    assert follower.read() == [{"step": 5}]
    assert tracking._Follower(path, offset=path.stat().st_size).last_step == 5
