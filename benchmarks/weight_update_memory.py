"""Memory a vLLM worker holds while a Qwen3-MoE weight update streams in over path (b).

A random Qwen3-MoE (`--layers` each of 2, 4, 8 by default) is published from policy ranks at
EP = 2, PP = 2 and PP = 2 x EP = 2 over gloo into the real WeightReceiverExtension around vLLM's
own model and in-place layer-wise reload, in-process on CPU (tests/support/vllm_worker.py).
Figure: the largest total of bytes the receiver holds at once (received but not yet consumed by
the model, bucket memory kept alive by views included), measured from outside the extension by
a dispatch-mode allocation tracker; reference: the model's bytes; ratio = figure / reference.
Also printed: the figure in decoder layers (the largest layer's bytes). Writes benchmarks/results/weight_update_memory.json.

    python benchmarks/weight_update_memory.py [--layers 2 4 8] [--hidden-size 64] [--bucket-kb 16]
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

import _checkout  # noqa: F401  (tests/support importable)
from _results import write_result  # benchmarks/ is on sys.path when run as a script

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = [(1, 2), (2, 1), (2, 2)]


def largest_layer_bytes(state) -> int:
    sizes: dict[str, int] = {}
    for name, tensor in state.items():
        match = re.match(r"model\.layers\.(\d+)\.", name)
        if match:
            sizes[match.group(1)] = sizes.get(match.group(1), 0) + tensor.numel() * tensor.element_size()
    return max(sizes.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--bucket-kb", type=int, default=16)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from megatron_rl.models.tiny import make_tiny_model
    from tests.support.vllm_worker import measure_updates

    bucket_bytes = args.bucket_kb << 10
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for layers in args.layers:
            hf_dir = make_tiny_model(
                "qwen3_moe", Path(tmp) / f"hf{layers}", seed=5, hidden_size=args.hidden_size, layers=layers,
                vocab_size=64, tokenizer="char",
            )  # fmt: skip
            layouts = [(pp, ep) for pp, ep in LAYOUTS if layers % pp == 0]
            for update in measure_updates(
                hf_dir, layouts, bucket_bytes, Path(tmp) / f"worker{layers}", fresh=False
            ):
                model_bytes = sum(t.numel() * t.element_size() for t in update.state.values())
                layer = largest_layer_bytes(update.state)
                peak = update.record["peak_held_bytes"]
                rows.append(
                    {
                        "layers": layers, "pp": update.pp, "ep": update.ep, "model_bytes": model_bytes,
                        "layer_bytes": layer, "peak_held_bytes": peak,
                        "fraction_of_model": peak / model_bytes, "layers_held": peak / layer,
                        "layer_plus_bucket_fraction": (layer + bucket_bytes) / model_bytes,
                    }
                )  # fmt: skip
    print(f"{'layers':>6} {'pp':>3} {'ep':>3} {'model B':>9} {'layer B':>8} {'peak held B':>11} "
          f"{'of model':>8} {'in layers':>9}")  # fmt: skip
    for r in rows:
        print(f"{r['layers']:>6} {r['pp']:>3} {r['ep']:>3} {r['model_bytes']:>9} {r['layer_bytes']:>8} "
              f"{r['peak_held_bytes']:>11} {r['fraction_of_model']:>8.3f} {r['layers_held']:>9.2f}")  # fmt: skip
    worst = max(rows, key=lambda r: r["fraction_of_model"] / r["layer_plus_bucket_fraction"])
    path = write_result(
        "weight_update_memory",
        figure=worst["fraction_of_model"],
        reference=worst["layer_plus_bucket_fraction"],
        ratio=worst["fraction_of_model"] / worst["layer_plus_bucket_fraction"],
        params={
            "layers": args.layers,
            "hidden_size": args.hidden_size,
            "bucket_bytes": bucket_bytes,
            "layouts": LAYOUTS,
        },  # fmt: skip
        rows=rows,
        note="figure: peak held bytes / model bytes of the worst update; reference: (largest layer + one "
        "bucket) / model bytes of that update",
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
