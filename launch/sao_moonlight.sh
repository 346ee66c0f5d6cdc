#!/usr/bin/env bash
# Moonlight-16B-A3B with SAO on one H200 node: 4 inference GPUs (4 vLLM servers at TP=1),
# 2 policy GPUs (EP=2) and 2 critic GPUs (EP=2).
#   bash launch/sao_moonlight.sh [--dry-run] [--partition P] [--time HH:MM:SS] [--out FILE]
# Edit the paths in the config first (checkpoints, inference.model_dir, checkpoint.dir, logging.dir),
# and check its header's note on the tokenizer.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
config="$root/examples/configs/moonlight_16b_a3b_sao_1node.yaml"

exec bash "$root/launch/_submit.sh" "$config" "$@"
