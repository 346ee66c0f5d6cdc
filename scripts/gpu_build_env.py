#!/usr/bin/env python3
"""What the GPU install needs from the machine, and the environment it builds and runs TransformerEngine in.

    python scripts/gpu_build_env.py driver                   the NVIDIA driver runs CUDA 13 (R580+)? exit 0 / 1
    python scripts/gpu_build_env.py driver --output 570.172.08   judge a given nvidia-smi answer
    python scripts/gpu_build_env.py toolkit                  the CUDA 13 toolkit the build uses; exit 0 / 1
    python scripts/gpu_build_env.py build-env --site-packages SP     `export` lines for the build
    python scripts/gpu_build_env.py runtime-env --site-packages SP [--write-pth]
    python scripts/gpu_build_env.py check-import --site-packages SP  after the install (GPU machine)

scripts/ensure_venv.sh --gpu and tests/gpu/wheels.sh --build-te call these, in this order, so that
the checks, the include directories and the variables are the same in both. Standard library only:
`driver` and `toolkit` run before the venv exists. Why each variable (TransformerEngine 2.11's
sources, docs/gpu/install.md):

- CPATH: transformer-engine-torch's sources include cudnn.h and nccl.h, which no CUDA toolkit ships;
  its build adds only the toolkit's include directory. torch's pinned wheels install both headers
  (nvidia-cudnn-cu13: nvidia/cudnn/include, nvidia-nccl-cu13: nvidia/nccl/include).
- CUDA_HOME: TE's build reads nvcc's version and the toolkit's include directory from it; a CUDA 12
  toolkit would compile against other headers than torch's CUDA 13.
- NVTE_NO_LOCAL_VERSION=1: else TE appends "+<git hash>" when the build directory lies inside a git
  checkout, and its import asserts equal versions of the extension and the core wheel.
- NVTE_PYTORCH_FORCE_BUILD=TRUE: else setup.py first downloads a prebuilt wheel from GitHub with no
  timeout (none exists for torch 2.13), which hangs on a firewalled node.
- at run time CUDNN_HOME, NVRTC_HOME, CURAND_HOME, NVTE_CUDA_INCLUDE_DIR: TE's loader takes cuDNN,
  NVRTC and cuRAND from <LIB>_HOME first, then CUDA_HOME and /usr/local/cuda, and only last from
  the pip wheels; NVRTC compiles against NVTE_CUDA_INCLUDE_DIR first. These name torch's pip CUDA 13
  files, through a .pth file in the venv (a value set in the environment wins).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

MIN_DRIVER_MAJOR = 580  # CUDA 13.0's minimum Linux driver (NVIDIA's CUDA 13.0 release notes)
CUDA_MAJOR = 13  # torch 2.13.0 from PyPI, vLLM 0.32's pin: +cu130
DRIVER_QUERY = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
DEFAULT_TOOLKIT = Path("/usr/local/cuda")
# Headers no CUDA toolkit ships; torch's nvidia-cudnn-cu13 / nvidia-nccl-cu13 wheels do.
REQUIRED_HEADERS = {"cudnn": "cudnn.h", "nccl": "nccl.h"}
# The libraries TE's loader looks up by name (<NAME>_HOME, transformer_engine/common/__init__.py),
# each with the folder under site-packages/nvidia where torch's CUDA 13 wheels put it.
LOADER_LIBRARIES = {"cudnn": "cudnn", "nvrtc": f"cu{CUDA_MAJOR}", "curand": f"cu{CUDA_MAJOR}"}
# CUDA libraries torch and TE map; after the install each must come from site-packages/nvidia.
# (NCCL's network and tuner plug-ins, libnccl-net.so and the like, are the system's by design.)
CUDA_LIBRARY_FILE = re.compile(
    r"^lib(cudnn(_[a-z_]+)?|nvrtc(-builtins)?|curand|cudart|cublas(Lt)?|nccl)\.so(\.[0-9.]+)?$"
)
PTH_NAME = "megatron_rl_cuda_libs.pth"


class Refused(Exception):
    """The machine or environment cannot build or run the GPU environment; the message says why."""


# --- the driver ---------------------------------------------------------------------------------


def driver_versions(nvidia_smi_output: str) -> list[str]:
    """The driver version of every GPU in `nvidia-smi --query-gpu=driver_version` output, one a line."""
    lines = [line.strip() for line in nvidia_smi_output.splitlines() if line.strip()]
    query = " ".join(DRIVER_QUERY)
    if not lines:
        raise Refused(f"`{query}` listed no GPU (empty output): no driver version to check")
    for line in lines:
        if not re.fullmatch(r"\d+(\.\d+)+", line):
            raise Refused(
                f"could not read a driver version from `{query}`: {line!r} is not a version such as "
                f"580.65.06; CUDA {CUDA_MAJOR} needs driver R{MIN_DRIVER_MAJOR} or newer"
            )
    return lines


def driver_verdict(nvidia_smi_output: str) -> str:
    """The line saying the driver runs CUDA 13, or Refused naming the version found and the one needed."""
    versions = driver_versions(nvidia_smi_output)
    oldest = min(versions, key=lambda version: tuple(int(part) for part in version.split(".")))
    if int(oldest.split(".")[0]) < MIN_DRIVER_MAJOR:
        raise Refused(
            f"NVIDIA driver {oldest} is too old for CUDA {CUDA_MAJOR} (torch 2.13.0+cu130, vLLM 0.32): "
            f"it needs driver R{MIN_DRIVER_MAJOR} or newer (nvidia-smi reports {', '.join(versions)}); "
            "upgrade the driver"
        )
    return f"NVIDIA driver {oldest}: runs CUDA {CUDA_MAJOR} (R{MIN_DRIVER_MAJOR} or newer)"


def query_driver(nvidia_smi: str = "nvidia-smi") -> str:
    """nvidia-smi's answer to the driver-version query; Refused when nvidia-smi is missing or fails."""
    found = shutil.which(nvidia_smi)
    if found is None:
        raise Refused(
            f"{nvidia_smi} not found on PATH: the GPU install needs an NVIDIA driver "
            f"R{MIN_DRIVER_MAJOR} or newer (CUDA {CUDA_MAJOR}) and its nvidia-smi"
        )
    try:
        proc = subprocess.run([found, *DRIVER_QUERY[1:]], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired as exc:
        raise Refused(f"`{found} {' '.join(DRIVER_QUERY[1:])}` did not answer within 60 s") from exc
    if proc.returncode != 0:
        said = (proc.stderr.strip() or proc.stdout.strip() or "no output")[:500]
        raise Refused(f"`{found} {' '.join(DRIVER_QUERY[1:])}` exited {proc.returncode}: {said}")
    return proc.stdout


# --- the CUDA toolkit ---------------------------------------------------------------------------


def find_nvcc(environ: Mapping[str, str], default_toolkit: Path = DEFAULT_TOOLKIT) -> Path:
    """The nvcc TE's build uses, in its order (build_tools/utils.py nvcc_path): $CUDA_HOME/bin/nvcc,
    else nvcc on PATH, else /usr/local/cuda/bin/nvcc; Refused when that file does not exist."""
    if environ.get("CUDA_HOME"):
        nvcc = Path(environ["CUDA_HOME"]) / "bin" / "nvcc"
        where = f"CUDA_HOME={environ['CUDA_HOME']}"
    else:
        on_path = shutil.which("nvcc", path=environ.get("PATH", ""))
        nvcc = Path(on_path) if on_path else default_toolkit / "bin" / "nvcc"
        where = "nvcc on PATH" if on_path else f"{default_toolkit} (no CUDA_HOME, no nvcc on PATH)"
    if not nvcc.is_file():
        raise Refused(
            f"no CUDA toolkit: {nvcc} does not exist ({where}). Building transformer-engine-torch needs a "
            f"CUDA {CUDA_MAJOR} toolkit (nvcc and its headers): set CUDA_HOME to one, e.g. "
            f"CUDA_HOME=/usr/local/cuda-{CUDA_MAJOR}.0, or put its bin/ first on PATH"
        )
    return nvcc


def nvcc_release(nvcc: Path) -> tuple[int, int]:
    """(major, minor) from `nvcc --version` ("Cuda compilation tools, release 13.0, V13.0.88")."""
    try:
        proc = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise Refused(f"could not run {nvcc} --version: {exc}") from exc
    match = re.search(r"release\s+(\d+)\.(\d+)", proc.stdout)
    if proc.returncode != 0 or match is None:
        said = (proc.stdout.strip() or proc.stderr.strip() or "no output")[:300]
        raise Refused(f"{nvcc} --version (exit {proc.returncode}) names no CUDA release: {said}")
    return int(match.group(1)), int(match.group(2))


def cuda_toolkit(environ: Mapping[str, str], default_toolkit: Path = DEFAULT_TOOLKIT) -> tuple[Path, str]:
    """(the toolkit's root, its release "13.0"): TE's nvcc, required to be CUDA 13 with its headers."""
    nvcc = find_nvcc(environ, default_toolkit)
    major, minor = nvcc_release(nvcc)
    root = nvcc.resolve().parent.parent if not environ.get("CUDA_HOME") else Path(environ["CUDA_HOME"])
    if major != CUDA_MAJOR:
        raise Refused(
            f"{nvcc} is CUDA {major}.{minor}; transformer-engine-torch must be compiled with a CUDA "
            f"{CUDA_MAJOR} toolkit, as torch 2.13.0+cu130 is: set CUDA_HOME to a CUDA {CUDA_MAJOR} toolkit "
            f"(e.g. CUDA_HOME=/usr/local/cuda-{CUDA_MAJOR}.0)"
        )
    if not (root / "include" / "cuda_runtime.h").is_file():
        # TE's build would look for the headers there too (CUDA_HOME/include, or nvcc's ../include).
        raise Refused(
            f"{nvcc} (CUDA {major}.{minor}) lies in {root}, which has no include/cuda_runtime.h (a wrapper "
            f"script, or a toolkit without headers?): set CUDA_HOME to the CUDA {CUDA_MAJOR} toolkit's root, "
            f"e.g. CUDA_HOME=/usr/local/cuda-{CUDA_MAJOR}.0"
        )
    return root, f"{major}.{minor}"


# --- the build's and the runtime's environment --------------------------------------------------


def wheel_include_dirs(site_packages: Path) -> list[Path]:
    """Every site-packages/nvidia/*/include that exists: cuDNN's and NCCL's first (the headers a
    toolkit lacks), then the others by name. Nothing for a folder without include/."""
    nvidia = site_packages / "nvidia"
    if not nvidia.is_dir():
        return []
    first = [nvidia / name / "include" for name in REQUIRED_HEADERS]
    others = sorted(path / "include" for path in nvidia.iterdir() if path.name not in REQUIRED_HEADERS)
    return [path for path in first + others if path.is_dir()]


def build_environment(site_packages: Path, cuda_home: Path, environ: Mapping[str, str]) -> dict[str, str]:
    """The variables to build transformer-engine-torch with; Refused naming any header it would miss."""
    include_dirs = wheel_include_dirs(site_packages)
    missing = [
        f"{site_packages / 'nvidia' / package / 'include' / header} (nvidia-{package}-cu{CUDA_MAJOR})"
        for package, header in REQUIRED_HEADERS.items()
        if not (site_packages / "nvidia" / package / "include" / header).is_file()
    ]
    if missing:
        raise Refused(
            "TransformerEngine's torch extension includes cudnn.h and nccl.h, which torch's wheels "
            f"install; missing: {', '.join(missing)}. Is torch 2.13.0 (CUDA {CUDA_MAJOR}, from PyPI) "
            f"installed in {site_packages}?"
        )
    cpath = [str(path) for path in include_dirs]
    if environ.get("CPATH"):
        cpath.append(environ["CPATH"])
    return {
        "CUDA_HOME": str(cuda_home),
        "CPATH": ":".join(cpath),
        "NVTE_FRAMEWORK": "pytorch",
        "NVTE_NO_LOCAL_VERSION": "1",
        "NVTE_PYTORCH_FORCE_BUILD": "TRUE",
    }


def runtime_environment(site_packages: Path) -> dict[str, str]:
    """The variables that make TE's loader take torch's pip CUDA 13 libraries and headers; Refused
    naming a library or header the venv lacks."""
    nvidia = site_packages / "nvidia"
    env, missing = {}, []
    for library, folder in LOADER_LIBRARIES.items():
        home = nvidia / folder
        if sorted((home / "lib").glob(f"lib{library}.so.*")):
            env[f"{library.upper()}_HOME"] = str(home)
        else:
            missing.append(f"{home / 'lib'}/lib{library}.so.*")
    include = nvidia / f"cu{CUDA_MAJOR}" / "include"
    if (include / "cuda_runtime.h").is_file():
        env["NVTE_CUDA_INCLUDE_DIR"] = str(include)
    else:
        missing.append(str(include / "cuda_runtime.h"))
    if missing:
        raise Refused(
            f"torch's CUDA {CUDA_MAJOR} wheels are incomplete in {site_packages}: missing {', '.join(missing)}"
        )
    return env


def pth_text(runtime_env: Mapping[str, str]) -> str:
    """A .pth file that sets runtime_env in every interpreter of the venv, unless already set."""
    pairs = ", ".join(f"({name!r}, {value!r})" for name, value in runtime_env.items())
    return (
        "# Written by scripts/ensure_venv.sh --gpu (scripts/gpu_build_env.py). TransformerEngine's loader\n"
        "# takes cuDNN, NVRTC and cuRAND from <LIB>_HOME before CUDA_HOME and /usr/local/cuda, and NVRTC's\n"
        "# headers from NVTE_CUDA_INCLUDE_DIR first: these name torch's pip CUDA libraries in this venv.\n"
        "# A value already set in the environment wins.\n"
        f"import os; [os.environ.setdefault(name, value) for name, value in ({pairs},)]\n"
    )


def exports(env: Mapping[str, str]) -> str:
    """`export NAME=value` lines, quoted for a POSIX shell."""
    return "".join(f"export {name}={shlex.quote(value)}\n" for name, value in env.items())


# --- what got loaded ----------------------------------------------------------------------------


def loaded_cuda_libraries(proc_maps: str) -> list[Path]:
    """The CUDA library files (cuDNN, NVRTC, cuRAND, cudart, cuBLAS, NCCL) mapped in /proc/PID/maps text."""
    paths = set()
    for line in proc_maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/") and CUDA_LIBRARY_FILE.match(Path(fields[5]).name):
            paths.add(Path(fields[5]))
    return sorted(paths)


def foreign_libraries(loaded: list[Path], site_packages: Path) -> list[Path]:
    """Those of `loaded` that are not torch's wheels' files under site_packages/nvidia."""
    nvidia = (site_packages / "nvidia").resolve()
    return [path for path in loaded if not path.resolve().is_relative_to(nvidia)]


def check_import(site_packages: Path) -> list[str]:
    """Imports torch, transformer_engine.pytorch and vllm on the GPU machine; the lines to print.
    Refused when CUDA is unusable or a CUDA library was loaded from outside the venv's wheels."""
    import torch
    import transformer_engine
    import transformer_engine.pytorch  # noqa: F401  (loads TE's core library and its CUDA libraries)
    import vllm

    if not torch.cuda.is_available():
        raise Refused("torch.cuda.is_available() is False after the install")
    torch.zeros(1, device="cuda")
    loaded = loaded_cuda_libraries(Path("/proc/self/maps").read_text())
    foreign = foreign_libraries(loaded, site_packages)
    lines = [
        f"torch {torch.__version__} (CUDA {torch.version.cuda}), vllm {vllm.__version__}, "
        f"transformer_engine {transformer_engine.__version__}: importable, CUDA available",
        f"NVTE_CUDA_INCLUDE_DIR={os.environ.get('NVTE_CUDA_INCLUDE_DIR', '<unset>')}",
        *(f"loaded {path}" for path in loaded),
    ]
    if foreign:
        raise Refused(
            "\n".join(lines) + "\nloaded from outside torch's CUDA wheels in "
            f"{site_packages / 'nvidia'}: {', '.join(map(str, foreign))}; TE's loader prefers "
            f"<LIB>_HOME, CUDA_HOME and /usr/local/cuda ({PTH_NAME} sets the first)"
        )
    return lines


# --- the command line ---------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    driver = commands.add_parser("driver", help="the driver runs CUDA 13 (R580 or newer)")
    driver.add_argument("--output", help="judge this nvidia-smi output instead of asking nvidia-smi")
    commands.add_parser("toolkit", help="the CUDA 13 toolkit the build uses (prints its root)")
    for name in ("build-env", "runtime-env", "check-import"):
        command = commands.add_parser(name)
        command.add_argument("--site-packages", type=Path, required=True)
        if name == "runtime-env":
            command.add_argument("--write-pth", action="store_true", help=f"write SITE_PACKAGES/{PTH_NAME}")
    args = parser.parse_args(argv)
    try:
        if args.command == "driver":
            print(driver_verdict(args.output if args.output is not None else query_driver()))
        elif args.command == "toolkit":
            root, release = cuda_toolkit(os.environ)
            print(f"CUDA {release} toolkit at {root}", file=sys.stderr)
            print(root)
        elif args.command == "build-env":
            root, _ = cuda_toolkit(os.environ)
            print(exports(build_environment(args.site_packages, root, os.environ)), end="")
        elif args.command == "runtime-env":
            env = runtime_environment(args.site_packages)
            if args.write_pth:
                (args.site_packages / PTH_NAME).write_text(pth_text(env))
            print(exports(env), end="")
        else:
            print("\n".join(check_import(args.site_packages)))
    except Refused as refusal:
        print(f"[gpu_build_env] {args.command}: {refusal}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
