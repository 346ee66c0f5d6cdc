#!/usr/bin/env bash
# Per-module line coverage of megatron_rl over the whole suite (both groups, as tests/run.sh runs
# them), every process the tests start included (ranks, torchrun groups, vLLM's workers, the
# roles of `megatron-rl run`): pyproject.toml's [tool.coverage.run].
#   bash scripts/coverage.sh OUT [pytest selection]     -> OUT/coverage.json, OUT/modules.json
#   python scripts/coverage_compare.py BEFORE/modules.json AFTER/modules.json
# Slower than tests/run.sh (every Python process traces its lines): not a timing run.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${1:?usage: bash scripts/coverage.sh OUT [pytest selection]}"; shift
mkdir -p "$out" && out="$(cd "$out" && pwd)"
rm -f "$out"/.coverage "$out"/.coverage.*
bash "$root/scripts/ensure_venv.sh" --cpu || exit 1
cd "$root"
export MEGATRON_RL_COVERAGE_DIR="$out" PYTHONHASHSEED=0 OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
py="$root/.venv/bin/python"
if [ "$#" -eq 0 ]; then
  # As tests/run.sh runs them: on MEGATRON_RL_TEST_WORKERS xdist workers (each measures itself).
  workers=(-n "${MEGATRON_RL_TEST_WORKERS:-2}" --dist loadgroup)
  "$py" -m coverage run -m pytest -q "${workers[@]}" -m "not slow" tests; rc_fast=$?
  "$py" -m coverage run -m pytest -q "${workers[@]}" -m "slow" tests; rc_slow=$?
  rc=$(( rc_fast != 0 ? rc_fast : rc_slow ))
else
  "$py" -m coverage run -m pytest -q "$@"; rc=$?
fi
"$py" -m coverage combine -q
"$py" -m coverage json -q -o "$out/coverage.json"
"$py" "$root/scripts/coverage_compare.py" --modules "$out/coverage.json" > "$out/modules.json"
echo "scripts/coverage.sh: pytest exit $rc; per-module figures in $out/modules.json"
exit "$rc"
