#!/usr/bin/env bash
# Qwen3-30B-A3B with SAO: 2 policy, 2 critic and 4 inference H200 GPUs on one node.
#   bash launch/sao_30b.sh [--dry-run] [--partition P] [--time HH:MM:SS] [--out FILE]
#   bash launch/sao_30b.sh --multi-node   three nodes: inference, policy, a dedicated critic node
# Edit the paths in the config first (checkpoints, inference.model_dir, checkpoint.dir, logging.dir).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
config="$root/examples/configs/qwen3_30b_a3b_sao.yaml"
args=()
for arg in "$@"; do
  if [ "$arg" = "--multi-node" ]; then config="$root/examples/configs/qwen3_30b_a3b_sao_3nodes.yaml"; else args+=("$arg"); fi
done
exec bash "$root/launch/_submit.sh" "$config" "${args[@]}"
