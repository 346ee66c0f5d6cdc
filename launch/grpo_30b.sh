#!/usr/bin/env bash
# Qwen3-30B-A3B with GRPO: 2 policy and 6 inference H200 GPUs on one node, no critic.
#   bash launch/grpo_30b.sh [--dry-run] [--partition P] [--time HH:MM:SS] [--out FILE]

# Edit the paths in the config first (checkpoints, inference.model_dir, checkpoint.dir, logging.dir).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
config="$root/examples/configs/qwen3_30b_a3b_grpo.yaml"

exec bash "$root/launch/_submit.sh" "$config" "$@"
