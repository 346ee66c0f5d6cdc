"""A short supervised warm start of a tiny HF model on a procedural task's format (CPU); see
megatron_rl/demo/warm_start.py.

    python tools/sft_warm_start.py --model DIR --out DIR [--task reverse] [--steps 80] [--lr 3e-3]
"""

import sys

from megatron_rl.demo.warm_start import main

if __name__ == "__main__":
    sys.exit(main())
