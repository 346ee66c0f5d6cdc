"""Peak memory of the checkpoint converters against the size of the checkpoint they convert.

Builds a random HF Qwen3-MoE model (float32 or bfloat16), then runs tools/convert_hf_to_megatron.py
and tools/convert_megatron_to_hf.py each in its own process, sampling that process's anonymous
memory (RssAnon: its own allocations; memory-mapped safetensors pages are file-backed and not
counted) from after the imports to the end. Figure: peak extra anonymous bytes of each
direction; reference: the HF checkpoint's bytes; ratio = figure / reference. Writes
benchmarks/results/conversion_memory.json.

    python benchmarks/conversion_memory.py [--hidden-size 1024] [--layers 4] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import runpy
import subprocess
import sys
import tempfile
from pathlib import Path

import _checkout  # noqa: F401  (tests/support importable)

ROOT = Path(__file__).resolve().parents[1]


def measure_child(tool: str, args: list[str]) -> None:
    """In the child: the heavy imports first, then the tool under the sampler; prints JSON."""
    import megatron_rl.compat  # noqa: F401  (before megatron-core)

    import megatron_rl.conversion.convert  # noqa: F401  (what the tool imports: not part of the figure)
    from tests.support.process_memory import peak_anonymous_memory

    sys.argv = [tool, *args]
    with peak_anonymous_memory() as memory:
        try:
            runpy.run_path(str(ROOT / "tools" / tool), run_name="__main__")
        except SystemExit as exit_:
            if exit_.code:
                raise
    print(json.dumps({"extra": memory.extra, "baseline": memory.baseline}))


def run_measured(tool: str, *args) -> dict:
    result = subprocess.run(
        [sys.executable, __file__, "--child", tool, *map(str, args)], capture_output=True, text=True
    )
    if result.returncode:
        raise RuntimeError(f"{tool} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def make_model(directory: Path, hidden_size: int, layers: int, dtype: str) -> int:
    """A random Qwen3-MoE HF directory; returns its safetensors bytes."""
    import torch
    from safetensors.torch import load_file, save_file

    from megatron_rl.models.tiny import make_tiny_model

    make_tiny_model("qwen3_moe", directory, seed=0, hidden_size=hidden_size, layers=layers, tokenizer="char")
    if dtype == "bfloat16":
        state = {k: v.to(torch.bfloat16) for k, v in load_file(directory / "model.safetensors").items()}
        save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
        config = json.loads((directory / "config.json").read_text())
        config["torch_dtype"] = "bfloat16"
        (directory / "config.json").write_text(json.dumps(config))
    return (directory / "model.safetensors").stat().st_size


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        measure_child(sys.argv[2], sys.argv[3:])
        return
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hidden-size", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        checkpoint_bytes = make_model(work / "hf", args.hidden_size, args.layers, args.dtype)
        to_megatron = run_measured("convert_hf_to_megatron.py", "--hf", work / "hf", "--out", work / "mg")
        to_hf = run_measured(
            "convert_megatron_to_hf.py",
            "--megatron",
            work / "mg",
            "--out",
            work / "back",
            "--hf-config",
            work / "hf",
        )
    rows = {"hf_to_megatron": to_megatron["extra"], "megatron_to_hf": to_hf["extra"]}
    print(f"{'direction':<16} {'peak extra MiB':>15} {'checkpoint MiB':>15} {'ratio':>7}")
    for name, extra in rows.items():
        print(
            f"{name:<16} {extra / 2**20:>15.1f} {checkpoint_bytes / 2**20:>15.1f} {extra / checkpoint_bytes:>7.2f}"
        )
    sys.path.insert(0, str(Path(__file__).parent))
    from _results import write_result

    path = write_result(
        "conversion_memory",
        figure=rows,
        reference=checkpoint_bytes,
        ratio=max(rows.values()) / checkpoint_bytes,
        params=vars(args),
        ratios={name: extra / checkpoint_bytes for name, extra in rows.items()},
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
