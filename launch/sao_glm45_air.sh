#!/usr/bin/env bash
# GLM-4.5-Air (106B-A12B) with SAO on four H200 nodes: 8 inference GPUs (2 vLLM servers at TP=4),
# 16 policy GPUs (EP=16) on two nodes, a dedicated critic node (EP=8).
#   bash launch/sao_glm45_air.sh [--dry-run] [--partition P] [--time HH:MM:SS] [--out FILE]
# Edit the paths in the config first (checkpoints, inference.model_dir, checkpoint.dir, logging.dir).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
config="$root/examples/configs/glm45_air_sao_4nodes.yaml"

exec bash "$root/launch/_submit.sh" "$config" "$@"
