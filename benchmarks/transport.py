"""Grid bytes per second through the ZMQ transport over loopback vs an in-process memory copy.

One GridSender, one GridReceiver process per data rank; each step's grid is published, received,
checksummed, decoded into MicroBatches and acknowledged. The reference copies the same arrays in
memory (numpy copy), in this process, in the same run. Writes benchmarks/results/transport.json.

    python benchmarks/transport.py [--tokens 1000000] [--dp 2] [--steps 5]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import time

import numpy as np
from _results import write_result  # benchmarks/ is on sys.path when run as a script

from megatron_rl.data.packing import pack_into_grid
from megatron_rl.data.types import TrainingSample
from megatron_rl.transport import GridReceiver, GridSender


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_grid(total_tokens: int, dp: int, seed: int):
    rng = np.random.default_rng(seed)
    samples, count = [], 0
    while count < total_tokens:
        n = int(rng.integers(500, 8000))
        samples.append(
            TrainingSample(
                token_ids=rng.integers(0, 150_000, n),
                loss_mask=rng.random(n) < 0.7,
                inference_logprobs=-rng.random(n),
                reward=1.0,
                values=rng.normal(size=n).astype(np.float32),
                advantages=rng.normal(size=n).astype(np.float32),
                returns=rng.normal(size=n).astype(np.float32),
            )
        )
        count += n
    return pack_into_grid(samples, 16_384, dp)


def grid_bytes(grid) -> int:
    return sum(a.nbytes for row in grid for mb in row for a in mb.arrays().values())


def receive_steps(port: int, data_rank: int, steps: int) -> None:
    with GridReceiver("127.0.0.1", port, data_rank, timeout_s=120) as receiver:
        for step in range(steps):
            receiver.receive(step)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=1_000_000)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()

    grids = [make_grid(args.tokens, args.dp, seed) for seed in range(args.steps)]
    total = sum(grid_bytes(g) for g in grids)

    start = time.perf_counter()
    for grid in grids:
        for row in grid:
            for mb in row:
                for array in mb.arrays().values():
                    array.copy()
    memcpy_s = time.perf_counter() - start

    port = free_port()
    context = mp.get_context("spawn")
    with GridSender("127.0.0.1", port, args.dp, max_pending_steps=2) as sender:
        receivers = [
            context.Process(target=receive_steps, args=(port, d, args.steps)) for d in range(args.dp)
        ]
        for p in receivers:
            p.start()
        sender.wait_for_receivers(timeout_s=120)
        start = time.perf_counter()
        for step, grid in enumerate(grids):
            sender.publish(step, grid, timeout_s=120)
        for step in range(args.steps):
            sender.wait_delivered(step, timeout_s=120)
        zmq_s = time.perf_counter() - start
        for p in receivers:
            p.join(timeout=60)

    zmq_rate, memcpy_rate = total / zmq_s, total / memcpy_s
    ratio = zmq_rate / memcpy_rate
    print(f"{args.steps} steps x {args.tokens:,} tokens, DP {args.dp}: {total / 1e6:.1f} MB of grid arrays")
    print(f"{'path':<44}{'MB/s':>10}")
    print(f"{'in-process memory copy (numpy)':<44}{memcpy_rate / 1e6:>10.0f}")
    print(f"{'ZMQ loopback: encode+crc32+send+decode+ack':<44}{zmq_rate / 1e6:>10.0f}")
    print(f"ratio ZMQ / memory copy: {ratio:.3f}")
    write_result(
        "transport",
        figure={"name": "ZMQ loopback grid bytes/s", "value": zmq_rate},
        reference={"name": "in-process memory copy bytes/s", "value": memcpy_rate},
        ratio=ratio,
        params=vars(args) | {"bytes": total},
    )


if __name__ == "__main__":
    main()
