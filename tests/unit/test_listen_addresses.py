"""Every listener of ours binds the configured host, never all interfaces: the ZMQ grid sender,
the critic's HTTP service, the weight-update group's TCPStore and torchrun's rendezvous store
(torch's store listens on every interface unless handed a bound socket), and vllm-router's HTTP
and metrics ports. Read from /proc/net/tcp{,6} while each one listens. The vLLM servers and
the whole process tree of a real `megatron-rl run` (gloo's and vLLM's own listeners included):
tests/e2e/test_launch_run.py and tests/e2e/test_demo.py. So does a checkpoint converter's."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import torch.distributed as dist

from megatron_rl.critic.service import CriticState, ScoreQueue, ScoringService
from megatron_rl.inference.pool import InferencePool
from megatron_rl.inference.vllm_server import VllmServer
from megatron_rl.launch.local import TORCHRUN
from megatron_rl.transport import GridSender
from megatron_rl.transport.weight_buckets import WeightUpdateGroup
from tests.support.fake_vllm import fake_vllm_command
from tests.support.watch import run_watched


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listen_addresses(port: int) -> set[str]:
    """The local addresses in LISTEN state (0A) on `port`, as hex from /proc/net/tcp{,6}."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, hex_port = fields[1].split(":")
            if int(hex_port, 16) == port and fields[3] == "0A":
                found.add(address)
    return found


LOOPBACK = {"0100007F"}  # 127.0.0.1 in /proc/net/tcp's byte order
ALL_INTERFACES = {"00000000", "00000000000000000000000000000000"}  # 0.0.0.0, ::


def test_grid_sender_critic_service_and_weight_store_listen_on_the_configured_host_only():
    port = free_port()
    with GridSender("127.0.0.1", port, data_parallel_size=1):
        assert listen_addresses(port) == LOOPBACK
    port = free_port()
    service = ScoringService("127.0.0.1", port, ScoreQueue(), CriticState({}), 100, 16, 4, 5.0)
    service.start()
    try:
        assert listen_addresses(port) == LOOPBACK
    finally:
        service.stop()
    port = free_port()
    group = WeightUpdateGroup("127.0.0.1", port, rank=0, world_size=1, backend="gloo", timeout_s=30)
    assert listen_addresses(port) == LOOPBACK
    del group


def test_a_plain_torch_store_listens_on_every_interface():
    """What the two tests above and below guard against: torch's TCPStore given 127.0.0.1 and no
    socket listens on all interfaces (so the checks can see a violation)."""
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 1, is_master=True, wait_for_workers=False)
    assert listen_addresses(port) & ALL_INTERFACES
    del store


def _wait_listening(port: int, process: subprocess.Popen, timeout_s: float = 120) -> set[str]:
    deadline = time.monotonic() + timeout_s
    while not listen_addresses(port):
        assert process.poll() is None, process.communicate()[0]
        assert time.monotonic() < deadline, f"nothing listens on {port} after {timeout_s}s"
        time.sleep(0.1)
    return listen_addresses(port)


def test_torchrun_rendezvous_store_listens_on_master_addr_only(tmp_path):
    """megatron-rl run's torchrun (megatron_rl.launch.torchrun, also in the SLURM script): the
    agent's store on --master_addr; the rank finds it there (MASTER_ADDR/PORT) and connects."""
    rank = tmp_path / "rank.py"
    done = tmp_path / "done"
    rank.write_text(
        "import os, pathlib, sys, time\n"
        "from datetime import timedelta\n"
        "import torch.distributed as dist\n"
        "store = dist.TCPStore(os.environ['MASTER_ADDR'], int(os.environ['MASTER_PORT']), is_master=False,\n"
        "                      timeout=timedelta(seconds=60))\n"
        "print('connected', flush=True)\n"
        "while not pathlib.Path(sys.argv[1]).exists():\n"
        "    time.sleep(0.1)\n"
    )
    port = free_port()
    command = [*TORCHRUN, "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", str(port),
               str(rank), str(done)]  # fmt: skip
    agent = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert _wait_listening(port, agent) == LOOPBACK
    finally:
        done.touch()
        output = agent.communicate(timeout=60)[0]
    assert agent.returncode == 0 and "connected" in output, output


def test_a_rendezvous_port_taken_fails_with_address_in_use(tmp_path):
    """The launcher's re-probe looks for 'Address already in use' in the log (ports.lost_port)."""
    from megatron_rl.launch.ports import lost_port

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        command = [*TORCHRUN, "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", str(port),
                   "-m", "json.tool", "--help"]  # fmt: skip
        result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and lost_port(result.stdout + result.stderr), result.stderr[-2000:]


def test_router_listens_on_the_configured_host_only(tmp_path):
    port = free_port()
    worker = VllmServer("fake-model", port, tmp_path / "w.log", name="stand-in",
                        command=fake_vllm_command("--port", str(port),
                                 "--name", "w1"))  # fmt: skip
    router_port = free_port()
    with InferencePool.launch([worker], router_port, tmp_path) as pool:
        metrics_port = int(pool.router.command[pool.router.command.index("--prometheus-port") + 1])
        assert listen_addresses(router_port) == LOOPBACK
        assert _wait_listening(metrics_port, pool.router.process, timeout_s=10) == LOOPBACK


def test_a_converter_listens_on_loopback_only(tmp_path, tiny_models):
    """tools/convert_hf_to_megatron.py as a process, its listeners read while it runs: gloo's on
    127.0.0.1, none on all interfaces (its one-rank group's store is in-process; the env://
    TCPStore it had before listened on every interface)."""
    tool = Path(__file__).resolve().parents[2] / "tools" / "convert_hf_to_megatron.py"
    argv = [sys.executable, str(tool), "--hf", str(tiny_models["qwen3"]), "--out", str(tmp_path / "mg")]
    code, output, seen = run_watched(argv, tmp_path, tmp_path / "convert.out", timeout_s=300)
    assert code == 0, output[-3000:]
    assert "wrote" in output and seen and {address for address, _, _ in seen} == {"127.0.0.1"}, seen
