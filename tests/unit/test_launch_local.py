"""The local launcher's plan and supervision, and port probing: devices from what is visible,
disjoint per group; a dry run names every command, device set, port and log; probes never bind
all interfaces and skip ports taken on either address; concurrent launches get distinct ports;
a component killed with SIGKILL stops everything, naming it."""

from __future__ import annotations

import io
import os
import random
import signal
import socket
import sys
import time

import pytest

from megatron_rl.config import load_config
from megatron_rl.launch.local import (
    Component,
    LaunchError,
    Supervisor,
    assign_devices,
    run_local,
    training_env,
    visible_devices,
)
from megatron_rl.launch.ports import PortProbeError, probe_ports
from megatron_rl.parallel import free_port
from tests.support.orchestrator import orchestrator_config
from tests.support.spawn import forkserver_context


def gpu_config():
    resolved = orchestrator_config("sao")  # inference 1, critic 2, policy 2 GPUs
    resolved.deployment.device = "cuda"
    return resolved


def test_devices_come_from_those_visible_and_are_disjoint(monkeypatch):
    resolved = gpu_config()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,5,7,3,6")
    assigned = assign_devices(resolved, visible_devices(resolved))
    assert assigned == {"inference_0": ["2"], "critic": ["5", "7"], "policy": ["3", "6"]}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,5")
    with pytest.raises(LaunchError, match=r"needs 5 devices .* but 2 are visible: \['2', '5'\]"):
        assign_devices(resolved, visible_devices(resolved))


def test_dry_run_prints_every_command_device_port_and_log(tmp_path, tiny_models, monkeypatch):
    config = tmp_path / "run.yaml"
    model = tiny_models["qwen3"]
    config.write_text(f"""
model: {{hf_config: {model}, seq_len: 128}}
algorithm: {{type: sao}}
value: {{model: {{hf_config: {model}, seq_len: 128}}}}
orchestrator: {{num_steps: 2, batch_size: 4, group_size: 1, max_prompt_tokens: 32, max_completion_tokens: 16}}
inference: {{num_servers: 2, tp: 2, weight_update: safetensors, publish_dir: {tmp_path}/published}}
deployment: {{nodes: 1, gpus_per_node: 8, inference_gpus: 4, policy_gpus: 2, num_value_gpus_per_train_node: 2}}
logging: {{dir: {tmp_path}/run}}
""")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7,6,5,4,3,2,1,0")
    out = io.StringIO()
    assert run_local(str(config), dry_run=True, out=out) == 0
    text = out.getvalue()
    for name in ["inference_0", "inference_1", "router", "critic", "policy", "orchestrator"]:
        assert f"[{name}]" in text and f"{tmp_path}/run/logs/{name}.log" in text
    assert (
        "devices: 7,6" in text
        and "devices: 5,4" in text
        and "devices: 3,2" in text
        and "devices: 1,0" in text
    )
    assert "CUDA_VISIBLE_DEVICES=7,6" in text and "--tensor-parallel-size 2" in text
    assert "--nproc_per_node 2" in text and "rendezvous=" in text and "service=8100" in text
    assert not (tmp_path / "run").exists()  # a dry run starts and writes nothing


def _component_blocks(text: str) -> dict[str, str]:
    """A dry run's text split per component: name -> its lines."""
    blocks, name = {}, None
    for line in text.splitlines():
        if line.startswith("[") and line.endswith("]"):
            name = line[1:-1]
            blocks[name] = ""
        elif name is not None:
            blocks[name] += line + "\n"
    return blocks


def test_training_ranks_with_tensor_parallelism_get_cuda_device_max_connections_1(tmp_path, tiny_models, monkeypatch):
    """megatron's TP layers overlap their communication with the weight-gradient matmul and rely
    on CUDA_DEVICE_MAX_CONNECTIONS=1 for the order (before: never set): the policy at TP=2 gets
    it, the critic at TP=1 and the inference servers do not."""
    config = tmp_path / "run.yaml"
    model = tiny_models["qwen3"]
    config.write_text(f"""
model: {{hf_config: {model}, seq_len: 128, tp: 2}}
algorithm: {{type: sao}}
value: {{model: {{hf_config: {model}, seq_len: 128}}}}
orchestrator: {{num_steps: 2, batch_size: 4, group_size: 1, max_prompt_tokens: 32, max_completion_tokens: 16}}
inference: {{num_servers: 1, tp: 2, weight_update: safetensors, publish_dir: {tmp_path}/published}}
deployment: {{nodes: 1, gpus_per_node: 8, inference_gpus: 2, policy_gpus: 2, num_value_gpus_per_train_node: 2}}
logging: {{dir: {tmp_path}/run}}
""")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5")
    out = io.StringIO()
    assert run_local(str(config), dry_run=True, out=out) == 0
    blocks = _component_blocks(out.getvalue())
    assert "CUDA_DEVICE_MAX_CONNECTIONS=1" in blocks["policy"] and "--nproc_per_node 2" in blocks["policy"]
    for name in ("critic", "inference_0", "router", "orchestrator"):
        assert "CUDA_DEVICE_MAX_CONNECTIONS" not in blocks[name], name
    cpu = load_config(config, ["deployment.device=cpu", "inference.backend=vllm-cpu"])
    assert training_env(cpu, "policy") == {}  # only CUDA has device connections


def test_probe_never_binds_all_interfaces_and_skips_ports_taken_on_either_address(monkeypatch):
    bound = []
    real_bind = socket.socket.bind

    def recording_bind(self, address):
        bound.append(address[0])
        return real_bind(self, address)

    with socket.socket() as on_host, socket.socket() as on_loopback:
        on_host.bind(("127.0.0.2", 0))  # another loopback address stands in for the host address
        on_loopback.bind(("127.0.0.1", 0))
        taken = [on_host.getsockname()[1], on_loopback.getsockname()[1]]
        excluded, free = probe_ports(2, ["127.0.0.2", "127.0.0.1"])  # free now on both (a fixed number may be taken)

        class Proposals(random.Random):
            def __init__(self):
                super().__init__(0)
                self.queue = [*taken, excluded, free]

            def randrange(self, *args):
                return self.queue.pop(0) if self.queue else super().randrange(*args)

        monkeypatch.setattr(socket.socket, "bind", recording_bind)
        ports = probe_ports(2, ["127.0.0.2", "127.0.0.1"], exclude={excluded}, rng=Proposals())
    assert not set(ports) & set(taken) and excluded not in ports and free in ports
    assert set(bound) == {"127.0.0.1", "127.0.0.2"}  # never 0.0.0.0
    with pytest.raises(PortProbeError, match="never on all interfaces"):
        probe_ports(1, ["0.0.0.0"])


def test_probed_ports_lie_below_the_kernels_ephemeral_range():
    # An ephemeral port can be taken at any moment as an outgoing connection's local port (it
    # once took a probed port between the probe and torch's TCPStore bind: EADDRINUSE).
    from megatron_rl.launch.ports import PORT_RANGE, probe_range

    ephemeral_low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])  # 32768 here
    assert ephemeral_low - PORT_RANGE[0] >= 8000, "this machine's ephemeral range leaves too few ports below it"
    assert probe_range() == (PORT_RANGE[0], min(PORT_RANGE[1], ephemeral_low))
    assert all(PORT_RANGE[0] <= p < ephemeral_low for p in probe_ports(40, ["127.0.0.1"]))
    near = (ephemeral_low - 100, ephemeral_low + 1000)
    assert probe_range(near) == near  # too few ports below it: the range as it is


def _probe_and_bind(barrier, results):
    from torch.distributed import TCPStore

    barrier.wait()
    try:
        ports = probe_ports(3, ["127.0.0.1"])
        stores = [TCPStore("127.0.0.1", p, 1, True, wait_for_workers=False) for p in ports]
        results.put(("ok", ports))
        time.sleep(0.5)
        del stores
    except Exception as exc:  # reported to the test
        results.put(("error", repr(exc)))


def test_concurrent_launches_get_distinct_free_ports():
    # Separate processes probing at once (forks of the session's forkserver: the ports come from
    # SystemRandom, so forks draw independently; a fresh interpreter each costs seconds).
    context = forkserver_context()
    for _ in range(2):
        barrier, results = context.Barrier(4), context.Queue()
        workers = [context.Process(target=_probe_and_bind, args=(barrier, results)) for _ in range(4)]
        for w in workers:
            w.start()
        outcomes = [results.get(timeout=60) for _ in workers]
        for w in workers:
            w.join(30)
        assert all(kind == "ok" for kind, _ in outcomes), outcomes  # no EADDRINUSE
        chosen = [p for _, ports in outcomes for p in ports]
        assert len(set(chosen)) == len(chosen)


def sleeper(tmp_path, name, seconds=60, code=0, may_finish=False):
    command = [
        sys.executable,
        "-c",
        f"import time; print('{name} up', flush=True); time.sleep({seconds}); raise SystemExit({code})",
    ]
    return Component(name, command, tmp_path / f"{name}.log", may_finish=may_finish)


@pytest.mark.parametrize("victim", ["critic", "policy", "router"])
def test_a_component_killed_stops_everything_naming_it(tmp_path, victim):
    components = [sleeper(tmp_path, "router"), sleeper(tmp_path, "critic"),
                  sleeper(tmp_path, "policy", may_finish=True), sleeper(tmp_path, "orchestrator", may_finish=True)]  # fmt: skip
    out = io.StringIO()
    supervisor = Supervisor(components, grace_s=5, out=out)
    import threading

    def kill_soon():
        time.sleep(2)
        next(c for c in components if c.name == victim).signal(signal.SIGKILL)

    threading.Thread(target=kill_soon, daemon=True).start()
    began = time.monotonic()
    assert supervisor.run("fake", 10) == 1
    assert time.monotonic() - began < 15
    assert f"component '{victim}' exited with code -9" in out.getvalue() and f"{victim} up" in out.getvalue()
    assert all(c.process.poll() is not None for c in components)


def port_taken(tmp_path, name: str, torchrun: bool, fail_times: int) -> Component:
    """A component whose first `fail_times` starts fail as a taken port does, then runs."""
    count = tmp_path / f"{name}.starts"
    command = [sys.executable, "-c", (
        f"import pathlib, time; p = pathlib.Path({str(count)!r}); n = len(p.read_text()) if p.exists() else 0; "
        f"p.write_text('x' * (n + 1)); print('start', n, flush=True)\n"
        f"if n < {fail_times}: print('OSError: [Errno 98] Address already in use', flush=True); raise SystemExit(1)\n"
        "time.sleep(30)"
    ), "--master_port", "1"]  # fmt: skip
    url = None if torchrun else f"http://127.0.0.1:{free_port()}"  # a server: the launcher waits for it
    return Component(name, command, tmp_path / f"{name}.log", torchrun=torchrun, url=url)


def test_a_torchrun_group_that_lost_its_rendezvous_port_restarts_on_a_new_one_and_nothing_else_does(tmp_path):
    reprobed = []

    def reprobe(component):
        reprobed.append(component.name)
        command = list(component.command)
        command[command.index("--master_port") + 1] = "2"
        return command

    group = port_taken(tmp_path, "policy", torchrun=True, fail_times=1)
    orchestrator = sleeper(tmp_path, "orchestrator", 3, may_finish=True)
    out = io.StringIO()
    assert Supervisor([group, orchestrator], grace_s=5, out=out, reprobe=reprobe).run("fake", 20) == 0
    assert reprobed == ["policy"] and group.command[-1] == "2" and group.restarts == 1
    assert "policy lost its rendezvous port; restarting on a new probe" in out.getvalue()

    # A server whose port was taken is not a torchrun group: it fails the run, named (before: the
    # launcher crashed looking for --master_port in the server's command).
    server = port_taken(tmp_path, "inference_0", torchrun=False, fail_times=1)
    out = io.StringIO()
    assert Supervisor([server, sleeper(tmp_path, "orchestrator2", 10)], grace_s=5, out=out, reprobe=reprobe).run(
        "fake", 20
    ) == 1
    assert reprobed == ["policy"]
    assert "component 'inference_0' exited with code 1" in out.getvalue() and "Address already in use" in out.getvalue()


def test_the_orchestrator_finishing_stops_everything_with_exit_zero(tmp_path):
    components = [sleeper(tmp_path, "critic"), sleeper(tmp_path, "policy", 1, may_finish=True),
                  sleeper(tmp_path, "orchestrator", 2, may_finish=True)]  # fmt: skip
    out = io.StringIO()
    assert Supervisor(components, grace_s=5, out=out).run("fake", 10) == 0
    assert "the orchestrator finished its steps" in out.getvalue()
    assert components[0].process.returncode == -signal.SIGTERM


def test_every_process_logs_at_the_configured_level():
    import logging

    from megatron_rl.launch.cli import configure_logging
    from tests.support.orchestrator import orchestrator_config

    resolved = orchestrator_config("grpo")
    resolved.logging.level = "WARNING"
    before = logging.getLogger().level
    try:
        configure_logging(resolved.logging)
        level = logging.getLogger().level
    finally:
        logging.getLogger().setLevel(before)
    assert level == logging.WARNING


def test_a_port_drawn_by_one_process_is_not_drawn_by_another_until_its_reservation_ages(tmp_path, monkeypatch):
    # Each draw is reserved across processes (megatron_rl/ports.py); forgetting this process's own
    # draws (`_handed_out`) stands in for another process drawing from the same range.
    from megatron_rl import ports

    monkeypatch.setenv("MEGATRON_RL_PORT_DIR", str(tmp_path))
    monkeypatch.setattr(ports, "FREE_PORT_RANGE", (27000, 27029))
    monkeypatch.setattr(ports, "_handed_out", set())
    first = {ports.free_port() for _ in range(10)}
    ports._handed_out.clear()  # "another process"
    second = {ports.free_port() for _ in range(20)}
    assert len(first) == 10 and len(second) == 20 and not first & second  # nothing is bound: only the reservations tell
    assert first | second == set(range(27000, 27030))
    ports._handed_out.clear()
    assert not 27000 <= ports.free_port() <= 27029  # every port reserved: the kernel's choice, outside the range
    stale = tmp_path / "27005"
    os.utime(stale, (stale.stat().st_atime, stale.stat().st_mtime - ports.RESERVATION_TTL_S - 1))
    assert ports.free_port() == 27005  # a reservation older than the TTL is taken over
