#!/usr/bin/env bash
# Downloads into .whl/ (ignored by git) the wheels tests/gpu/run.sh needs on a GPU machine whose
# python3 has CUDA torch but no network and none of: megatron-core, pydantic, msgspec, pyzmq (the
# developers' lent H200: Python 3.12, torch 2.11). Versions are those of this checkout's .venv.
# Into .whl/te-build/ (which run.sh does not install) it puts transformer-engine-torch's sdist and
# what its build imports (setuptools, wheel, packaging, ninja), for the real compile there:
#   bash tests/gpu/wheels.sh            for Python 3.12
#   GPU_PYTHON=3.11 bash tests/gpu/wheels.sh
#   bash tests/gpu/wheels.sh --build-te   on the GPU machine, offline: what ensure_venv.sh --gpu does
#                                         before and for the build (scripts/gpu_build_env.py: the driver,
#                                         a CUDA 13 toolkit, cuDNN/NCCL headers from torch's wheels), then
#                                         transformer-engine-torch compiled against $PYTHON's (else
#                                         python3's) torch into $OUT/te-build (else $TMPDIR); exit 1 if not
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
te_dir=.whl/te-build

if [ "${1:-}" = --build-te ]; then
  py="${PYTHON:-python3}"
  sdists=("$te_dir"/transformer_engine_torch-*.tar.gz)
  if [ ! -f "${sdists[0]}" ]; then
    echo "tests/gpu/wheels.sh --build-te: no transformer_engine_torch sdist in $te_dir: run" \
      "bash tests/gpu/wheels.sh on a machine with network first" >&2
    exit 2
  fi
  helper=("$py" scripts/gpu_build_env.py)
  "${helper[@]}" driver
  cuda_home="$("${helper[@]}" toolkit)"
  site="$("$py" -c 'import pathlib, torch; print(pathlib.Path(torch.__file__).resolve().parent.parent)')"
  build_env="$(CUDA_HOME="$cuda_home" "${helper[@]}" build-env --site-packages "$site")"
  echo "tests/gpu/wheels.sh --build-te: building ${sdists[0]} against $site with:"
  echo "$build_env"
  tools="${TMPDIR:-/tmp}/megatron_rl_te_build_tools"
  out="${OUT:-${TMPDIR:-/tmp}}/te-build"
  "$py" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$tools" "$te_dir"/*.whl
  began=$(date +%s)
  (
    eval "$build_env"
    export PYTHONPATH="$tools${PYTHONPATH:+:$PYTHONPATH}" PATH="$tools/bin:$PATH"
    "$py" -m pip wheel -q --no-index --no-deps --no-build-isolation -w "$out" "${sdists[0]}"
  )
  torch_version="$("$py" -c 'import torch; print(torch.__version__)')"
  echo "tests/gpu/wheels.sh --build-te: built $(ls "$out"/transformer_engine_torch-*.whl) against torch" \
    "$torch_version in $(($(date +%s) - began)) s; at run time a venv's .pth would set:"
  "${helper[@]}" runtime-env --site-packages "$site"
  exit 0
fi

bash scripts/ensure_venv.sh >/dev/null
pins=$(.venv/bin/python - <<'PY'
from importlib.metadata import version
names = ["megatron-core", "pydantic", "pydantic-core", "annotated-types", "typing-inspection", "msgspec", "pyzmq"]
print(" ".join(f"{n}=={version(n)}" for n in names))
PY
)
build_tools=$(.venv/bin/python - <<'PY'
from importlib.metadata import version
print(" ".join(f"{n}=={version(n)}" for n in ["setuptools", "packaging", "ninja"]), "wheel==0.48.0")
PY
)
rm -rf .whl && mkdir -p "$te_dir"
platforms=()
for p in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_24_x86_64 manylinux_2_26_x86_64 \
         manylinux_2_27_x86_64 manylinux_2_28_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64; do
  platforms+=(--platform "$p")
done
download=(.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version "${GPU_PYTHON:-3.12}"
  --implementation cp "${platforms[@]}")
# shellcheck disable=SC2086 # pins and build_tools are lists of requirements
"${download[@]}" -d .whl $pins
# shellcheck disable=SC2086
"${download[@]}" -d "$te_dir" $build_tools
# The sdist as the index serves it: `pip download` would prepare its metadata, installing torch to run setup.py.
te_version="$(.venv/bin/python scripts/check_gpu_env.py --te-version)"
.venv/bin/python - "$te_dir" "$te_version" <<'PY'
import os
import runpy
import sys
from pathlib import Path

check = runpy.run_path("scripts/check_gpu_env.py", run_name="check_gpu_env")
index = check["Index"](os.environ.get("PIP_INDEX_URL", check["PYPI"]), 60)
name = f"transformer_engine_torch-{sys.argv[2]}.tar.gz"
(url,) = [f["url"] for f in index.files("transformer-engine-torch") if f["filename"] == name]
data, _ = index.get(url)
(Path(sys.argv[1]) / name).write_bytes(data)
PY
ls -l .whl "$te_dir"
du -sh .whl
