"""Two senders at once (policy DP=2 with 2 receivers per data rank, critic DP=3), receivers in
their own processes, several steps: every receiver gets its data rank's bytes exactly."""

from __future__ import annotations

import hashlib
import multiprocessing as mp

from megatron_rl.launch.ports import probe_ports  # light: the spawned receivers import this module
from megatron_rl.transport import GridReceiver, GridSender
from tests.support.samples import make_grid

STEPS = 4


def digest(micro_batches) -> str:
    h = hashlib.sha256()
    for mb in micro_batches:
        h.update(b"dummy" if mb.is_dummy else b"real")
        for name, array in mb.arrays().items():
            h.update(name.encode() + array.dtype.name.encode() + str(array.shape).encode() + array.tobytes())
    return h.hexdigest()


def receiver_process(port: int, data_rank: int, receiver_id: int, results) -> None:
    with GridReceiver("127.0.0.1", port, data_rank, receiver_id, timeout_s=60) as receiver:
        for step in range(STEPS):
            results.put((port, data_rank, receiver_id, step, digest(receiver.receive(step))))


def test_two_senders_many_receiver_processes():
    context = mp.get_context("spawn")
    results = context.Queue()
    policy_port, critic_port = probe_ports(2)
    layouts = {policy_port: (2, 2, 2), critic_port: (3, 1, 1)}  # port -> (dp, receivers per rank, cp)
    processes = [
        context.Process(target=receiver_process, args=(port, d, r, results))
        for port, (dp, per_rank, _) in layouts.items()
        for d in range(dp)
        for r in range(per_rank)
    ]
    senders = {
        port: GridSender("127.0.0.1", port, dp, per_rank, name=str(port))
        for port, (dp, per_rank, _) in layouts.items()
    }
    expected = {}
    try:
        for p in processes:
            p.start()
        for sender in senders.values():
            sender.wait_for_receivers(timeout_s=60)
        for step in range(STEPS):
            for port, sender in senders.items():
                dp, _, cp = layouts[port]
                grid = make_grid(step * 10 + dp, dp, cp=cp, count=25)
                sender.publish(step, grid, timeout_s=60)
                for d in range(dp):
                    expected[(port, d, step)] = digest(grid[d])
        for sender in senders.values():
            for step in range(STEPS):
                sender.wait_delivered(step, timeout_s=60)
        got = [results.get(timeout=60) for _ in range(len(processes) * STEPS)]
    finally:
        for p in processes:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        for sender in senders.values():
            sender.close()
    assert all(p.exitcode == 0 for p in processes)
    seen = set()
    for port, data_rank, receiver_id, step, value in got:
        assert value == expected[(port, data_rank, step)], (port, data_rank, receiver_id, step)
        seen.add((port, data_rank, receiver_id, step))
    assert len(seen) == len(processes) * STEPS
