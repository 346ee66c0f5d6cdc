"""The package layout's import rule (docs/contributing.md, "Import order"): a module imports only modules
listed above it. `faults` (kill points), `lifetime` (children bound to their starter) and `ports` (free ports) import nothing of ours and sit with `config`; `sim` (the scale
simulator) runs the real orchestrator, and `launch` may import everything."""

from __future__ import annotations

import ast
from pathlib import Path

import megatron_rl

ORDER = [
    "config", "faults", "lifetime", "ports", "compat", "parallel", "models", "conversion", "transforms", "data", "algorithms",
    "transport", "inference",
    "trainer", "policy", "critic", "teacher", "envs", "orchestrator", "sim", "demo", "launch",
]  # fmt: skip


def imported_packages(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, top-level megatron_rl package) of every import of ours in `tree`."""
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            if node.module == "megatron_rl":
                names = [f"megatron_rl.{alias.name}" for alias in node.names]
            elif node.module.startswith("megatron_rl."):
                names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names if alias.name.startswith("megatron_rl.")]
        found += [(node.lineno, name.split(".")[1]) for name in names]
    return found


def test_no_module_imports_a_package_listed_below_its_own():
    root = Path(megatron_rl.__file__).parent
    rank = {name: i for i, name in enumerate(ORDER)}
    packages = {p.name.removesuffix(".py") for p in root.iterdir() if not p.name.startswith("_")}
    assert packages - {"__pycache__"} <= set(ORDER), f"place these in ORDER: {packages - set(ORDER)}"
    violations = []
    for path in sorted(root.rglob("*.py")):
        own = path.relative_to(root).parts[0].removesuffix(".py")
        if own.startswith("_"):
            continue
        for line, other in imported_packages(ast.parse(path.read_text())):
            if rank[other] > rank[own]:
                violations.append(f"{path.relative_to(root.parent)}:{line}: {own} imports {other}")
    assert not violations, "\n".join(violations)


def test_the_package_never_imports_the_tests():
    """What tests share lives in tests/support, which is not installed: a module of the package
    that imported it would fail for every user."""
    root = Path(megatron_rl.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module]
            found += [f"{path.relative_to(root.parent)}:{node.lineno}" for n in names if n.split(".")[0] == "tests"]
    assert not found, found


def test_the_check_sees_a_violation():
    tree = ast.parse("from megatron_rl.orchestrator.loop import Orchestrator\nimport megatron_rl.launch.cli\n")
    assert imported_packages(tree) == [(1, "orchestrator"), (2, "launch")]


def test_modules_import_compat_before_megatron_core():
    """megatron-core runs on CPU only with megatron_rl.compat's patches: a module that imports
    megatron-core at its top imports megatron_rl.compat first."""
    root = Path(megatron_rl.__file__).parent
    late = []
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root).parts[0] == "compat":
            continue
        seen_compat = False
        for node in ast.parse(path.read_text()).body:
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            if any(n == "megatron_rl.compat" for n in names):
                seen_compat = True
            if any(n == "megatron" or n.startswith("megatron.") for n in names) and not seen_compat:
                late.append(f"{path.relative_to(root.parent)}:{node.lineno}")
                break
    assert not late, f"megatron-core imported before megatron_rl.compat: {late}"


# The settings a model transform owns (transforms/plan.py decides from them, config/ derives its plans).
TRANSFORM_KEYS = ("lora", "routing_replay")


def places_reading(keys: tuple[str, ...], root: Path) -> list[str]:
    """Every `.KEY` attribute read of `keys` outside config/ and transforms/ (PATH:LINE .KEY)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root).parts[0] in ("config", "transforms"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in keys:
                found.append((str(path.relative_to(root.parent)), node.lineno, node.attr))
    return [f"{path}:{line} .{key}" for path, line, key in sorted(found)]


def test_only_config_and_the_transforms_read_the_lora_and_routing_keys(tmp_path):
    """The LoRA and routing-replay decisions are made once (the layout's plans, transforms/plan.py);
    every other module reads those, never `lora`, `value.lora` or `algorithm.routing_replay`."""
    assert places_reading(TRANSFORM_KEYS, Path(megatron_rl.__file__).parent) == []
    (tmp_path / "policy").mkdir()  # the check sees a read
    (tmp_path / "policy" / "x.py").write_text("rank = resolved.lora.rank\nmode = cfg.algorithm.routing_replay\n")
    assert places_reading(TRANSFORM_KEYS, tmp_path) == [
        f"{tmp_path.name}/policy/x.py:1 .lora", f"{tmp_path.name}/policy/x.py:2 .routing_replay",
    ]  # fmt: skip


def imports_inside_functions(root: Path, packages: tuple[str, ...]) -> list[str]:
    """PATH:LINE of every import statement inside a function of `packages`."""
    found = []
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            for function in ast.walk(ast.parse(path.read_text())):
                if isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
                    found += [f"{path.relative_to(root.parent)}:{node.lineno}" for node in ast.walk(function)
                              if isinstance(node, ast.Import | ast.ImportFrom)]  # fmt: skip
    return sorted(set(found))


def test_models_trainer_conversion_and_transforms_import_at_the_top(tmp_path):
    """What a module needs is named at its top (no import circle to dodge); optional packages are
    probed at import time, as megatron's layer specs probe TE."""
    packages = ("models", "trainer", "conversion", "transforms")
    assert imports_inside_functions(Path(megatron_rl.__file__).parent, packages) == []
    (tmp_path / "models").mkdir()  # the check sees one
    (tmp_path / "models" / "x.py").write_text("def f():\n    import json\n    return json\n")
    assert imports_inside_functions(tmp_path, ("models",)) == [f"{tmp_path.name}/models/x.py:2"]


def transform_imports(root: Path, packages: tuple[str, ...]) -> list[str]:
    """Every import from a `transforms` module other than the seam (base, plan) in `packages`
    (PATH MODULE)."""
    found = []
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                module = node.module or "" if isinstance(node, ast.ImportFrom) else ""
                if module.startswith("megatron_rl.transforms.") and module.rsplit(".", 1)[1] not in ("base", "plan"):
                    found.append(f"{path.relative_to(root.parent)} {module}")
    return sorted(found)


def test_the_trainer_checkpoints_and_publishers_reach_the_transforms_through_the_seam(tmp_path):
    """trainer/ (the shared trainer, checkpoints, snapshots) and policy/publish/ ask the transforms
    (transforms/base.py, plan.py) and never name one; the one exception is the publishers' guard
    that no adapter tensor is published unmerged (transforms.peft.is_adapter)."""
    root = Path(megatron_rl.__file__).parent
    assert transform_imports(root, ("trainer", "policy/publish")) == [
        "megatron_rl/policy/publish/ownership.py megatron_rl.transforms.peft"
    ]
    (tmp_path / "trainer").mkdir()  # the check sees one
    (tmp_path / "trainer" / "x.py").write_text("from megatron_rl.transforms.lora import apply_lora\n")
    assert transform_imports(tmp_path, ("trainer",)) == [f"{tmp_path.name}/trainer/x.py megatron_rl.transforms.lora"]
