#!/usr/bin/env bash
# Qwen3-30B-A3B with PPO: 2 policy, 2 critic and 4 inference H200 GPUs on one node.
#   bash launch/ppo_30b.sh [--dry-run] [--partition P] [--time HH:MM:SS] [--out FILE]

# Edit the paths in the config first (checkpoints, inference.model_dir, checkpoint.dir, logging.dir).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
config="$root/examples/configs/qwen3_30b_a3b_ppo.yaml"

exec bash "$root/launch/_submit.sh" "$config" "$@"
