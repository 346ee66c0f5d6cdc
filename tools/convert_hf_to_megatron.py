"""Convert a Hugging Face model directory into a megatron_rl checkpoint (reshardable on load).

    python tools/convert_hf_to_megatron.py --hf DIR --out DIR [--value-model] [--head-init-std 0.0]

--value-model writes a critic: the backbone plus a value head (read from the HF directory when
it holds value_head.* tensors, otherwise initialised: zeros, or normal with --head-init-std).

The checkpoint keeps the HF tensors' dtype and loads into the local or the TransformerEngine
layer spec at any TP/PP/EP. No model is built: the safetensors are memory-mapped and saved as they
are, so the process needs little more memory than the fused q/k/v of every layer (about 2% of a
Qwen3-30B-A3B checkpoint) whatever the model's size.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hf", required=True, type=Path, help="HF directory (config.json + safetensors)")
    parser.add_argument("--out", required=True, type=Path, help="output checkpoint directory")
    parser.add_argument("--value-model", action="store_true", help="convert into a value model (critic)")
    parser.add_argument("--head-init-std", type=float, default=0.0)
    args = parser.parse_args(argv)

    import megatron_rl.compat  # noqa: F401  (before megatron-core)

    from megatron_rl.conversion.checkpoint_io import CheckpointError
    from megatron_rl.conversion.convert import hf_to_checkpoint
    from megatron_rl.conversion.hf_mapping import ConversionError

    try:
        for line in hf_to_checkpoint(args.hf, args.out, args.value_model, args.head_init_std):
            print(line)
    except (CheckpointError, ConversionError, ValueError) as exc:
        print(f"convert_hf_to_megatron: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
