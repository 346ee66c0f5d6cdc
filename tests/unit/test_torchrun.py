"""megatron_rl.launch.torchrun: torchrun's command line, its static rendezvous moved to the
bound store (same endpoint, node rank, timeout), and a two-"node" group on one machine whose
ranks get their global ranks from it. Where its store listens: test_listen_addresses.py."""

from __future__ import annotations

import subprocess
import sys

from megatron_rl.launch.torchrun import BACKEND, bound_args
from megatron_rl.parallel import free_port


def test_static_rendezvous_moves_to_the_bound_backend_with_endpoint_and_node_rank():
    args = bound_args(["--nnodes", "2", "--node_rank", "1", "--nproc_per_node", "3", "--master_addr", "10.0.0.7",
                       "--master_port", "23456", "--rdzv_conf", "timeout=90", "train.py", "--x"])  # fmt: skip
    assert (args.rdzv_backend, args.rdzv_endpoint) == (BACKEND, "10.0.0.7:23456")
    assert args.rdzv_conf == "timeout=90,rank=1" and args.node_rank == 0
    assert (args.training_script, args.training_script_args) == ("train.py", ["--x"])
    assert bound_args(["--master_addr", "::1", "--master_port", "5", "t.py"]).rdzv_endpoint == "[::1]:5"
    # other backends are torchrun's own
    c10d = bound_args(["--rdzv_backend", "c10d", "--rdzv_endpoint", "h:1", "t.py"])
    assert (c10d.rdzv_backend, c10d.rdzv_endpoint) == ("c10d", "h:1")


def test_two_nodes_rendezvous_and_their_ranks_get_global_ranks(tmp_path):
    rank = tmp_path / "rank.py"
    rank.write_text(
        "import os\nprint('rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'], flush=True)\n"
    )
    port = free_port()
    agents = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "megatron_rl.launch.torchrun",
                "--nnodes",
                "2",
                "--node_rank",
                str(n),
                "--nproc_per_node",
                "1",
                "--master_addr",
                "127.0.0.1",
                "--master_port",
                str(port),
                str(rank),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for n in (0, 1)
    ]
    outputs = [agent.communicate(timeout=120)[0] for agent in agents]
    assert [agent.returncode for agent in agents] == [0, 0], outputs
    assert "rank 0 of 2" in outputs[0] and "rank 1 of 2" in outputs[1], outputs
    assert "will be ignored" not in outputs[1], outputs[1]
