#!/usr/bin/env bash
# Downloads into .whl/ (ignored by git) the wheels tests/gpu/run.sh needs on a GPU machine whose
# python3 has CUDA torch but no network and none of: megatron-core, pydantic, msgspec, pyzmq (the
# developers' lent H200: Python 3.12, torch 2.11). Versions are those of this checkout's .venv.
#   bash tests/gpu/wheels.sh            for Python 3.12
#   GPU_PYTHON=3.11 bash tests/gpu/wheels.sh
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
bash scripts/ensure_venv.sh >/dev/null
pins=$(.venv/bin/python - <<'PY'
from importlib.metadata import version
names = ["megatron-core", "pydantic", "pydantic-core", "annotated-types", "typing-inspection", "msgspec", "pyzmq"]
print(" ".join(f"{n}=={version(n)}" for n in names))
PY
)
rm -rf .whl && mkdir .whl
platforms=()
for p in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_24_x86_64 manylinux_2_26_x86_64 \
         manylinux_2_27_x86_64 manylinux_2_28_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64; do
  platforms+=(--platform "$p")
done
# shellcheck disable=SC2086  (pins is a list of requirements)
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version "${GPU_PYTHON:-3.12}" \
  --implementation cp "${platforms[@]}" -d .whl $pins
ls -l .whl
du -sh .whl
