"""Build a tiny random Hugging Face model and a local tokenizer (no download); see
megatron_rl/models/tiny.py.

    python tools/make_tiny_model.py --family qwen3|qwen3_moe|llama --out DIR [--seed 0]
        [--hidden-size 64] [--layers 2] [--vocab-size 512] [--tokenizer bpe|char|char-tool] [--tied]
"""

import sys

from megatron_rl.models.tiny import main

if __name__ == "__main__":
    sys.exit(main())
