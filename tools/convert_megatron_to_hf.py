"""Convert a megatron_rl checkpoint back to Hugging Face safetensors + config + tokenizer.

    python tools/convert_megatron_to_hf.py --megatron DIR --out DIR --hf-config DIR

--hf-config is the HF directory whose config.json (and tokenizer files) describe the model.
A value model's head is written as value_head.weight / value_head.bias. The checkpoint may come
from either layer spec (local or TransformerEngine); it is loaded once, in its own dtype, and
written a layer at a time into safetensors shards of at most 4 GiB. A LoRA training checkpoint
step (adapters only) is merged into the base its meta.json names (transforms/lora_export.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--megatron", required=True, type=Path, help="checkpoint from convert_hf_to_megatron.py"
    )
    parser.add_argument("--out", required=True, type=Path, help="output HF directory")
    parser.add_argument("--hf-config", required=True, type=Path, help="HF directory with config.json")
    args = parser.parse_args(argv)

    import megatron_rl.compat  # noqa: F401  (before megatron-core)

    from megatron_rl.conversion.checkpoint_io import CheckpointError
    from megatron_rl.conversion.hf_mapping import ConversionError
    from megatron_rl.transforms.lora_export import export_hf

    try:
        for line in export_hf(args.megatron, args.out, args.hf_config):
            print(line)
    except (CheckpointError, ConversionError, ValueError) as exc:
        print(f"convert_megatron_to_hf: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
