#!/usr/bin/env bash
# The GPU checks (python -m tests.gpu.check --list says what each one shows): one table, within
# 8 minutes on one H200 (a 450 s budget that every check's limit fits in), the record in
# benchmarks/results/gpu.json (and in $OUT when that is set). With 2 or more GPUs the multi-GPU
# checks (NCCL: DP/TP/EP train step, weight broadcast, expert all-to-all) run last, within a 300 s
# budget of their own; with one GPU they are NOT RUN, "needs 2 GPUs, found 1".
#   bash tests/gpu/run.sh                       every check
#   bash tests/gpu/run.sh --only offload vllm   some
#   bash tests/gpu/run.sh --budget-s 300        start a check only while its limit fits in what is
#                                               left of 300 s (the others: NOT RUN, saying why)
#   bash tests/gpu/run.sh --allow-no-gpu        (or MEGATRON_RL_GPU_CHECKS=skip) on a machine that may
#                                               have no GPU: "SKIPPED ... no CUDA device", exit 0
# Never green on nothing. Exit status: 0 every check run passed (or NOT RUN / BELOW GOAL, with why;
# or the caller's explicit skip above), 1 a check failed, 2 bad arguments, 3 no CUDA device (nothing
# checked), 4 torch not importable by the Python used (nothing checked; the skip does not cover it).
# Python: $PYTHON, else .venv/bin/python, else python3. A .whl/ folder in the checkout (bash
# tests/gpu/wheels.sh) is installed first, for machines whose python3 has CUDA torch but not this
# project's other packages.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root" || exit 1
py="${PYTHON:-}"
if [ -z "$py" ]; then
  if [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
fi
skip=0
[ "${MEGATRON_RL_GPU_CHECKS:-}" = skip ] && skip=1
for arg in "$@"; do [ "$arg" = --allow-no-gpu ] && skip=1; done
# The codes of tests/gpu/check.py (NO_CUDA, NO_TORCH): the same answers before the .whl install.
probe=$("$py" -c '
try:
    import torch
except Exception as exc:
    print(f"{type(exc).__name__}: {exc}")
    raise SystemExit(4)
raise SystemExit(0 if torch.cuda.is_available() else 3)' 2>/dev/null)
probe_rc=$?
if [ "$probe_rc" != 0 ] && [ "$probe_rc" != 3 ]; then
  echo "tests/gpu/run.sh: torch not importable by $py (${probe:-exit $probe_rc}): nothing checked" >&2
  exit 4
fi
if [ "$probe_rc" = 3 ]; then
  if [ "$skip" = 1 ]; then
    echo "tests/gpu/run.sh: SKIPPED as asked (--allow-no-gpu / MEGATRON_RL_GPU_CHECKS=skip): no CUDA device for $py (torch.cuda.is_available() is not True): nothing checked"
    exit 0
  fi
  echo "tests/gpu/run.sh: no CUDA device for $py (torch.cuda.is_available() is not True): nothing checked (exit 3; --allow-no-gpu or MEGATRON_RL_GPU_CHECKS=skip to skip on purpose)" >&2
  exit 3
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
