#!/usr/bin/env bash
# The GPU checks (python -m tests.gpu.check --list says what each one shows): one table, within
# 8 minutes on one H200 (a 450 s budget that every check's limit fits in), the record in
# benchmarks/results/gpu.json (and in $OUT when that is set).
#   bash tests/gpu/run.sh                       every check
#   bash tests/gpu/run.sh --only offload vllm   some
#   bash tests/gpu/run.sh --budget-s 300        start a check only while its limit fits in what is
#                                               left of 300 s (the others: NOT RUN, saying why)
# Without CUDA it says so and exits 0, claiming nothing. Python: $PYTHON, else .venv/bin/python,
# else python3. A .whl/ folder in the checkout (bash tests/gpu/wheels.sh) is installed first, for
# machines whose python3 has CUDA torch but not this project's other packages.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root" || exit 1
py="${PYTHON:-}"
if [ -z "$py" ]; then
  if [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
fi
if ! "$py" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; then
  echo "tests/gpu/run.sh: no CUDA device for $py (torch.cuda.is_available() is not True): nothing checked"
  exit 0
fi
if compgen -G ".whl/*.whl" >/dev/null; then
  site="${TMPDIR:-/tmp}/megatron_rl_gpu_site"
  echo "tests/gpu/run.sh: installing .whl/*.whl into $site"
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl \
    || { echo "tests/gpu/run.sh: installing .whl/*.whl failed" >&2; exit 1; }
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
"$py" -m tests.gpu.check "$@"; rc=$?
if [ -n "${OUT:-}" ] && [ -d "$OUT" ] && [ -f benchmarks/results/gpu.json ]; then
  cp benchmarks/results/gpu.json "$OUT/gpu.json"
fi
exit "$rc"
