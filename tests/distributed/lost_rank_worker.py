"""One rank of a bare gloo group with the lost-rank watchdog, for test_lost_rank.py.

    python -m tests.distributed.lost_rank_worker SCENARIO HEARTBEAT_TIMEOUT_S

(rank and rendezvous from the torchrun environment variables). Scenarios:
    collectives   all-reduce in a loop until killed from outside
    hang          rank 1 stops itself (SIGSTOP) while the others wait in an all-reduce
    finish        rank 0 leaves normally at once, the others after 2 heartbeat timeouts
    restarted     "hang" in torchrun's second attempt, with rank 1's FINISHED from the first
                  attempt left in the store
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from megatron_rl import parallel
from megatron_rl.parallel.watchdog import FINISHED, KEY


def main(scenario: str, timeout_s: float) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    parallel.initialize_distributed(timeout_s=600)  # the watchdog, not the group timeout, must act
    rank = dist.get_rank()
    if scenario == "restarted":
        os.environ["TORCHELASTIC_RESTART_COUNT"] = "1"
        if rank == 0:  # what rank 1 of attempt 0 left when it finished, where the watchdog looks
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
            store.add(KEY.format(attempt=0, rank=1), FINISHED)
        dist.all_reduce(torch.ones(4))
        scenario = "hang"
    parallel.start_watchdog("test", timeout_s)
    try:
        print(f"rank {rank} ready", flush=True)
        if scenario == "collectives":
            while True:
                dist.all_reduce(torch.ones(4))
                time.sleep(0.01)
        elif scenario == "hang":
            dist.all_reduce(torch.ones(4))
            if rank == 1:
                os.kill(os.getpid(), signal.SIGSTOP)
            dist.all_reduce(torch.ones(4))
        elif scenario == "finish":
            dist.all_reduce(torch.ones(4))
            if rank != 0:
                time.sleep(2 * timeout_s)
        else:
            raise ValueError(f"unknown scenario {scenario!r}")
        parallel.finished()
    finally:
        parallel.stop_watchdog()
        print(f"rank {rank} leaves", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]))
