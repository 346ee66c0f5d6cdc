"""Per-step cost of megatron_rl.compat's global TorchFunctionMode on CPU.

The mode maps device="cuda" to the CPU in tensor factories; megatron needs it in the forward
too (it builds masks with device="cuda"), so it cannot be switched off for a step. Measured
instead, in one process: the number of torch calls the mode intercepts in one forward+backward
of a small GPT, times the mode's own cost per call (a tiny op with and without the mode), against
the step's time. Writes benchmarks/results/compat_overhead.json.

    python benchmarks/compat_overhead.py [--repeats 10]
"""

from __future__ import annotations

import argparse
import time

from megatron_rl.compat import patches

import torch
from _results import write_result  # benchmarks/ is on sys.path when run as a script

from megatron_rl import parallel
from megatron_rl.config import Architecture
from megatron_rl.models.builder import build_gpt_model

ARCH = Architecture(
    family="qwen3",
    hidden_size=256,
    num_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    intermediate_size=768,
    vocab_size=4096,
    qk_norm=True,
)


def step(model, input_ids) -> None:
    positions = torch.arange(input_ids.shape[1]).expand_as(input_ids)
    labels = torch.roll(input_ids, -1, dims=1)
    model(input_ids, positions, attention_mask=None, labels=labels).float().mean().backward()


def timed(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--seq", type=int, default=512)
    args = parser.parse_args()
    import os

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29512")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    torch.set_num_threads(1)
    parallel.initialize_distributed()
    parallel.initialize_model_parallel()
    model = build_gpt_model(ARCH)
    input_ids = torch.randint(0, ARCH.vocab_size, (2, args.seq), generator=torch.Generator().manual_seed(0))
    step(model, input_ids)  # warm up

    # 1. How many calls does the mode see in one step?
    calls = 0
    original = patches._CudaToCpuMode.__torch_function__

    def counting(self, func, types, args=(), kwargs=None):
        nonlocal calls
        calls += 1
        return original(self, func, types, args, kwargs)

    patches._CudaToCpuMode.__torch_function__ = counting
    step(model, input_ids)
    patches._CudaToCpuMode.__torch_function__ = original

    # 2. The mode's cost per call: a tiny op with the mode active vs suspended.
    a, b = torch.ones(4), torch.ones(4)
    n = 20_000

    def tiny_ops():
        for _ in range(n):
            torch.add(a, b)

    per_call_with = timed(tiny_ops, 5) / n
    patches._mode.__exit__(None, None, None)
    try:
        per_call_without = timed(tiny_ops, 5) / n
    finally:
        patches._mode.__enter__()
    per_call = per_call_with - per_call_without

    # 3. The step itself.
    step_s = timed(lambda: step(model, input_ids), args.repeats)
    overhead_s = calls * per_call
    ratio = step_s / (step_s - overhead_s)
    print(
        f"GPT {ARCH.num_layers} layers, hidden {ARCH.hidden_size}, batch 2 x {args.seq} tokens, forward+backward, 1 thread"
    )
    print(f"torch calls seen by the mode per step: {calls}")
    print(
        f"mode cost per call: {per_call * 1e6:.2f} us ({per_call_with * 1e6:.2f} vs {per_call_without * 1e6:.2f} us)"
    )
    print(
        f"step: {step_s * 1e3:.1f} ms, of which the mode ~{overhead_s * 1e3:.2f} ms ({100 * overhead_s / step_s:.2f}%)"
    )
    write_result(
        "compat_overhead",
        figure={"name": "step seconds (mode active)", "value": step_s},
        reference={"name": "step seconds less the mode's estimated cost", "value": step_s - overhead_s},
        ratio=ratio,
        params=vars(args),
        calls_per_step=calls,
        seconds_per_call=per_call,
    )
    parallel.destroy()


if __name__ == "__main__":
    main()
