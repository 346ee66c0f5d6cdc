"""The GPU install's machine checks and build/runtime environment (scripts/gpu_build_env.py), on CPU:
which include directories the TransformerEngine build gets from a site-packages layout, the driver
verdict, the CUDA 13 toolkit requirement, the variables exported, the .pth that makes TE's loader take
torch's pip CUDA libraries, and `ensure_venv.sh --gpu` refusing an old driver or a CUDA 12 toolkit
before it installs anything (a copy of the scripts in a temporary checkout, with a stand-in
nvidia-smi and nvcc; no package index reachable). Nothing is downloaded; the real compile is the GPU
machine's (tests/gpu/wheels.sh --build-te)."""

from __future__ import annotations

import os
import runpy
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_build_env.py"
env_module = runpy.run_path(str(SCRIPT), run_name="gpu_build_env")
Refused = env_module["Refused"]


def _touch(path: Path, text: str = "") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _executable(path: Path, text: str) -> Path:
    _touch(path, text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def _cu13_site_packages(root: Path) -> Path:
    """torch 2.13's CUDA wheels as laid out in site-packages (their RECORDs: nvidia-cudnn-cu13
    9.20.0.48, nvidia-nccl-cu13 2.29.7, the cu13 runtime/nvrtc/curand/cublas wheels,
    nvidia-nvshmem-cu13, nvidia-cusparselt-cu13), with a folder that has no include/."""
    site = root / "site-packages"
    nvidia = site / "nvidia"
    _touch(nvidia / "cudnn" / "include" / "cudnn.h", "#define MEGATRON_RL_TEST_CUDNN 9\n")
    _touch(nvidia / "cudnn" / "lib" / "libcudnn.so.9")
    _touch(nvidia / "cudnn" / "lib" / "libcudnn_ops.so.9")
    _touch(nvidia / "nccl" / "include" / "nccl.h", "#define MEGATRON_RL_TEST_NCCL 2\n")
    _touch(nvidia / "nccl" / "lib" / "libnccl.so.2")
    _touch(nvidia / "cu13" / "include" / "cuda_runtime.h")
    _touch(nvidia / "cu13" / "include" / "nvrtc.h")
    for lib in (
        "libcudart.so.13",
        "libnvrtc.so.13",
        "libnvrtc-builtins.so.13.0",
        "libcurand.so.10",
        "libcublas.so.13",
    ):
        _touch(nvidia / "cu13" / "lib" / lib)
    _touch(nvidia / "nvshmem" / "include" / "nvshmem.h")
    _touch(nvidia / "cusparselt" / "include" / "cusparseLt.h")
    _touch(nvidia / "cusparselt" / "LICENSE.txt")
    (nvidia / "cufile_no_headers" / "lib").mkdir(parents=True)
    return site


# --- header discovery ---------------------------------------------------------------------------


def test_the_build_gets_every_wheel_include_dir_cudnn_and_nccl_first(tmp_path):
    site = _cu13_site_packages(tmp_path)
    nvidia = site / "nvidia"
    expected = ["cudnn", "nccl", "cu13", "cusparselt", "nvshmem"]
    assert env_module["wheel_include_dirs"](site) == [nvidia / name / "include" for name in expected]
    env = env_module["build_environment"](site, Path("/opt/cuda-13.0"), {"CPATH": "/usr/local/include/extra"})
    assert env["CPATH"].split(":") == [str(nvidia / name / "include") for name in expected] + [
        "/usr/local/include/extra"
    ]
    assert env["CUDA_HOME"] == "/opt/cuda-13.0"
    assert env["NVTE_NO_LOCAL_VERSION"] == "1" and env["NVTE_PYTORCH_FORCE_BUILD"] == "TRUE"
    assert env["NVTE_FRAMEWORK"] == "pytorch"
    assert set(env) == {
        "CUDA_HOME",
        "CPATH",
        "NVTE_FRAMEWORK",
        "NVTE_NO_LOCAL_VERSION",
        "NVTE_PYTORCH_FORCE_BUILD",
    }


def test_missing_include_dirs_are_not_exported_and_missing_cudnn_or_nccl_headers_are_refused(tmp_path):
    site = _cu13_site_packages(tmp_path)
    shutil.rmtree(site / "nvidia" / "nvshmem")
    shutil.rmtree(site / "nvidia" / "cu13" / "include")
    dirs = env_module["wheel_include_dirs"](site)
    assert [path.parent.name for path in dirs] == ["cudnn", "nccl", "cusparselt"]
    assert env_module["build_environment"](site, Path("/cuda"), {})["CPATH"] == ":".join(map(str, dirs))
    assert env_module["wheel_include_dirs"](tmp_path / "empty") == []
    (site / "nvidia" / "nccl" / "include" / "nccl.h").unlink()
    with pytest.raises(Refused, match=r"nvidia/nccl/include/nccl\.h \(nvidia-nccl-cu13\)") as refused:
        env_module["build_environment"](site, Path("/cuda"), {})
    assert "cudnn.h (" not in str(refused.value) and str(site) in str(refused.value)
    shutil.rmtree(site / "nvidia" / "cudnn")
    with pytest.raises(Refused, match=r"cudnn\.h \(nvidia-cudnn-cu13\).*nccl\.h \(nvidia-nccl-cu13\)"):
        env_module["build_environment"](site, Path("/cuda"), {})


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ (what TE's build compiles with)")
def test_the_exported_cpath_lets_the_compiler_find_the_wheels_cudnn_and_nccl_headers(tmp_path):
    site = _cu13_site_packages(tmp_path)
    source = _touch(tmp_path / "te_like.cpp", "#include <cudnn.h>\n#include \"nccl.h\"\n"
                    "static_assert(MEGATRON_RL_TEST_CUDNN == 9 && MEGATRON_RL_TEST_NCCL == 2);\n")  # fmt: skip
    compile_command = ["g++", "-fsyntax-only", "-std=c++20", str(source)]
    bare = {key: value for key, value in os.environ.items() if key not in ("CPATH", "CPLUS_INCLUDE_PATH")}
    without = subprocess.run(compile_command, env=bare, capture_output=True, text=True, timeout=60)
    assert without.returncode != 0 and "cudnn.h" in without.stderr  # the defect: no cuDNN headers
    build = env_module["build_environment"](site, Path("/cuda"), bare)
    with_env = subprocess.run(
        compile_command, env={**bare, **build}, capture_output=True, text=True, timeout=60
    )
    assert with_env.returncode == 0, with_env.stderr


# --- the driver ---------------------------------------------------------------------------------


@pytest.mark.parametrize("output", ["580.65.06\n", "580.95.05\n580.95.05\n", "590.44.01", "610.1\n"])
def test_a_driver_of_r580_or_newer_is_accepted(output):
    verdict = env_module["driver_verdict"](output)
    assert output.split()[0] in verdict and "runs CUDA 13" in verdict


@pytest.mark.parametrize("output, oldest", [("570.172.08\n", "570.172.08"), ("590.44.01\n575.57.08\n", "575.57.08"),
                                            ("535.247.01", "535.247.01")])  # fmt: skip
def test_an_older_driver_is_refused_naming_the_version_and_r580(output, oldest):
    with pytest.raises(Refused, match=rf"NVIDIA driver {oldest} is too old for CUDA 13.*R580 or newer"):
        env_module["driver_verdict"](output)


@pytest.mark.parametrize(
    "output", ["N/A\n", "[Not Supported]\n", "580.65.06\nNVIDIA-SMI has failed\n", "580"]
)
def test_unreadable_driver_output_is_refused_quoting_it(output):
    bad = next(line for line in output.splitlines() if not line[:1].isdigit() or "." not in line)
    with pytest.raises(Refused, match="could not read a driver version") as refused:
        env_module["driver_verdict"](output)
    assert repr(bad.strip()) in str(refused.value) and "R580" in str(refused.value)


def test_no_gpu_listed_is_refused():
    with pytest.raises(Refused, match="listed no GPU"):
        env_module["driver_verdict"]("\n")


def _run(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=60
    )


def test_the_driver_command_asks_nvidia_smi_and_refuses_without_it(tmp_path):
    bin_dir = tmp_path / "bin"
    _executable(bin_dir / "nvidia-smi", '#!/bin/sh\n[ "$1 $2" = "--query-gpu=driver_version --format=csv,noheader" ]'
                                        ' || exit 9\necho 575.57.08\n')  # fmt: skip
    old = _run("driver", env={**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin"})
    assert old.returncode == 1 and "NVIDIA driver 575.57.08 is too old" in old.stderr, old.stderr
    _executable(bin_dir / "nvidia-smi", "#!/bin/sh\necho 580.82.07\n")
    assert (
        "NVIDIA driver 580.82.07: runs CUDA 13"
        in _run("driver", env={**os.environ, "PATH": str(bin_dir)}).stdout
    )
    _executable(
        bin_dir / "nvidia-smi",
        "#!/bin/sh\necho 'Failed to initialize NVML: Driver/library mismatch' >&2\nexit 18\n",
    )
    failing = _run("driver", env={**os.environ, "PATH": str(bin_dir)})
    assert failing.returncode == 1 and "exited 18: Failed to initialize NVML" in failing.stderr
    (bin_dir / "nvidia-smi").unlink()
    missing = _run("driver", env={**os.environ, "PATH": str(bin_dir)})
    assert (
        missing.returncode == 1
        and "nvidia-smi not found on PATH" in missing.stderr
        and "R580" in missing.stderr
    )


# --- the CUDA toolkit ---------------------------------------------------------------------------


def _toolkit(root: Path, release: str) -> Path:
    _executable(root / "bin" / "nvcc", "#!/bin/sh\necho 'nvcc: NVIDIA (R) Cuda compiler driver'\n"
                                       f"echo 'Cuda compilation tools, release {release}, V{release}.88'\n")  # fmt: skip
    _touch(root / "include" / "cuda_runtime.h")
    return root


def test_the_build_requires_a_cuda_13_toolkit_found_as_te_finds_nvcc(tmp_path):
    toolkit = env_module["cuda_toolkit"]
    cuda13, cuda12 = _toolkit(tmp_path / "cuda-13.0", "13.0"), _toolkit(tmp_path / "cuda-12.8", "12.8")
    nowhere = tmp_path / "no-default-toolkit"
    assert toolkit({"CUDA_HOME": str(cuda13)}, nowhere) == (cuda13, "13.0")
    # CUDA_HOME first, then nvcc on PATH, then /usr/local/cuda (here: a parameter), as TE's nvcc_path.
    assert toolkit({"PATH": f"{cuda13 / 'bin'}:{cuda12 / 'bin'}"}, nowhere) == (cuda13, "13.0")
    assert toolkit({"PATH": str(tmp_path / "empty")}, cuda13) == (cuda13, "13.0")
    with pytest.raises(Refused, match=r"cuda-12\.8/bin/nvcc is CUDA 12\.8; .* CUDA 13 toolkit.*CUDA_HOME"):
        toolkit({"CUDA_HOME": str(cuda12), "PATH": str(cuda13 / "bin")}, nowhere)
    with pytest.raises(Refused, match=r"is CUDA 12\.8"):
        toolkit({"PATH": f"{cuda12 / 'bin'}:{cuda13 / 'bin'}"}, nowhere)
    with pytest.raises(Refused, match=rf"no CUDA toolkit: {nowhere}/bin/nvcc does not exist"):
        toolkit({"PATH": str(tmp_path / "empty")}, nowhere)
    with pytest.raises(Refused, match=r"no CUDA toolkit: .*/missing/bin/nvcc does not exist \(CUDA_HOME="):
        toolkit({"CUDA_HOME": str(tmp_path / "missing")}, cuda13)
    (cuda13 / "include" / "cuda_runtime.h").unlink()
    with pytest.raises(Refused, match=r"has no include/cuda_runtime\.h"):
        toolkit({"CUDA_HOME": str(cuda13)}, nowhere)
    _executable(tmp_path / "broken" / "bin" / "nvcc", "#!/bin/sh\necho 'cannot run' >&2\nexit 1\n")
    with pytest.raises(Refused, match=r"names no CUDA release: cannot run"):
        toolkit({"CUDA_HOME": str(tmp_path / "broken")}, nowhere)


def test_build_env_prints_the_exports_a_shell_evaluates(tmp_path):
    site = _cu13_site_packages(tmp_path / "a dir with spaces")
    cuda13 = _toolkit(tmp_path / "cuda-13.0", "13.0")
    proc = _run(
        "build-env", "--site-packages", str(site), env={**os.environ, "CUDA_HOME": str(cuda13), "CPATH": ""}
    )
    assert proc.returncode == 0, proc.stderr
    shown = subprocess.run(["bash", "-c", f'{proc.stdout}\nprintf "%s\\n" "$CUDA_HOME" "$CPATH" '
                            '"$NVTE_NO_LOCAL_VERSION" "$NVTE_PYTORCH_FORCE_BUILD" "$NVTE_FRAMEWORK"'],
                           capture_output=True, text=True, check=True).stdout.splitlines()  # fmt: skip
    assert shown == [
        str(cuda13),
        env_module["build_environment"](site, cuda13, {})["CPATH"],
        "1",
        "TRUE",
        "pytorch",
    ]
    assert shown[1].startswith(f"{site}/nvidia/cudnn/include:{site}/nvidia/nccl/include:")
    twelve = _run("build-env", "--site-packages", str(site),
                  env={**os.environ, "CUDA_HOME": str(_toolkit(tmp_path / "cuda-12.8", "12.8"))})  # fmt: skip
    assert twelve.returncode == 1 and twelve.stdout == "" and "is CUDA 12.8" in twelve.stderr


# --- the runtime: which CUDA libraries TE loads -------------------------------------------------


def test_the_runtime_pth_points_tes_loader_at_the_wheels_and_yields_to_the_environment(tmp_path):
    site = _cu13_site_packages(tmp_path)
    nvidia = site / "nvidia"
    env = env_module["runtime_environment"](site)
    # transformer_engine/common/__init__.py (2.11) globs <HOME>/**/lib<name>.so* first for each of these.
    assert env == {"CUDNN_HOME": str(nvidia / "cudnn"), "NVRTC_HOME": str(nvidia / "cu13"),
                   "CURAND_HOME": str(nvidia / "cu13"), "NVTE_CUDA_INCLUDE_DIR": str(nvidia / "cu13" / "include")}  # fmt: skip
    proc = _run("runtime-env", "--site-packages", str(site), "--write-pth", env=os.environ.copy())
    assert proc.returncode == 0, proc.stderr
    pth = site / env_module["PTH_NAME"]
    # What site.py does with the file: run its import line in a fresh interpreter.
    probe = "import os, site, sys; site.addsitedir(sys.argv[1]); print(os.environ['CUDNN_HOME'], os.environ['NVRTC_HOME'])"
    clean = {key: value for key, value in os.environ.items() if key not in env}
    seen = subprocess.run(
        [sys.executable, "-c", probe, str(site)], env=clean, capture_output=True, text=True, check=True
    )
    assert seen.stdout.split() == [env["CUDNN_HOME"], env["NVRTC_HOME"]] and pth.is_file()
    mine = subprocess.run([sys.executable, "-c", probe, str(site)], env={**clean, "CUDNN_HOME": "/opt/cudnn"},
                          capture_output=True, text=True, check=True)  # fmt: skip
    assert mine.stdout.split() == ["/opt/cudnn", env["NVRTC_HOME"]]
    (nvidia / "cu13" / "lib" / "libcurand.so.10").unlink()
    with pytest.raises(Refused, match=r"missing .*nvidia/cu13/lib/libcurand\.so\.\*"):
        env_module["runtime_environment"](site)


def test_loaded_cuda_libraries_outside_the_wheels_are_named(tmp_path):
    site = _cu13_site_packages(tmp_path)
    nvidia = site / "nvidia"
    maps = "\n".join([
        f"7f00-7f10 r-xp 00000000 08:01 11 {nvidia}/cudnn/lib/libcudnn.so.9",
        f"7f10-7f20 r--p 00001000 08:01 11 {nvidia}/cudnn/lib/libcudnn.so.9",
        f"7f20-7f30 r-xp 00000000 08:01 12 {nvidia}/cudnn/lib/libcudnn_ops.so.9",
        f"7f30-7f40 r-xp 00000000 08:01 13 {nvidia}/cu13/lib/libcudart.so.13",
        "7f40-7f50 r-xp 00000000 08:01 14 /usr/local/cuda-12.8/lib64/libnvrtc.so.12.8.93",
        "7f50-7f60 r-xp 00000000 08:01 15 /usr/local/cuda-12.8/targets/x86_64-linux/lib/libcurand.so.10.3.9.90",
        "7f60-7f70 r-xp 00000000 08:01 16 /usr/lib/x86_64-linux-gnu/libcuda.so.580.65.06",
        "7f70-7f80 r-xp 00000000 08:01 17 /opt/aws-ofi-nccl/lib/libnccl-net.so",
        f"7f80-7f90 r-xp 00000000 08:01 18 {site}/transformer_engine/libtransformer_engine.so",
        "7f90-7fa0 rw-p 00000000 00:00 0 [heap]",
        "7fa0-7fb0 rw-p 00000000 00:00 0",
    ])  # fmt: skip
    loaded = env_module["loaded_cuda_libraries"](maps)
    assert loaded == sorted([nvidia / "cudnn/lib/libcudnn.so.9", nvidia / "cudnn/lib/libcudnn_ops.so.9",
                             nvidia / "cu13/lib/libcudart.so.13", Path("/usr/local/cuda-12.8/lib64/libnvrtc.so.12.8.93"),
                             Path("/usr/local/cuda-12.8/targets/x86_64-linux/lib/libcurand.so.10.3.9.90")])  # fmt: skip
    assert env_module["foreign_libraries"](loaded, site) == [
        Path("/usr/local/cuda-12.8/lib64/libnvrtc.so.12.8.93"),
        Path("/usr/local/cuda-12.8/targets/x86_64-linux/lib/libcurand.so.10.3.9.90"),
    ]
    # A symlink into the wheels (a venv reached through a link) counts as the wheels'.
    (tmp_path / "link").symlink_to(site)
    assert env_module["foreign_libraries"]([tmp_path / "link/nvidia/cudnn/lib/libcudnn.so.9"], site) == []


# --- ensure_venv.sh --gpu: the checks come before anything is installed --------------------------


@pytest.fixture
def checkout_copy(tmp_path):
    """The scripts ensure_venv.sh --gpu runs, in a temporary checkout: its .venv would be created
    there, and pip could reach no index."""
    copy = tmp_path / "checkout"
    for name in ("setup.py", "scripts/ensure_venv.sh", "scripts/constraints-cpu.txt", "scripts/check_gpu_env.py",
                 "scripts/gpu_build_env.py"):  # fmt: skip
        (copy / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, copy / name)
    return copy


def _ensure_venv_gpu(copy: Path, tmp_path: Path, driver: str, toolkit: str) -> subprocess.CompletedProcess:
    """ensure_venv.sh --gpu in `copy` with a stand-in nvidia-smi reporting `driver` and a CUDA
    `toolkit` (its version) as CUDA_HOME; pip reaches no index."""
    bin_dir = tmp_path / "bin"
    _executable(bin_dir / "nvidia-smi", '#!/bin/sh\n[ "$1" = -L ] && { echo "GPU 0: NVIDIA H200"; exit 0; }\n'
                                        f"echo {driver}\n")  # fmt: skip
    cuda_home = _toolkit(tmp_path / f"cuda-{toolkit}", toolkit)
    environ = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHON": sys.executable,
               "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": "", "CUDA_HOME": str(cuda_home)}  # fmt: skip
    return subprocess.run(["bash", "scripts/ensure_venv.sh", "--gpu"], cwd=copy, env=environ, capture_output=True,
                          text=True, timeout=120)  # fmt: skip


def test_ensure_venv_gpu_refuses_an_old_driver_before_installing_anything(checkout_copy, tmp_path):
    proc = _ensure_venv_gpu(checkout_copy, tmp_path, "570.172.08", "13.0")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "NVIDIA driver 570.172.08 is too old for CUDA 13" in proc.stderr and "R580 or newer" in proc.stderr
    assert "refused before installing anything" in proc.stderr
    assert not (checkout_copy / ".venv").exists() and "installing" not in proc.stdout


def test_ensure_venv_gpu_refuses_a_cuda_12_toolkit_before_installing_anything(checkout_copy, tmp_path):
    proc = _ensure_venv_gpu(checkout_copy, tmp_path, "580.65.06", "12.8")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "NVIDIA driver 580.65.06: runs CUDA 13" in proc.stdout
    assert (
        "cuda-12.8/bin/nvcc is CUDA 12.8" in proc.stderr
        and "refused before installing anything" in proc.stderr
    )
    assert not (checkout_copy / ".venv").exists() and "installing" not in proc.stdout
