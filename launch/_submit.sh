#!/usr/bin/env bash
# Shared by launch/*_30b.sh: render the config's sbatch script with `megatron-rl slurm` and submit it.
#   bash launch/_submit.sh CONFIG [--dry-run] [megatron-rl slurm options, e.g. --partition p --time 24:00:00]
# --dry-run renders only (the script lands in the config's logging.dir unless --out is given).
# The Python that runs `megatron-rl`: $MEGATRON_RL_PYTHON, else .venv/bin/python, else python3.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
config="$1"
shift
submit=(--submit)
args=()
for arg in "$@"; do
  if [ "$arg" = "--dry-run" ]; then submit=(); else args+=("$arg"); fi
done
python="${MEGATRON_RL_PYTHON:-$root/.venv/bin/python}"
[ -x "$python" ] || python="python3"
exec "$python" -m megatron_rl.launch.cli slurm "$config" "${submit[@]}" "${args[@]}"
