"""Nothing is lost on restart (issue 16, item 9): a seeded, bounded loop of kill -9 points.

The policy trainer and the critic run together on one rank each, fed four steps by this test's
ZMQ senders (the same data per step every time), checkpointing every second step, publishing
every version, the policy exporting a snapshot the critic loads at step 2 and making two
mini-batch updates a step. Each launch of the run kills one role with SIGKILL at a kill point
chosen by a seeded generator (megatron_rl/faults.py: between steps, mid-step after the backward,
between the policy's mini-batch updates, after the update, mid-publish, mid-snapshot,
mid-checkpoint, mid-replacement of a redone version) and the other role at
whatever it was doing; the next launch resumes both from their common checkpoint. After every
kill no committed checkpoint, snapshot or published version is half-written (`latest` names a
complete one; every published file matches its manifest's sha256). At the end every loss either
role ever logged (redone steps included) equals the uninterrupted run's loss of that step,
exactly, and the last published weights are byte-identical to the uninterrupted run's.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path

import httpx
import pytest

from megatron_rl.config import ResolvedConfig
from megatron_rl.critic.client import HttpValueScorer
from megatron_rl.data.packing import pack_into_grid, pack_minibatches
from megatron_rl.faults import ENV, POINTS
from megatron_rl.parallel import free_port
from megatron_rl.policy.publish import verify_published
from megatron_rl.trainer import atomic_dir
from megatron_rl.trainer.resume import run_resume_step
from megatron_rl.transport import GridSender, TransportTimeout
from tests.support.configs import write_config
from tests.support.processes import RankProcesses
from tests.support.samples import training_samples

pytestmark = pytest.mark.slow

NUM_STEPS = 4
SAVE_STEPS = (1, 3)  # checkpoint.save_interval 2
SNAPSHOT_STEP = 2  # the critic loads policy version 2 (exported after policy step 1) at its step 2
SEED = 20261130
ROLES = ("policy", "critic")


def run_config(root: Path, hf_dir: Path) -> tuple[ResolvedConfig, Path]:
    root.mkdir(parents=True, exist_ok=True)
    ports = [free_port() for _ in range(5)]
    return write_config(
        root, hf_dir, NUM_STEPS, ports,
        deployment={"policy_gpus": 1, "heartbeat_timeout_s": 10},
        checkpoint={"save_interval": 2},
        algorithm={"policy_minibatches": 2},
        value={"epochs_per_step": 2, "snapshot": {"steps": [SNAPSHOT_STEP]},
               "service": {"port": ports[4]}},
    )  # fmt: skip


def grid(role: str, step: int):
    samples = training_samples(4, 512, seed=step)
    if role == "policy":  # two mini-batches, as the orchestrator splits them
        return pack_minibatches(samples, 2, (SEED, step), 64, 1)
    return pack_into_grid(samples, 64, 1)


def resume_start(resolved) -> int:
    common = run_resume_step(resolved)
    return 0 if common is None else common + 1


def with_fresh_ports(resolved, logs: Path) -> tuple[ResolvedConfig, Path]:
    """The run's resolved config with ports of its own for one launch (logs/resolved.json): a
    killed launch frees its ports, and another test's process may take one before the next
    launch binds it (seen once in the suite: the critic's service port, "address already in use")."""
    data = json.loads(resolved.to_json())
    data["transport"]["policy_port"], data["transport"]["critic_port"] = free_port(), free_port()
    data["value"]["service"]["port"] = free_port()
    logs.mkdir(parents=True, exist_ok=True)
    path = logs / "resolved.json"
    path.write_text(json.dumps(data))
    return ResolvedConfig.model_validate_json(path.read_text()), path


def launch(resolved, logs: Path, kill: tuple[str, str, int] | None) -> dict[str, int]:
    """Starts both roles (on ports of their own: `with_fresh_ports`), feeds steps from their
    resume step on. With `kill` = (role, point, step) that role must die at the kill point
    (SIGKILL) and the other is then killed too; without, the policy must finish and the critic is
    stopped after its last step. Returns the exit codes."""
    resolved, path = with_fresh_ports(resolved, logs)
    start = resume_start(resolved)
    argv = {"policy": ["train-policy", "--config", str(path)], "critic": ["critic", "--config", str(path)]}
    env = {role: {ENV: f"{kill[1]}@{kill[2]}"} if kill and kill[0] == role else {} for role in ROLES}
    processes = {role: RankProcesses(argv[role], 1, logs / role, env=env[role]) for role in ROLES}
    ports = {"policy": resolved.transport.policy_port, "critic": resolved.transport.critic_port}
    senders = {role: GridSender("127.0.0.1", ports[role], data_parallel_size=1, name=role) for role in ROLES}
    codes: dict[str, int] = {}
    try:
        fed = dict.fromkeys(ROLES, start)
        deadline = time.monotonic() + 600
        while True:
            assert time.monotonic() < deadline, {r: p.output()[-3000:] for r, p in processes.items()}
            # As the orchestrator does: the policy's step N only after the critic trained (and
            # checkpointed) step N, so the critic is never behind the policy.
            critic_done = critic_trained_step(resolved)
            for role in ROLES:
                if fed[role] < NUM_STEPS and (role == "critic" or fed[role] <= critic_done):
                    try:
                        senders[role].publish(fed[role], grid(role, fed[role]), timeout_s=0.2)
                        fed[role] += 1
                    except TransportTimeout:
                        pass
            codes = {role: p.processes[0].poll() for role, p in processes.items()}
            if kill is not None and codes[kill[0]] is not None:
                break
            if kill is None and codes["policy"] is not None:
                break
            time.sleep(0.05)
        if kill is not None:
            other = processes["critic" if kill[0] == "policy" else "policy"].processes[0]
            if other.poll() is None:
                other.kill()
        else:
            asyncio.run(wait_trained(resolved, NUM_STEPS - 1))
            processes["critic"].stop()
        codes = {role: p.processes[0].wait(timeout=60) for role, p in processes.items()}
    finally:
        for sender in senders.values():
            sender.close()
        for process in processes.values():
            process.__exit__(None, None, None)
    outputs = {role: p.output()[-4000:] for role, p in processes.items()}
    if kill is not None:
        assert codes[kill[0]] == -9, (kill, codes, outputs)  # the kill point was reached
    else:
        assert codes == {"policy": 0, "critic": 0}, outputs
    return codes


async def wait_trained(resolved, step: int) -> None:
    service = resolved.value.service
    scorer = HttpValueScorer(f"http://{service.host}:{service.port}")
    try:
        await scorer.wait_trained(step, timeout_s=300)
    finally:
        await scorer.close()


def critic_trained_step(resolved) -> int:
    """The critic service's last trained step (-1 while it does not answer)."""
    service = resolved.value.service
    try:
        return int(httpx.get(f"http://{service.host}:{service.port}/status", timeout=1).json()["trained_step"])
    except httpx.HTTPError:
        return -1


def feasible_kill(rng: random.Random, resolved, start: int, point: str) -> tuple[str, str, int] | None:
    """A (role, point, step) that this launch, resuming at `start`, is certain to reach; None
    when neither role reaches `point` from there."""
    root = Path(resolved.checkpoint.dir)
    published = Path(resolved.inference.publish_dir)

    def redone(role, s):  # the old directory a redone step `s` replaces exists
        if role == "critic":
            return s in SAVE_STEPS and (root / "critic" / f"step_{s:08d}").exists()
        return (published / f"version_{s + 1:08d}").exists() or (
            s in SAVE_STEPS and (root / "policy" / f"step_{s:08d}").exists()
        )

    options = []
    for role in ROLES:
        if role == "critic" and point in ("publish.written", "snapshot.written", "step.minibatch"):
            continue
        steps = list(range(start, NUM_STEPS))
        if point == "checkpoint.written":
            steps = [s for s in steps if s in SAVE_STEPS]
        elif point == "snapshot.written":
            steps = [s for s in steps if s + 1 == SNAPSHOT_STEP]
        elif point == "commit.replacing":  # fires at the first replacement
            steps = [s for s in steps if redone(role, s)][:1]
        options += [(role, point, s) for s in steps]
    return rng.choice(options) if options else None


def check_nothing_half_written(resolved) -> None:
    root = Path(resolved.checkpoint.dir)
    for directory, required in (
        (root / "policy", "meta.json"),
        (root / "critic", "meta.json"),
        (root / "policy_snapshots", "meta.json"),
        (Path(resolved.inference.publish_dir), "manifest.json"),
    ):
        if not directory.exists():
            continue
        for path in directory.iterdir():
            if path.is_dir() and atomic_dir.is_committed_name(path.name):
                assert (path / required).is_file(), f"{path} is committed but has no {required}"
        if (directory / atomic_dir.LATEST).exists():
            atomic_dir.latest(directory, required)  # names a complete directory
        if required == "manifest.json":
            for path in atomic_dir.committed(directory, "version_*", required).values():
                verify_published(path)


def logged(resolved, name: str) -> list[dict]:
    path = Path(resolved.logging.dir) / name
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_kill_and_restart_loses_nothing(tiny_models, tmp_path):
    hf_dir = tiny_models["qwen3"]
    reference, _ = run_config(tmp_path / "reference", hf_dir)
    launch(reference, tmp_path / "reference" / "launch", None)
    policy_loss = {r["step"]: r["loss"] for r in logged(reference, "policy_metrics.jsonl")}
    critic_loss = {r["step"]: r["epoch_losses"] for r in logged(reference, "critic_metrics.jsonl")}
    assert sorted(policy_loss) == sorted(critic_loss) == list(range(NUM_STEPS))

    resolved, _ = run_config(tmp_path / "killed", hf_dir)
    rng = random.Random(SEED)
    points = list(POINTS)
    rng.shuffle(points)
    kills = []
    while points:
        start = resume_start(resolved)
        choices = [(point, feasible_kill(rng, resolved, start, point)) for point in points]
        point, kill = next(((p, k) for p, k in choices if k is not None), (None, None))
        if kill is None:
            break
        points.remove(point)
        launch(resolved, tmp_path / "killed" / f"launch{len(kills)}", kill)
        kills.append(kill)
        check_nothing_half_written(resolved)
    # between steps, mid-step, mid-checkpoint, mid-publish at least
    assert {"step.begin", "train.backward", "step.minibatch", "checkpoint.written", "publish.written"} <= {
        k[1] for k in kills
    }, kills
    launch(resolved, tmp_path / "killed" / "last", None)
    check_nothing_half_written(resolved)

    policy_records = logged(resolved, "policy_metrics.jsonl")
    critic_records = [r for r in logged(resolved, "critic_metrics.jsonl") if r["phase"] == "rl"]
    assert {r["step"] for r in policy_records} == {r["step"] for r in critic_records} == set(range(NUM_STEPS))
    assert all(r["optimizer_steps"] == 2 for r in policy_records)
    for record in policy_records:
        assert record["loss"] == policy_loss[record["step"]], (kills, record)
    for record in critic_records:
        assert record["epoch_losses"] == critic_loss[record["step"]], (kills, record)
    final = json.loads(
        (
            atomic_dir.latest(Path(resolved.inference.publish_dir), "manifest.json") / "manifest.json"
        ).read_text()
    )
    expected = json.loads(
        (
            atomic_dir.latest(Path(reference.inference.publish_dir), "manifest.json") / "manifest.json"
        ).read_text()
    )
    assert final == expected  # the same step and the same sha256 of every weight file
    print("kills:", kills, "records:", len(policy_records), len(critic_records))
