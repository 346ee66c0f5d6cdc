"""A sandboxed Python tool: run model-written code (tool-integrated reasoning) in an isolated child.

    sandbox = PythonSandbox(SandboxLimits(timeout_s=5, memory_mb=256))  # probes the isolation now
    result = sandbox.run("print(sum(range(10)))")  # thread-safe; runs may be concurrent
    result.ok, result.stdout, result.limit, result.error, result.observation()
    PythonSandbox(packages=False)  # the standard library only (default: also the venv's packages)

Each run starts a supervisor (`python -I -S -c _SUPERVISOR`) in a new session. Run as root, it
enters new network (loopback only, down), PID, IPC and UTS namespaces and forks the child, PID 1 of the new
PID namespace. The child takes its own mount namespace and a new root: a read-only tmpfs holding
read-only bind mounts of /usr (and /lib*, /bin, /sbin as they are), the interpreter's prefix, the
dynamic loader's cache, a few devices and, with `packages` (the default), the site-packages
directories of the venv that runs this, at their own paths (so numpy and sympy import), plus a
fresh tmpfs at /sandbox (its cwd and HOME, the only writable place, gone with the run);
`pivot_root` drops the old root. It sets the rlimits, drops to a uid/gid of its own (from
UID_RANGE, no supplementary groups, no new privileges, so RLIMIT_NPROC applies to it and to
nothing else), joins a new, empty session keyring, installs the seccomp filter of
envs/sandbox_kernel.py (no keyrings, SysV IPC, POSIX queues, memfds, new namespaces, sockets
beyond AF_UNIX/INET/INET6, larger pipe or socket buffers, io_uring, bpf, perf, userfaultfd,
inotify, fanotify, kernel log) and execs the interpreter in isolated mode (`-I -S`: no user
site, no PYTHON* variables, no .pth files; the wrapper appends the site-packages directories to
sys.path) on the code, with one thread for OpenBLAS, OpenMP and MKL. When PID 1 exits or is
killed, the kernel kills everything else in its namespace, setsid() or not; the supervisor reaps
it and reports its status. The host kills the supervisor, which kills PID 1 (a parent-death
signal and a lifeline pipe cover the supervisor's own death).

Run by any other user (rootless: a SLURM user, a container without CAP_SYS_ADMIN), the supervisor
first enters a user namespace of its own, where the run's uid and gid are the only ones mapped
(to the caller's), with setgroups denied; it holds the capabilities of that namespace only, and the
other namespaces, the mounts, the new root and the rlimits are made exactly as above. The child
is already the run's uid inside it: the exec drops every capability (a non-zero uid, no file
capabilities, no new privileges, nosuid mounts), so the code cannot undo the mounts. Since Linux
5.14, RLIMIT_NPROC counts the tasks of a user in each user namespace, and the caller's uid holds
no capability outside it, so the process limit counts the run's own tasks here too (plus the
supervisor). The caller's supplementary groups stay, unmapped (shown as the overflow gid); the
new root holds only read-only system directories and packages, where they open nothing more.
This needs unprivileged user namespaces (`/proc/sys/user/max_user_namespaces` > 0, and no
distribution policy refusing them): where they are refused, the sandbox says so and refuses.

The limits are wall time (the host kills), output (the host reads stdout and stderr with a cap
and kills past it), memory (RLIMIT_AS of each process; where a memory cgroup can be made, cgroup
v1 or v2, all the run's memory together, its directory included, is held to memory_mb plus the
directory's size: the run's PID 1 joins a cgroup of its own first thing), processes (RLIMIT_NPROC
of the run's own uid), file size (RLIMIT_FSIZE; the directory holds 4 x file_bytes and 1024
files); descriptors (64: what bounds a process's pipe and socket buffers), POSIX queues (0) and
pending signals (256: also POSIX timers). Run as root, the IPC namespace's own limits allow no
SysV segment, queue or semaphore set either. A limit hit is a result with
`limit` and a one-line `error`, not an exception. When isolation is unavailable (a namespace type
disabled or refused, unprivileged user namespaces refused to a non-root caller, the interpreter
unable to run in the new root, or by the caller's uid),
PythonSandbox() and run() raise SandboxUnavailable naming the missing piece: code never runs
unisolated. Linux only (x86_64, aarch64).
"""

from __future__ import annotations

import json
import math
import os
import platform
import random
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, replace

from megatron_rl.envs import sandbox_kernel

UID_RANGE = range(1_900_000_000, 1_901_000_000)  # a run's uid (= gid); no real user has one
_SYSCTL_USER = "/proc/sys/user"
_NAMESPACES = (
    ("network namespace", "CLONE_NEWNET", 0x40000000, "max_net_namespaces"),
    ("pid namespace", "CLONE_NEWPID", 0x20000000, "max_pid_namespaces"),
    ("ipc namespace", "CLONE_NEWIPC", 0x08000000, "max_ipc_namespaces"),
    ("uts namespace", "CLONE_NEWUTS", 0x04000000, "max_uts_namespaces"),
    ("mount namespace", "CLONE_NEWNS", 0x00020000, "max_mnt_namespaces"),
)  # fmt: skip
# Rootless (not root): entered first, so that the caller may make the others.
_USER_NAMESPACE = ("user namespace", "CLONE_NEWUSER", 0x10000000, "max_user_namespaces")
_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}  # syscall numbers (glibc has no wrapper)
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_SYSTEM_FILES = ("/etc/ld.so.cache", "/etc/localtime")
_DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
_PACKAGE_DIRS = ("site-packages", "dist-packages")  # sys.path entries mounted with `packages`
_WORK = "/sandbox"
_MAX_FILES = 1024
_MAX_DESCRIPTORS = 64  # RLIMIT_NOFILE: also what bounds the pipe and socket buffers a process holds
_MAX_PENDING_SIGNALS = 256  # RLIMIT_SIGPENDING: queued signals and POSIX timers of the run's uid
# SysV IPC refused by the run's IPC namespace's own limits too (written as root; rootless, the
# kernel lets only the namespace owner's uid 0, which is not mapped, write them).
_IPC_SYSCTLS = (("kernel/shmmni", "0"), ("kernel/shmall", "0"), ("kernel/shmmax", "0"), ("kernel/msgmni", "0"),
                ("kernel/sem", "0 0 0 0"))  # fmt: skip
_KILL_GRACE_S = 5.0
# Exit codes of the wrapper for a limit hit inside the child (an uncaught exception of that kind).
_EXIT_LIMITS = {201: "memory", 202: "processes", 203: "file_size", 204: "file_size"}
_OBSERVATION_CHARS = 4096
_MARKER = "megatron-rl-sandbox"  # in every sandbox process's command line (the scripts' first line)


class SandboxUnavailable(RuntimeError):
    """The isolation the sandbox needs is not available here; the message names what and why."""


@dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 10.0  # wall clock, from the start of the run
    memory_mb: int = 512  # address space of each process (RLIMIT_AS)
    processes: int = 32  # processes + threads of the run (RLIMIT_NPROC)
    output_bytes: int = 65536  # stdout + stderr kept; more is a limit hit ("output")
    file_bytes: int = 16 << 20  # largest file it may write (RLIMIT_FSIZE)

    def __post_init__(self):
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, int | float):
            raise ValueError(f"SandboxLimits.timeout_s: a number of seconds, got {self.timeout_s!r}")
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ValueError(f"SandboxLimits.timeout_s: positive and finite, got {self.timeout_s!r}")
        for name in ("memory_mb", "processes", "output_bytes", "file_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"SandboxLimits.{name}: a positive integer, got {value!r}")


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int | None  # None when the host killed it (time, output); -N: killed by signal N
    limit: str | None  # None, or the limit hit: "time", "memory", "processes", "output", "file_size"
    error: str | None  # one line for the tool error; None when the code ran and exited 0

    @property
    def ok(self) -> bool:
        return self.error is None and self.limit is None and self.exit_code == 0

    def observation(self, max_chars: int = _OBSERVATION_CHARS) -> str:
        """What the model sees: stdout; when it failed, also stderr's tail and the error (for a
        limit, or when stderr is empty). At most `max_chars` characters."""
        if self.ok:
            return _clip(self.stdout, max_chars)
        note = f"error: {self.error}" if self.limit or not self.stderr.strip() else ""
        room = max(max_chars - len(note) - 2, 0)  # 2: the newlines between the parts
        out, err = self.stdout.rstrip("\n"), self.stderr.rstrip("\n")
        out = _clip(out, min(len(out), room // 2) if err else room)
        err_room = room - len(out)
        if len(err) > err_room:
            err = "..." + err[len(err) - err_room + 3 :] if err_room > 3 else ""
        return "\n".join(part for part in (out, err, note) if part)


class PythonSandbox:
    """Runs Python code under `limits`, each run isolated (see the module docstring). The
    constructor checks the isolation now, with a trial run; SandboxUnavailable when it is not there.

    `packages`: True (the default) mounts the site-packages directories of `python` (a venv's
    interpreter: the venv's; sys.path entries named site-packages or dist-packages, not the user
    site, PYTHONPATH or what .pth files add) read-only at their own paths and puts them on the
    child's sys.path; `package_paths` lists them. False: the standard library only."""

    def __init__(
        self, limits: SandboxLimits = SandboxLimits(), python: str = sys.executable, packages: bool = True
    ):
        if not isinstance(limits, SandboxLimits):
            raise TypeError(f"PythonSandbox: limits must be SandboxLimits, got {type(limits).__name__}")
        if not isinstance(packages, bool):
            raise TypeError(f"PythonSandbox: packages must be True or False, got {packages!r}")
        self.limits = limits
        self.packages = packages
        self.rootless = os.geteuid() != 0  # a user namespace of its own (the module docstring)
        missing = _missing_isolation()
        if missing:
            raise SandboxUnavailable("; ".join(missing))
        self.python, self._binds, self.package_paths = _interpreter(python, packages)
        self._seccomp = sandbox_kernel.seccomp_filter(platform.machine())
        self._lock = threading.Lock()
        self._uids: set[int] = set()
        self.memory_cgroup, self.memory_cgroup_missing = None, None
        self._cgroup_version = _memory_cgroup(self)
        # The trial runs under these limits, with room for its output and a slow start.
        trial = self.run(
            _trial_code(self.package_paths, self.rootless, _visible_tree(self._binds)),
            replace(self.limits, timeout_s=max(self.limits.timeout_s, 10.0), output_bytes=4096),
        )
        if trial.stdout.strip() != "ok" or not trial.ok:
            raise SandboxUnavailable(
                f"trial run under {self.limits}: {trial.error or 'isolation checks failed'}: "
                f"{(trial.stdout + trial.stderr).strip()[-800:]}"
            )

    def run(self, code: str, limits: SandboxLimits | None = None) -> SandboxResult:
        """Run `code` (the text of a Python module) in a fresh sandbox and wait for it; a limit hit
        or an exception is a result, SandboxUnavailable when the sandbox could not be set up.
        `limits`: this run's, instead of the sandbox's."""
        if not isinstance(code, str):
            raise TypeError(f"PythonSandbox.run: code must be str, got {type(code).__name__}")
        uid = self._acquire_uid()
        rundir = tempfile.mkdtemp(prefix=_MARKER + "-")
        try:
            return self._run(code.encode("utf-8", "replace"), uid, rundir, limits or self.limits)
        finally:
            shutil.rmtree(rundir, ignore_errors=True)
            with self._lock:
                self._uids.discard(uid)

    def _acquire_uid(self) -> int:
        with self._lock:
            while True:
                uid = random.SystemRandom().choice(UID_RANGE)
                if uid not in self._uids:
                    self._uids.add(uid)
                    return uid

    def _run(self, code: bytes, uid: int, rundir: str, limits: SandboxLimits) -> SandboxResult:
        work_bytes = 4 * limits.file_bytes + len(code) + (1 << 20)
        cgroup = None
        if self.memory_cgroup is not None:
            name = f"{_MARKER}-{os.getpid()}-{uid}"
            try:
                cgroup = sandbox_kernel.make_cgroup(
                    self._cgroup_version, self.memory_cgroup, name, (limits.memory_mb << 20) + work_bytes
                )
            except OSError as exc:
                raise SandboxUnavailable(
                    f"memory cgroup: making {self.memory_cgroup}/{name}: {exc}"
                ) from None
        try:
            result = self._supervise(code, uid, rundir, limits, work_bytes, cgroup)
            oom_kills = sandbox_kernel.oom_kills(self._cgroup_version, cgroup) if cgroup else 0
        finally:
            if cgroup:
                sandbox_kernel.remove_cgroup(cgroup)
        return _result(*result, limits, oom_kills)

    def _supervise(self, code: bytes, uid: int, rundir: str, limits: SandboxLimits, work_bytes: int,
                   cgroup: str | None) -> tuple:  # fmt: skip
        """Start the supervisor on `code` and wait for it: (status, returncode, stdout, stderr, limit)."""
        status_r, status_w = os.pipe()
        config = {
            "status_fd": status_w, "root": rundir, "uid": uid, "python": self.python, "binds": self._binds,
            "namespaces": [entry[:3] for entry in _NAMESPACES], "pivot_root": _PIVOT_ROOT[platform.machine()],
            "memory": limits.memory_mb << 20, "processes": limits.processes, "file_bytes": limits.file_bytes,
            "work_bytes": work_bytes, "max_files": _MAX_FILES, "descriptors": _MAX_DESCRIPTORS,
            "pending_signals": _MAX_PENDING_SIGNALS, "work": _WORK, "wrapper": _WRAPPER,
            "paths": list(self.package_paths), "rootless": self.rootless, "outer_uid": os.geteuid(),
            "outer_gid": os.getegid(), "seccomp": self._seccomp,
            "keyctl": sandbox_kernel.syscall_number(platform.machine(), "keyctl"),
            "ipc_sysctls": [] if self.rootless else _IPC_SYSCTLS,
            "cgroup_procs": os.path.join(cgroup, "cgroup.procs") if cgroup else None,
        }  # fmt: skip
        try:
            proc = subprocess.Popen(
                [self.python, "-I", "-S", "-B", "-c", _SUPERVISOR, json.dumps(config)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                pass_fds=(status_w,), start_new_session=True, env={},
            )  # fmt: skip
        finally:
            os.close(status_w)
        try:
            out, err, limit = _communicate(proc, code, limits)
            status = _read_all(status_r)
        finally:
            os.close(status_r)
            if proc.poll() is None:  # only on an error of ours: leave nothing behind
                _kill_group(proc)
        return status, proc.returncode, out, err, limit


def _communicate(
    proc: subprocess.Popen, code: bytes, limits: SandboxLimits
) -> tuple[bytes, bytes, str | None]:
    """Feed `code` to stdin, read stdout and stderr until both close, keeping output_bytes in all;
    past the deadline or the cap, kill the run (limit "time" or "output"). Then wait for the
    supervisor (SIGKILL to its group when it outlives the grace period)."""
    kept = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    pending, limit, total = memoryview(code), None, 0
    deadline = time.monotonic() + limits.timeout_s
    with selectors.DefaultSelector() as selector:
        for stream in (proc.stdout, proc.stderr, proc.stdin):
            os.set_blocking(stream.fileno(), False)
        selector.register(proc.stdout, selectors.EVENT_READ)
        selector.register(proc.stderr, selectors.EVENT_READ)
        selector.register(proc.stdin, selectors.EVENT_WRITE)
        while selector.get_map():
            now = time.monotonic()
            if now >= deadline:
                if limit is not None:  # the grace period after a kill is over
                    _kill_group(proc)
                    break
                limit = "time"
                _kill(proc)
                deadline = now + _KILL_GRACE_S
                continue
            for key, _ in selector.select(deadline - now):
                stream = key.fileobj
                if stream is proc.stdin:
                    try:
                        written = os.write(stream.fileno(), pending[:65536])
                    except BlockingIOError:
                        continue
                    except BrokenPipeError:  # it stopped reading (a setup error, the status says)
                        written = len(pending)
                    pending = pending[written:]
                    if not pending:
                        selector.unregister(stream)
                        stream.close()
                    continue
                try:
                    data = os.read(stream.fileno(), 65536)
                except BlockingIOError:
                    continue
                if not data:
                    selector.unregister(stream)
                    continue
                room = limits.output_bytes - total
                kept[stream.fileno()] += data[: max(room, 0)]
                total += len(data)
                if total > limits.output_bytes and limit is None:
                    limit = "output"
                    _kill(proc)
                    deadline = time.monotonic() + _KILL_GRACE_S
    if not proc.stdin.closed:
        proc.stdin.close()
    try:
        proc.wait(_KILL_GRACE_S)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        proc.wait()
    out, err = bytes(kept[proc.stdout.fileno()]), bytes(kept[proc.stderr.fileno()])
    proc.stdout.close()
    proc.stderr.close()
    return out, err, limit


def _kill(proc: subprocess.Popen) -> None:
    """SIGTERM to the supervisor, which SIGKILLs PID 1 of the run's namespace (and so all of it)."""
    try:
        proc.send_signal(signal.SIGTERM)
    except ProcessLookupError:
        pass


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL to the supervisor's process group; PID 1 follows by its parent-death signal."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _read_all(fd: int) -> str:
    os.set_blocking(fd, False)
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks).decode("utf-8", "replace")


def _result(status: str, returncode: int, out: bytes, err: bytes, limit: str | None, limits: SandboxLimits,
            oom_kills: int = 0) -> SandboxResult:  # fmt: skip
    """The run's result from the supervisor's status lines (SETUP <why>, EXIT <n>, SIGNAL <n>);
    `oom_kills`: processes of the run the kernel killed at its memory cgroup's limit."""
    setup = [line[6:] for line in status.splitlines() if line.startswith("SETUP ")]
    if setup:
        raise SandboxUnavailable("; ".join(setup))
    ends = [line.split() for line in status.splitlines() if line.startswith(("EXIT ", "SIGNAL "))]
    stdout, stderr = out.decode("utf-8", "replace"), err.decode("utf-8", "replace")
    if not ends and limit is None:
        raise SandboxUnavailable(
            f"sandbox supervisor: exited {returncode} without a status; stderr: {stderr.strip()[-500:]!r}"
        )
    exit_code = None
    if ends and limit is None:
        kind, number = ends[-1][0], int(ends[-1][1])
        exit_code = number if kind == "EXIT" else -number
        if kind == "EXIT":
            limit = _EXIT_LIMITS.get(number)
        elif number == signal.SIGXFSZ:
            limit = "file_size"
    if oom_kills and limit is None:
        limit = "memory"
    last = next((line.strip() for line in reversed(stderr.splitlines()) if line.strip()), "")
    errors = {
        "time": f"time limit: killed after {limits.timeout_s:g} s",
        "output": f"output limit: more than {limits.output_bytes} bytes of output",
        "memory": f"memory limit: {limits.memory_mb} MB",
        "processes": f"process limit: {limits.processes} processes and threads",
        "file_size": (
            f"file size limit: the directory holds {4 * limits.file_bytes} bytes and {_MAX_FILES} files"
            if exit_code == 204
            else f"file size limit: {limits.file_bytes} bytes per file"
        ),
    }
    if limit is not None:
        error = errors[limit]
    elif exit_code == 0:
        error = None
    elif exit_code < 0:
        error = f"killed by signal {signal.Signals(-exit_code).name}"
    else:
        error = f"exit code {exit_code}" + (f": {last[:200]}" if last else "")
    return SandboxResult(stdout=stdout, stderr=stderr, exit_code=exit_code, limit=limit, error=error)


def _clip(text: str, limit: int) -> str:
    """`text`, or its head and tail with the middle cut when longer than `limit` characters."""
    if len(text) <= limit:
        return text
    marker = 48  # room for the cut's note
    if limit < 2 * marker:
        return text[:limit]
    head = (limit - marker) * 2 // 3
    tail = limit - marker - head
    return text[:head] + f"\n...[{len(text) - head - tail} characters cut]...\n" + text[-tail:]


def _missing_isolation() -> list[str]:
    """What this process and kernel lack for the sandbox, found without starting anything."""
    if sys.platform != "linux":
        return [f"namespaces: Linux only, this is {sys.platform}"]
    missing = []
    namespaces = list(_NAMESPACES)
    if os.geteuid() != 0:  # rootless: the other namespaces are made inside a user namespace
        namespaces.append(_USER_NAMESPACE)
    for name, _, _, sysctl in namespaces:
        path = os.path.join(_SYSCTL_USER, sysctl)
        try:
            with open(path) as file:
                if int(file.read().strip() or 0) <= 0:
                    missing.append(f"{name}: disabled ({path} is 0)")
        except FileNotFoundError:
            missing.append(f"{name}: not supported by this kernel (no {path})")
        except (OSError, ValueError) as exc:
            missing.append(f"{name}: cannot read {path}: {exc}")
    if platform.machine() not in _PIVOT_ROOT:
        missing.append(
            f"file isolation: pivot_root's syscall number for {platform.machine()} is not known here"
        )
    return missing


def _interpreter(python: str, packages: bool) -> tuple[str, list[list[str]], tuple[str, ...]]:
    """The interpreter's real path, the bind mounts of the new root ([kind, path]: "dir" and
    "file" read-only, "dev" a device, "link" a symlink recreated as it is) and, with `packages`,
    the site-packages directories for the child's sys.path (real paths, each visible in the new
    root: bound, or under a bound directory)."""
    real = os.path.realpath(python)
    if not os.access(real, os.X_OK):
        raise SandboxUnavailable(f"interpreter: {python} is not an executable file")
    # Asked of `python` as given (a venv's symlink: the venv's sys.path), with site only for packages.
    script = (
        "import json, sys; print(json.dumps([sys.base_prefix, sys.base_exec_prefix, "
        f"[p for p in sys.path if p.rstrip('/').rsplit('/', 1)[-1] in {_PACKAGE_DIRS!r}]]))"
    )
    command = [os.path.abspath(python), "-I", *([] if packages else ["-S"]), "-c", script]
    try:
        query = subprocess.run(command, capture_output=True, text=True, timeout=60, env={})
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SandboxUnavailable(f"interpreter: {' '.join(command[:-2])} did not run: {exc}") from None
    if query.returncode != 0:
        raise SandboxUnavailable(
            f"interpreter: {' '.join(command[:-2])} failed: {query.stderr.strip()[-300:]}"
        )
    try:
        base_prefix, base_exec_prefix, site_dirs = json.loads(query.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise SandboxUnavailable(
            f"interpreter: {python}: unexpected answer {query.stdout[-300:]!r}"
        ) from None
    binds: list[list[str]] = []
    for path in _SYSTEM_DIRS:
        if os.path.islink(path):
            binds.append(["link", path])
        elif os.path.isdir(path):
            binds.append(["dir", path])
    covered = [os.path.realpath(path) for kind, path in binds if kind == "dir"]

    def bind(path: str) -> None:
        if path != "/" and not any(path == top or path.startswith(top + "/") for top in covered):
            binds.append(["dir", path])
            covered.append(path)

    for path in (base_prefix, base_exec_prefix, os.path.dirname(real)):
        if path:
            bind(os.path.realpath(path))
    package_paths: list[str] = []
    for path in site_dirs if packages else ():
        path = os.path.realpath(path)
        if os.path.isdir(path) and path not in package_paths:
            bind(path)
            package_paths.append(path)
    binds += [["file", path] for path in _SYSTEM_FILES if os.path.isfile(path)]
    binds += [["dev", path] for path in _DEVICES if os.path.exists(path)]
    return real, binds, tuple(package_paths)


def _memory_cgroup(sandbox: PythonSandbox) -> int | None:
    """Find where the runs' memory cgroups can be made and try making one: sets the sandbox's
    `memory_cgroup` (the directory) or `memory_cgroup_missing` (why none); returns the version."""
    version, where = sandbox_kernel.memory_cgroup_parent()
    if version is None:
        sandbox.memory_cgroup_missing = where
        return None
    sandbox_kernel.remove_stale_cgroups(where, _MARKER)
    try:
        name = f"{_MARKER}-{os.getpid()}-probe-{random.SystemRandom().randrange(1 << 32):08x}"
        probe = sandbox_kernel.make_cgroup(version, where, name, 64 << 20)
    except OSError as exc:
        sandbox.memory_cgroup_missing = f"cgroup v{version}: making a cgroup in {where}: {exc}"
        return None
    sandbox_kernel.remove_cgroup(probe)
    sandbox.memory_cgroup = where
    return version


def _visible_tree(binds: list[list[str]]) -> dict[str, list[str]]:
    """What the new root shows outside the bound directories: each directory made on the way to
    a bind (and /sandbox) -> its entries, which are exactly the next steps towards them."""
    tree: dict[str, set[str]] = {"/": set()}
    for path in [*(path for _, path in binds), _WORK + "/main.py"]:
        parts = path.strip("/").split("/")
        for depth, name in enumerate(parts):
            tree.setdefault("/" + "/".join(parts[:depth]), set()).add(name)
    for kind, path in binds:
        if kind == "dir":  # the host's directory itself, read-only, as intended
            tree.pop(path, None)
    return {directory: sorted(names) for directory, names in sorted(tree.items())}


def _trial_code(package_paths: tuple[str, ...], rootless: bool, visible: dict[str, list[str]]) -> str:
    """The trial's program: prints "ok", or one line per isolation that is missing."""
    keyctl = sandbox_kernel.syscall_number(platform.machine(), "keyctl")
    return (f"PACKAGES = {list(package_paths)!r}\nROOTLESS = {rootless!r}\nVISIBLE = {visible!r}\n"
            f"KEYCTL = {keyctl}\n{_TRIAL}")  # fmt: skip


# The isolation checks of the constructor's trial run (as the child, inside the sandbox).
_TRIAL = """
import ctypes, errno, os, socket
problems = []
# Rootless, the caller's supplementary groups stay: its own gid (mapped to the run's), the others
# unmapped (the overflow gid).
groups = [g for g in os.getgroups() if not (ROOTLESS and g in (os.getgid(), 65534))]
if os.getuid() == 0 or os.geteuid() == 0 or groups:
    problems.append("privilege drop: uid %d, groups %s" % (os.getuid(), os.getgroups()))
try:
    os.chroot("/")  # needs CAP_SYS_CHROOT (in the run's user namespace too, rootless)
    problems.append("privilege drop: the code holds capabilities (chroot worked)")
except PermissionError:
    pass
if os.getpid() != 1:
    problems.append("pid namespace: the child is not its PID 1")
try:
    socket.create_connection(("127.0.0.1", 9), timeout=1).close()
    problems.append("network namespace: loopback reachable")
except OSError as exc:
    if exc.errno != errno.ENETUNREACH:
        problems.append("network namespace: loopback answered (%s)" % exc)
# No host file: each directory of the new root outside the bound ones holds only the next steps
# towards them (so no /tmp, /proc or checkout beyond the path to the packages).
visible = []
for directory, names in VISIBLE.items():
    try:
        visible += [os.path.join(directory, name) for name in sorted(set(os.listdir(directory)) - set(names))]
    except OSError as exc:
        problems.append("file isolation: %s of the new root unreadable: %s" % (directory, exc))
if visible:
    problems.append("file isolation: host files visible in the new root: %s" % ", ".join(visible))
libc = ctypes.CDLL(None, use_errno=True)
# The seccomp filter: the keyrings, SysV shared memory, memfds and new namespaces refused.
for what, call in (("keyrings: keyctl", lambda: libc.syscall(KEYCTL, 0, -3, 0)),  # KEYCTL_GET_KEYRING_ID @s
                   ("SysV IPC: shmget", lambda: libc.shmget(0, 4096, 0o1600)),
                   ("namespaces: unshare(CLONE_NEWUSER)", lambda: libc.unshare(0x10000000))):
    if call() != -1 or ctypes.get_errno() != errno.EPERM:
        problems.append("seccomp: %s is not refused (errno %d)" % (what, ctypes.get_errno()))
try:
    os.close(os.memfd_create("trial"))
    problems.append("seccomp: memfd_create is not refused")
except PermissionError:
    pass
for path in PACKAGES:
    try:
        os.listdir(path)
    except OSError as exc:
        problems.append("packages: %s unreadable by the run's uid: %s" % (path, exc))
print("\\n".join(problems) or "ok")
"""

# Runs as the child's interpreter (python -I -S -B -X utf8 -c _WRAPPER PACKAGE_PATH...): the
# package paths appended to sys.path, main.py as __main__, with an uncaught exception of a
# limit's kind turned into that limit's exit code (_EXIT_LIMITS).
_WRAPPER = """# megatron-rl-sandbox
import errno, sys, traceback
sys.path.extend(sys.argv[1:])
sys.argv = ["main.py"]
namespace = {"__name__": "__main__", "__file__": "main.py", "__builtins__": __builtins__}
def report(exc):
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == "<string>":
        tb = tb.tb_next
    traceback.print_exception(type(exc), exc, tb)
try:
    with open("main.py", encoding="utf-8") as file:
        source = file.read()
    exec(compile(source, "main.py", "exec"), namespace)
except SystemExit:
    raise
except MemoryError as exc:
    namespace.clear()
    report(exc)
    sys.exit(201)
except BaseException as exc:
    report(exc)
    if isinstance(exc, BlockingIOError) and exc.errno == errno.EAGAIN:
        sys.exit(202)
    if isinstance(exc, RuntimeError) and "can't start new thread" in str(exc):
        sys.exit(202)
    if isinstance(exc, OSError) and exc.errno == errno.EFBIG:
        sys.exit(203)
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        sys.exit(204)
    sys.exit(1)
"""

# The supervisor (python -I -S -B -c _SUPERVISOR CONFIG_JSON), the run's code on stdin. It
# reports "SETUP <what>: <why>" for anything it could not isolate (and never runs the code then),
# else "EXIT <n>" or "SIGNAL <n>" of the child, on the status pipe.
_SUPERVISOR = r"""# megatron-rl-sandbox supervisor
import ctypes, errno, json, os, resource, signal, sys
cfg = json.loads(sys.argv[1])
status = cfg["status_fd"]
libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
libc.unshare.argtypes = [ctypes.c_int]
libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
libc.syscall.argtypes = [ctypes.c_long, ctypes.c_char_p, ctypes.c_char_p]
keyctl = libc["syscall"]  # another handle on syscall(2), with keyctl's argument types
keyctl.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p]
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 1, 38, 22, 2
KEYCTL_JOIN_SESSION_KEYRING = 1

class SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint)]

class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(SockFilter))]

def report(line):
    os.write(status, (" ".join(line.split()) + "\n").encode())

def fail(what):
    report("SETUP " + what)
    os._exit(70)

def check(result, what):
    if result != 0:
        code = ctypes.get_errno()
        fail("%s failed: %s (%s)" % (what, errno.errorcode.get(code, code), os.strerror(code)))

def mount(source, target, fstype, flags, data, what):
    enc = lambda text: None if text is None else text.encode()
    check(libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)), what)

def kept_flags(target):
    # A remount keeps the flags the mount already has (a user namespace may not clear them:
    # the atime flags, noexec, nosuid, nodev, read-only of the caller's mounts are locked).
    have = os.statvfs(target).f_flag
    return sum(ms for st, ms in ((1, MS_RDONLY), (2, MS_NOSUID), (4, MS_NODEV), (8, MS_NOEXEC), (1024, 1024),
                                 (2048, 2048), (4096, 1 << 21)) if have & st)

def write(path, value, what):
    try:
        fd = os.open(path, os.O_WRONLY)
        try:
            os.write(fd, value.encode())
        finally:
            os.close(fd)
    except OSError as exc:
        fail("%s: writing %s to %s: %s" % (what, value, path, exc))

def seccomp():
    program = (SockFilter * len(cfg["seccomp"]))(*[SockFilter(*insn) for insn in cfg["seccomp"]])
    prog = SockFprog(len(cfg["seccomp"]), program)
    check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(prog), 0, 0),
          "seccomp: installing the filter (prctl PR_SET_SECCOMP)")

def child(lifeline):
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    uid, root, work = cfg["uid"], cfg["root"], cfg["work"]
    if cfg["cgroup_procs"]:  # first: everything the run allocates from here on is charged to it
        write(cfg["cgroup_procs"], "0", "memory cgroup: joining the run's cgroup")
    check(libc.unshare(0x00020000), "mount namespace: unshare(CLONE_NEWNS) of the child")
    code = b"".join(iter(lambda: os.read(0, 1 << 16), b""))
    mount(None, "/", None, MS_REC | MS_PRIVATE, None, "file isolation: making the mounts private")
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=4m,nr_inodes=4096,mode=0755", "file isolation: the new root (tmpfs)")
    for kind, path in cfg["binds"]:
        target = root + path
        try:
            os.makedirs(os.path.dirname(target), 0o755, exist_ok=True)
            if kind == "link":
                os.symlink(os.readlink(path), target)
                continue
            if kind == "dir":
                os.makedirs(target, 0o755, exist_ok=True)
            else:
                os.close(os.open(target, os.O_WRONLY | os.O_CREAT, 0o644))
        except OSError as exc:
            fail("file isolation: preparing %s in the new root: %s" % (path, exc))
        what = "file isolation: bind mount of " + path
        mount(path, target, None, MS_BIND, None, what)
        flags = MS_REMOUNT | MS_BIND | MS_NOSUID | (MS_NOEXEC if kind == "dev" else MS_RDONLY | MS_NODEV)
        flags |= kept_flags(target)
        mount(None, target, None, flags, None, what + " (read-only remount)")
    os.mkdir(root + work)
    options = "size=%d,nr_inodes=%d,mode=0700,uid=%d,gid=%d" % (cfg["work_bytes"], cfg["max_files"], uid, uid)
    mount("tmpfs", root + work, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, options, "file isolation: the work directory (tmpfs)")
    fd = os.open(root + work + "/main.py", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, code)
    os.fchown(fd, uid, uid)
    os.close(fd)
    mount(None, root, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, None, "file isolation: read-only new root")
    os.chdir(root)
    check(libc.syscall(cfg["pivot_root"], b".", b"."), "file isolation: pivot_root")
    check(libc.umount2(b".", 2), "file isolation: detaching the old root")
    os.chdir(work)
    check(libc.sethostname(b"sandbox", 7), "uts namespace: sethostname")
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    try:
        # Rootless, the supervisor is a task of the run's uid in its user namespace too.
        processes = cfg["processes"] + (1 if cfg["rootless"] else 0)
        for limit, value in ((resource.RLIMIT_AS, cfg["memory"]), (resource.RLIMIT_NPROC, processes),
                             (resource.RLIMIT_FSIZE, cfg["file_bytes"]), (resource.RLIMIT_CORE, 0),
                             (resource.RLIMIT_NOFILE, cfg["descriptors"]), (resource.RLIMIT_MSGQUEUE, 0),
                             (resource.RLIMIT_SIGPENDING, cfg["pending_signals"])):
            hard = resource.getrlimit(limit)[1]  # never above the current hard limit
            value = value if hard == resource.RLIM_INFINITY else min(value, hard)
            resource.setrlimit(limit, (value, value))
    except (OSError, ValueError) as exc:
        fail("limits: setrlimit: %s" % exc)
    try:
        if not cfg["rootless"]:  # rootless, setgroups is denied: the groups stay, unmapped
            os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    except OSError as exc:
        fail("privilege drop: to uid/gid %d: %s" % (uid, exc))
    # A new, empty session keyring instead of the caller's; the filter then refuses the keyring
    # calls altogether, so a kernel without keyrings (ENOSYS) or a caller's key quota spent by
    # many runs at once (EDQUOT, rootless: the keyrings are the caller's user's) leave it there.
    if keyctl(cfg["keyctl"], KEYCTL_JOIN_SESSION_KEYRING, None) < 0 and ctypes.get_errno() not in (
        errno.ENOSYS, errno.EDQUOT):
        check(-1, "keyrings: joining a new session keyring")
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "privilege drop: PR_SET_NO_NEW_PRIVS")
    check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "kill on exit: PR_SET_PDEATHSIG")
    os.set_blocking(lifeline, False)
    try:
        if os.read(lifeline, 1) == b"":  # the supervisor died before the death signal was set
            os._exit(71)
    except BlockingIOError:
        pass
    os.set_inheritable(status, False)
    seccomp()  # last: the filter holds from the exec on
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": work, "TMPDIR": work, "LANG": "C.UTF-8",
           "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    python = cfg["python"]
    try:
        os.execve(python, [python, "-I", "-S", "-B", "-X", "utf8", "-c", cfg["wrapper"], *cfg["paths"]], env)
    except OSError as exc:
        fail("interpreter: cannot execute %s as uid %d in the new root: %s" % (python, uid, exc))

def enter_user_namespace():
    # Rootless: the run's uid and gid are the only ones mapped (to the caller's), setgroups denied.
    check(libc.unshare(0x10000000), "user namespace: unshare(CLONE_NEWUSER) (unprivileged user namespaces refused here?)")
    for name, line in (("setgroups", "deny"), ("uid_map", "%d %d 1" % (cfg["uid"], cfg["outer_uid"])),
                       ("gid_map", "%d %d 1" % (cfg["uid"], cfg["outer_gid"]))):
        try:
            fd = os.open("/proc/self/" + name, os.O_WRONLY)
            try:
                os.write(fd, line.encode())
            finally:
                os.close(fd)
        except OSError as exc:
            fail("user namespace: writing /proc/self/%s: %s" % (name, exc))

def main():
    if cfg["rootless"]:
        enter_user_namespace()
    for name, flag_name, flag in cfg["namespaces"]:
        check(libc.unshare(flag), "%s: unshare(%s)" % (name, flag_name))
    for name, value in cfg["ipc_sysctls"]:  # this IPC namespace's own limits: no SysV IPC
        write("/proc/sys/" + name, value, "ipc namespace: SysV IPC limits")
    pid, terminated = 0, []
    def on_term(signum, frame):
        terminated.append(signum)
        if pid > 0:
            os.kill(pid, signal.SIGKILL)
    signal.signal(signal.SIGTERM, on_term)
    lifeline, keep = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(keep)
            child(lifeline)
        except BaseException as exc:
            fail("sandbox setup: %r" % (exc,))
        os._exit(70)
    os.close(lifeline)
    if terminated:
        os.kill(pid, signal.SIGKILL)
    null = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    _, wait_status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(wait_status)
    report("EXIT %d" % code if code >= 0 else "SIGNAL %d" % -code)

try:
    main()
except BaseException as exc:
    fail("sandbox supervisor: %r" % (exc,))
"""
