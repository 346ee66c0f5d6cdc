"""The sandboxed Python tool: plain runs and exceptions; each escape tried (a fork bomb, an endless
loop, a memory hog, a huge print, reading and writing outside its directory, a socket to the host,
a setsid() child) is contained and named, and afterwards no sandbox process is left; concurrent
runs do not interfere; the venv's packages (sympy, numpy) import from a read-only mount, or are
absent with packages=False; the limits are validated; missing isolation is refused by name."""

from __future__ import annotations

import ast
import ctypes
import dataclasses
import json
import os
import platform
import re
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
import venv
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest

from megatron_rl.envs import sandbox as sandbox_module
from megatron_rl.envs import sandbox_kernel
from megatron_rl.envs.sandbox import (
    UID_RANGE,
    PythonSandbox,
    SandboxLimits,
    SandboxResult,
    SandboxUnavailable,
)

# One worker for the whole file: a run's processes must not be mistaken for another test's leftovers.
pytestmark = pytest.mark.xdist_group("sandbox")

ROOT = Path(__file__).resolve().parents[2]
LIMITS = SandboxLimits(timeout_s=5.0, memory_mb=256, processes=16, output_bytes=8192, file_bytes=1 << 20)
QUICK = dataclasses.replace(LIMITS, timeout_s=2.0)  # a run's own limits: for those that end at the time limit
# The venv's site-packages directories, as the sandbox mounts them (this interpreter is the venv's).
SITE_PACKAGES = tuple(
    dict.fromkeys(os.path.realpath(path) for path in sys.path if path.endswith("site-packages"))
)


def sandbox_processes() -> list[str]:
    """Processes of a sandbox run: a uid of UID_RANGE, or the marker in the command line."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            status = Path(f"/proc/{entry}/status").read_text()
            cmdline = (
                Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            )
        except OSError:  # gone meanwhile
            continue
        uid = int(next(line.split()[1] for line in status.splitlines() if line.startswith("Uid:")))
        if uid in UID_RANGE or sandbox_module._MARKER in cmdline:
            found.append(f"{entry} uid {uid}: {cmdline[:120]}")
    return found


@pytest.fixture(autouse=True)
def nothing_left_running():
    assert sandbox_processes() == [], "sandbox processes before the test"
    yield
    assert sandbox_processes() == [], "sandbox processes left running"


def make(
    limits: SandboxLimits = LIMITS, packages: bool = True, python: str = sys.executable
) -> PythonSandbox:
    try:
        return PythonSandbox(limits, python=python, packages=packages)
    except SandboxUnavailable as exc:
        # As root (this machine, CI) the isolation must be there: a refusal fails the test. Not as
        # root it needs unprivileged user namespaces (the rootless mode), which a machine may
        # refuse: the escapes cannot be tried there, and the refusal tests below still run.
        if os.geteuid() == 0:
            raise
        pytest.skip(f"sandbox isolation unavailable on this machine: {exc}")


@pytest.fixture(scope="module")
def sandbox() -> PythonSandbox:
    return make()


@pytest.fixture(scope="module")
def stdlib_sandbox() -> PythonSandbox:
    return make(packages=False)


@pytest.fixture
def outside():
    """A world-readable, world-writable directory outside the sandbox (only isolation keeps it out)."""
    with tempfile.TemporaryDirectory(prefix="sandbox-outside-") as path:
        os.chmod(path, 0o777)
        yield Path(path)


def test_a_plain_run_prints_and_an_exception_is_an_error_with_its_traceback(sandbox):
    result = sandbox.run("import math\nprint(math.comb(10, 3))")
    assert result.ok and result.stdout == "120\n" and result.exit_code == 0 and result.error is None
    assert result.observation() == "120\n"
    failed = sandbox.run("print('partial')\nx = 1\nx / 0")
    assert not failed.ok and failed.limit is None and failed.exit_code == 1
    assert failed.error == "exit code 1: ZeroDivisionError: division by zero"
    seen = failed.observation()
    assert seen.startswith("partial") and 'File "main.py", line 3' in seen and "x / 0" in seen
    assert "<string>" not in failed.stderr  # the wrapper's frames are not shown
    assert sandbox.run("import sys; sys.exit(3)").error == "exit code 3"


def test_the_child_is_pid_1_of_its_namespace_as_an_unprivileged_uid_in_its_own_directory(sandbox):
    result = sandbox.run(
        "import os\nopen('note', 'w').write('kept')\n"
        "print(os.getuid(), os.getgid(), os.getgroups(), os.getpid(), os.getcwd(), open('note').read())"
    )
    uid, gid, groups, pid, cwd, note = result.stdout.split()
    assert int(uid) in UID_RANGE and gid == uid and groups == "[]" and pid == "1"
    assert (cwd, note) == ("/sandbox", "kept")
    # A fresh directory per run: the last run's file is gone.
    assert sandbox.run("import os; print(os.listdir('.'))").stdout == "['main.py']\n"


def test_a_fork_bomb_hits_the_process_limit(sandbox):
    result = sandbox.run("import os\nwhile True:\n    os.fork()")
    assert result.limit == "processes" and result.error == "process limit: 16 processes and threads"
    assert "BlockingIOError" in result.stderr


def test_threads_count_as_processes(sandbox):
    code = "import threading, time\nfor _ in range(100):\n    threading.Thread(target=time.sleep, args=(5,), daemon=True).start()"
    assert sandbox.run(code).limit == "processes"


def test_an_endless_loop_is_killed_at_the_time_limit(sandbox):
    result = sandbox.run("print('start', flush=True)\nwhile True:\n    pass", QUICK)
    assert result.limit == "time" and result.exit_code is None and result.stdout == "start\n"
    assert result.error == "time limit: killed after 2 s"
    assert result.observation().endswith("error: time limit: killed after 2 s")


def test_a_memory_hog_hits_the_memory_limit(sandbox):
    for code in (
        "x = bytearray(10**10)",
        "x = []\nwhile True:\n    x.append(' ' * 10**6)",
        "print('x' * 10**9)",
    ):
        result = sandbox.run(code)
        assert result.limit == "memory" and result.error == "memory limit: 256 MB", code
        assert "MemoryError" in result.stderr


def test_a_huge_print_hits_the_output_limit_and_is_not_kept(sandbox):
    for code in ("while True:\n    print('x' * 1000)", "import sys; sys.stdout.write('y' * 10**7)"):
        result = sandbox.run(code)
        assert result.limit == "output" and result.exit_code is None, code
        assert result.error == "output limit: more than 8192 bytes of output"
        assert len(result.stdout) + len(result.stderr) <= 8192
        assert len(result.observation()) <= 4096 + 100


def test_files_outside_cannot_be_read(sandbox, stdlib_sandbox, outside):
    secrets = {}
    for mode in (0o600, 0o644):
        path = outside / f"secret-{mode:o}"
        path.write_text(f"SECRET-{mode:o}")
        path.chmod(mode)
        secrets[path] = f"SECRET-{mode:o}"
    checkout, venv = [ROOT / "pyproject.toml", ROOT / "README.md"], Path(sys.prefix)
    # The venv beyond its site-packages:
    venv_files = [Path(sys.executable), venv / "pyvenv.cfg", venv / "bin" / "activate"]
    for path in [*secrets, *checkout, *venv_files, Path("/etc/passwd")]:
        result = sandbox.run(f"print(open({str(path)!r}).read())")
        assert result.error.startswith("exit code 1: FileNotFoundError"), (path, result.error)
        assert "SECRET" not in result.stdout
    listing = stdlib_sandbox.run("import os\nprint(sorted(os.listdir('/')))").stdout
    assert "tmp" not in listing and ROOT.parts[1] not in listing and "proc" not in listing
    # With the packages: of a site-packages directory's ancestors (below the system directories and
    # the base prefix, mounted whole), each holds only the next step towards it.
    mounted = [Path("/usr"), Path(os.path.realpath(sys.base_prefix))]
    for site in SITE_PACKAGES:
        parts = Path(site).parts
        for depth in range(2, len(parts)):
            parent = Path(*parts[:depth])
            if any(parent == top or top in parent.parents for top in mounted):
                break
            shown = sandbox.run(f"import os\nprint(os.listdir({str(parent)!r}))").stdout
            assert shown == f"[{parts[depth]!r}]\n", (parent, shown)


def test_files_outside_cannot_be_written(sandbox, outside):
    marker = f"sandbox-write-{os.getpid()}"
    targets = [outside / marker, Path("/tmp") / marker, ROOT / marker]
    for path in targets:  # (the checkout's directory exists, read-only, when the venv's packages are in it)
        result = sandbox.run(f"open({str(path)!r}, 'w').write('x')")
        refused = ("exit code 1: FileNotFoundError", "exit code 1: OSError: [Errno 30] Read-only")
        assert result.error.startswith(refused), (path, result.error)
    for path in ("/usr/" + marker, "/" + marker, "/root/" + marker):  # the read-only new root
        result = sandbox.run(f"open({path!r}, 'w').write('x')")
        assert "Read-only file system" in result.error or "Permission denied" in result.error, result.error
    assert not any(path.exists() for path in targets) and not Path("/usr", marker).exists()


def test_sympy_and_numpy_import_from_the_venv(sandbox):
    assert sandbox.package_paths == SITE_PACKAGES and SITE_PACKAGES
    result = sandbox.run("import sympy\nprint(sympy.simplify('2*x+3*x'))")
    assert result.ok and result.stdout == "5*x\n", result.error
    # Under 256 MB and 16 processes: OpenBLAS is told to start no threads.
    result = sandbox.run(
        "import os, numpy\nprint(numpy.arange(3).sum())\na = numpy.ones((64, 64))\nprint((a @ a)[0, 0])\n"
        "print(os.environ['OPENBLAS_NUM_THREADS'], os.environ['OMP_NUM_THREADS'], os.environ['MKL_NUM_THREADS'])"
    )
    assert result.ok and result.stdout == "3\n64.0\n1 1 1\n", result.error
    # Isolated mode kept: the site-packages appended, nothing else (no user site, no cwd, no .pth).
    result = sandbox.run("import sys\nprint(sys.flags.isolated, sys.flags.no_site, sys.path)")
    isolated, no_site, path = result.stdout.split(" ", 2)
    assert (isolated, no_site) == ("1", "1")
    path = ast.literal_eval(path)
    assert tuple(path[-len(SITE_PACKAGES) :]) == SITE_PACKAGES
    assert all(entry.startswith(os.path.realpath(sys.base_prefix)) for entry in path[: -len(SITE_PACKAGES)])


def test_the_packages_are_read_only(sandbox):
    site = next(Path(path) for path in SITE_PACKAGES if (Path(path) / "numpy").is_dir())
    new, existing = site / f"sandbox-write-{os.getpid()}", site / "numpy" / "__init__.py"
    try:
        for code in (f"open({str(new)!r}, 'w').write('x')", f"import os; os.mkdir({str(new)!r})"):
            result = sandbox.run(code)
            assert "OSError: [Errno 30] Read-only file system" in result.error, (code, result.error)
        result = sandbox.run(f"open({str(existing)!r}, 'a')")  # the file's mode refuses first
        assert "Permission denied" in result.error or "Read-only file system" in result.error, result.error
        # The mount itself: read-only, nosuid, nodev.
        flags = int(sandbox.run(f"import os; print(os.statvfs({str(site)!r}).f_flag)").stdout)
        assert flags & os.ST_RDONLY and flags & os.ST_NOSUID and flags & os.ST_NODEV, flags
        assert not new.exists()
    finally:
        if new.is_file():
            new.unlink()
        elif new.is_dir():
            new.rmdir()


def test_without_packages_only_the_standard_library(stdlib_sandbox):
    assert stdlib_sandbox.package_paths == ()
    for name in ("sympy", "numpy"):
        result = stdlib_sandbox.run(f"import {name}")
        assert result.error == f"exit code 1: ModuleNotFoundError: No module named {name!r}"
    assert stdlib_sandbox.run("import json, fractions\nprint(fractions.Fraction(1, 3))").stdout == "1/3\n"
    with pytest.raises(TypeError, match="packages must be True or False"):
        PythonSandbox(LIMITS, packages="no")


def test_a_large_file_hits_the_file_size_limit(sandbox):
    result = sandbox.run("open('big', 'wb').write(b'x' * (2 << 20))")
    assert result.limit == "file_size" and result.error == f"file size limit: {1 << 20} bytes per file"
    many = "for i in range(10):\n    open(f'f{i}', 'wb').write(b'x' * (1 << 20))"
    result = sandbox.run(many)  # the directory holds 4 x file_bytes
    assert result.limit == "file_size" and "the directory holds" in result.error


def test_no_network_not_even_the_hosts_loopback(sandbox, outside):
    with (
        socket.socket() as server,
        socket.socket(socket.AF_UNIX) as unix_server,
        socket.socket(socket.AF_UNIX) as abstract_server,
    ):
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.setblocking(False)
        unix_path = str(outside / "server.sock")
        unix_server.bind(unix_path)
        os.chmod(unix_path, 0o777)
        unix_server.listen()
        unix_server.setblocking(False)
        port = server.getsockname()[1]
        for address in (("127.0.0.1", port), ("localhost", port), ("8.8.8.8", 53)):
            result = sandbox.run(f"import socket\nsocket.create_connection({address!r}, timeout=2)")
            assert not result.ok and result.limit is None, address
            assert "Network is unreachable" in result.error or "gaierror" in result.error, (
                address,
                result.error,
            )
        result = sandbox.run(f"import socket\nsocket.socket(socket.AF_UNIX).connect({unix_path!r})")
        assert result.error.startswith("exit code 1: FileNotFoundError")
        # An abstract Unix socket (no file): each network namespace has its own.
        abstract_server.bind(b"\0megatron-rl-sandbox-test-%d" % os.getpid())
        abstract_server.listen()
        abstract_server.setblocking(False)
        result = sandbox.run(
            f"import socket\nsocket.socket(socket.AF_UNIX).connect({abstract_server.getsockname()!r})"
        )
        assert result.error.startswith("exit code 1: ConnectionRefusedError"), result.error
        for listening in (server, unix_server, abstract_server):
            with pytest.raises(BlockingIOError):
                listening.accept()


def test_a_setsid_grandchild_dies_with_the_run(sandbox):
    escape = textwrap.dedent(
        """\
        import os, time
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                time.sleep(60)
            os._exit(0)
        print('parent', flush=True)
        """
    )
    result = sandbox.run(escape)  # exits at once: its namespace and all in it go with it
    assert result.ok and result.stdout == "parent\n"
    result = sandbox.run(escape + "time.sleep(60)\n", QUICK)  # killed at the time limit, all of it
    assert result.limit == "time" and result.stdout == "parent\n"


def test_concurrent_runs_do_not_interfere(sandbox):
    work = "import os\nfor _ in range(4):\n    pid = os.fork()\n    if pid == 0:\n        os._exit(7)\n    os.waitpid(pid, 0)\nprint(sum(range({n})))"
    bomb = "import os\nwhile True:\n    os.fork()"
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(sandbox.run, [bomb, work.format(n=10), bomb, work.format(n=100)]))
    assert [r.limit for r in results] == ["processes", None, "processes", None]
    assert [results[1].stdout, results[3].stdout] == ["45\n", "4950\n"]


KEY_DESCRIPTION, KEY_PAYLOAD = "megatron-rl-sandbox-test-key", "megatron-rl-secret-payload"


def syscall(name: str) -> int:
    return sandbox_kernel.syscall_number(platform.machine(), name)


def keyring_probe(serial: str) -> str:
    """A program that tries each way to the caller's key `serial` (KEY_DESCRIPTION) and prints
    {attempt: [result, errno name, data read]}."""
    return textwrap.dedent(
        f"""\
        import ctypes, errno, json
        libc = ctypes.CDLL(None, use_errno=True)
        found, buffer = {{}}, ctypes.create_string_buffer(256)
        def attempt(name, result, data=b""):
            code = errno.errorcode.get(ctypes.get_errno(), "") if result == -1 else ""
            found[name] = [result, code, data.decode(errors="replace")]
        attempt("request_key", libc.syscall({syscall("request_key")}, b"user", {KEY_DESCRIPTION.encode()!r}, None, 0))
        length = libc.syscall({syscall("keyctl")}, 11, {serial}, buffer, 256)  # KEYCTL_READ
        attempt("read", length, buffer.raw[: max(length, 0)])
        attempt("session_keyring", libc.syscall({syscall("keyctl")}, 0, -3, 0))  # KEYCTL_GET_KEYRING_ID @s
        attempt("add_key", libc.syscall({syscall("add_key")}, b"user", b"planted", b"x", 1, -4))  # to @u
        print(json.dumps(found))
        """
    )


def assert_keys_unreachable(stdout: str) -> None:
    found = json.loads(stdout)
    assert KEY_PAYLOAD not in stdout
    assert {name: (result, code) for name, (result, code, _) in found.items()} == dict.fromkeys(
        ("request_key", "read", "session_keyring", "add_key"), (-1, "EPERM")
    ), found


@contextmanager
def caller_key():
    """A key in a new session keyring of the calling thread (so only what it starts inherits it):
    yields its serial, then invalidates it."""
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.syscall(syscall("keyctl"), 1, b"megatron-rl-sandbox-test") > 0, ctypes.get_errno()
    payload = KEY_PAYLOAD.encode()
    serial = libc.syscall(syscall("add_key"), b"user", KEY_DESCRIPTION.encode(), payload, len(payload), -3)
    assert serial > 0, ctypes.get_errno()
    try:
        yield serial
    finally:
        libc.syscall(syscall("keyctl"), 21, serial)  # KEYCTL_INVALIDATE


def in_own_thread(function):
    """function() on a thread of its own (its keyring goes with it); its result or exception."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(function).result()


def test_a_key_the_caller_holds_cannot_be_read(sandbox, monkeypatch):
    """The caller's session keyring (Kerberos tickets, cluster tokens) is not the run's: the
    keyring calls are refused, and the run's session keyring is a new, empty one besides."""

    def attempts():
        with caller_key() as serial:
            libc, buffer = ctypes.CDLL(None, use_errno=True), ctypes.create_string_buffer(256)
            assert libc.syscall(syscall("keyctl"), 11, serial, buffer, 256) == len(
                KEY_PAYLOAD
            )  # the caller reads it
            return sandbox.run(keyring_probe(str(serial)))

    refused = in_own_thread(attempts)
    assert refused.ok, refused.error
    assert_keys_unreachable(refused.stdout)
    # The new session keyring alone (under a filter that allows every call): the key is not found,
    # not readable, and @s is another keyring.
    monkeypatch.setattr(sandbox, "_seccomp", [(0x06, 0, 0, 0x7FFF0000)])
    unfiltered = in_own_thread(attempts)
    monkeypatch.undo()
    found = json.loads(unfiltered.stdout)
    assert KEY_PAYLOAD not in unfiltered.stdout, found
    assert found["request_key"][:2] == [-1, "ENOKEY"] and found["read"][:2] == [-1, "EACCES"], found
    assert found["session_keyring"][0] > 0, found


KERNEL_MEMORY_PROBE = textwrap.dedent(
    """\
    import ctypes, errno, fcntl, json, os, socket
    libc = ctypes.CDLL(None, use_errno=True)
    libc.shmat.restype = ctypes.c_void_p
    found = {}
    def refused(name, result):
        found[name] = "refused" if result == -1 and ctypes.get_errno() == errno.EPERM else "allowed: %r" % result
    # SysV shared memory (attached, and held detached), message queues, semaphores; POSIX queues
    segment = libc.shmget(0, 8 << 20, 0o1600)
    refused("shmget", segment)
    if segment != -1:
        address = libc.shmat(segment, None, 0)
        ctypes.memset(address, 1, 8 << 20)
        libc.shmdt(ctypes.c_void_p(address))
    refused("msgget", libc.msgget(0, 0o1600))
    refused("semget", libc.semget(0, 8, 0o1600))
    refused("mq_open", libc.mq_open(b"/megatron-rl", 0o102, 0o600, None))
    try:
        os.write(os.memfd_create("hold"), b"x" * (1 << 20))
        found["memfd_create"] = "allowed"
    except PermissionError:
        found["memfd_create"] = "refused"
    # Pipes, filled, until the descriptor limit; a pipe's size cannot be raised
    held, fds = 0, []
    try:
        while True:
            read, write = os.pipe()
            fds += [read, write]
            try:
                fcntl.fcntl(write, 1031, 1 << 20)  # F_SETPIPE_SZ
                found["F_SETPIPE_SZ"] = "allowed"
            except PermissionError:
                found["F_SETPIPE_SZ"] = "refused"
            os.set_blocking(write, False)
            try:
                while True:
                    held += os.write(write, b"x" * 65536)
            except BlockingIOError:
                pass
    except OSError as exc:
        found["pipes_end"] = errno.errorcode[exc.errno]
    found["pipe_bytes"] = held
    for fd in fds:
        os.close(fd)
    # Socket buffers (stream and datagram pairs), likewise; a socket's buffers cannot be raised
    held, sockets = 0, []
    try:
        while True:
            pair = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM if len(sockets) % 4 else socket.SOCK_STREAM)
            sockets += pair
            for end in pair:
                try:
                    end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 24)
                    found["SO_SNDBUF"] = "allowed"
                except PermissionError:
                    found["SO_SNDBUF"] = "refused"
                end.setblocking(False)
                try:
                    while True:
                        held += end.send(b"x" * 32768)
                except BlockingIOError:
                    pass
    except OSError as exc:
        found["sockets_end"] = errno.errorcode[exc.errno]
    found["socket_bytes"] = held
    for end in sockets:
        end.close()
    # Files in the writable directory, unlinked while open
    held, files = 0, []
    try:
        for index in range(64):
            files.append(os.open("hold%d" % index, os.O_WRONLY | os.O_CREAT))
            os.unlink("hold%d" % index)
            held += os.write(files[-1], b"x" * (1 << 20))
    except OSError as exc:
        found["files_end"] = errno.errorcode[exc.errno]
    found["file_bytes"] = held
    print(json.dumps(found))
    """
)


def assert_kernel_memory_bounded(stdout: str, limits: SandboxLimits = LIMITS) -> None:
    """What KERNEL_MEMORY_PROBE found: each way around the address space refused or bounded by
    the descriptor limit (pipes, sockets) and the directory's size (files)."""
    found = json.loads(stdout)
    for name in ("shmget", "msgget", "semget", "mq_open", "memfd_create", "F_SETPIPE_SZ", "SO_SNDBUF"):
        assert found[name] == "refused", (name, found)
    assert found["pipes_end"] == found["sockets_end"] == "EMFILE" and found["files_end"] == "ENOSPC", found
    descriptors = sandbox_module._MAX_DESCRIPTORS
    wmem_default = int(Path("/proc/sys/net/core/wmem_default").read_text())
    assert 0 < found["pipe_bytes"] <= descriptors * 65536, found
    assert 0 < found["socket_bytes"] <= descriptors * 2 * wmem_default, found
    assert 0 < found["file_bytes"] <= 4 * limits.file_bytes + (1 << 20), found


def kernel_probe(host_pid: int) -> str:
    """A program that tries the kernel's other ways out and prints {attempt: errno name, or "" when
    it worked}; `host_pid`: a process outside."""
    return textwrap.dedent(
        f"""\
        import ctypes, errno, json, os, socket, threading
        libc = ctypes.CDLL(None, use_errno=True)
        found = {{"descriptors": []}}
        for fd in range(64):  # what the run starts with: stdin (/dev/null), stdout, stderr
            try:
                os.fstat(fd)
                found["descriptors"].append(fd)
            except OSError:
                pass
        def attempt(name, result):
            found[name] = errno.errorcode.get(ctypes.get_errno(), "?") if result == -1 else ""
        attempt("unshare user", libc.unshare(0x10000000))
        attempt("unshare user+mount+net", libc.unshare(0x10000000 | 0x00020000 | 0x40000000))
        child = libc.syscall({syscall("clone")}, 0x10000000 | 17, 0, 0, 0, 0)  # CLONE_NEWUSER | SIGCHLD
        if child == 0:
            os._exit(0)
        attempt("clone user", child)
        attempt("clone3", libc.syscall({syscall("clone3")}, None, 0))
        attempt("setns", libc.setns(0, 0))
        for family, kind in (("AF_VSOCK", socket.SOCK_STREAM), ("AF_NETLINK", socket.SOCK_RAW),
                             ("AF_ALG", socket.SOCK_SEQPACKET), ("AF_PACKET", socket.SOCK_RAW)):
            try:
                socket.socket(getattr(socket, family), kind).close()
                found[family] = ""
            except OSError as exc:
                found[family] = errno.errorcode[exc.errno]
        attempt("io_uring_setup", libc.syscall({syscall("io_uring_setup")}, 1, None))
        attempt("bpf", libc.syscall({syscall("bpf")}, 0, None, 0))
        attempt("perf_event_open", libc.syscall({syscall("perf_event_open")}, None, 0, -1, -1, 0))
        attempt("userfaultfd", libc.syscall({syscall("userfaultfd")}, 0))
        attempt("inotify_init1", libc.inotify_init1(0))
        attempt("fanotify_init", libc.syscall({syscall("fanotify_init")}, 0, 0))
        buffer = ctypes.create_string_buffer(4096)
        attempt("syslog", libc.klogctl(3, buffer, 4096))
        attempt("kill outside", libc.kill({host_pid}, 0))
        attempt("ptrace outside", libc.ptrace(16, {host_pid}, None, None))  # PTRACE_ATTACH
        # What still works: threads (clone3 refused, the C library falls back to clone), fork, asyncio
        thread = threading.Thread(target=lambda: found.setdefault("thread", "ran"))
        thread.start()
        thread.join()
        pid = os.fork()
        if pid == 0:
            os._exit(7)
        found["fork"] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        import asyncio
        async def answer():
            return 42
        found["asyncio"] = asyncio.run(answer())
        print(json.dumps(found))
        """
    )


def assert_kernel_refused(stdout: str) -> None:
    found = json.loads(stdout)
    refused = ["unshare user", "unshare user+mount+net", "clone user", "setns", "AF_VSOCK", "AF_NETLINK", "AF_ALG",
               "AF_PACKET", "io_uring_setup", "bpf", "perf_event_open", "userfaultfd", "inotify_init1",
               "fanotify_init", "syslog"]  # fmt: skip
    expected = {**dict.fromkeys(refused, "EPERM"), "clone3": "ENOSYS", "kill outside": "ESRCH",
                "ptrace outside": "ESRCH", "thread": "ran", "fork": 7, "asyncio": 42, "descriptors": [0, 1, 2]}  # fmt: skip
    assert found == expected, {
        name: (found.get(name), want) for name, want in expected.items() if found.get(name) != want
    }


def test_memory_outside_the_address_space_is_refused_or_bounded(sandbox):
    """SysV segments (attached or held detached), message queues, semaphores, POSIX queues and
    memfds are refused; pipes, socket buffers and the directory's files stop at the descriptor
    limit and the directory's size."""
    result = sandbox.run(KERNEL_MEMORY_PROBE)
    assert result.ok, (result.error, result.stderr[-2000:])
    assert_kernel_memory_bounded(result.stdout)


def test_no_namespaces_no_other_socket_families_no_risky_kernel_interfaces(sandbox):
    """A user namespace (whose capabilities would mount a tmpfs or own a network namespace), the
    sockets a network namespace does not confine (AF_VSOCK) and the kernel's riskier interfaces
    are refused; a process outside cannot be named; threads, fork and asyncio still work."""
    result = sandbox.run(kernel_probe(os.getpid()))
    assert result.ok, (result.error, result.stderr[-2000:])
    assert_kernel_refused(result.stdout)


def run_cgroups(sandbox: PythonSandbox) -> list[str]:
    return sorted(path.name for path in Path(sandbox.memory_cgroup).glob(sandbox_module._MARKER + "-*"))


def test_the_runs_processes_together_stay_within_its_memory_cgroup(sandbox):
    """Where a memory cgroup can be made (root here: cgroup v1), the run's processes together
    hold at most memory_mb (and the directory): three processes of 100 MB each, every one
    within its own address space limit of 256 MB, are stopped there. Without one (rootless
    here), each process is bounded by its own address space only."""
    code = textwrap.dedent(
        """\
        import os, time
        children = []
        for _ in range(3):
            pid = os.fork()
            if pid == 0:
                block = bytearray(100 << 20)
                block[::4096] = b"x" * len(block[::4096])  # touched: resident
                time.sleep(0.5)
                os._exit(0)
            children.append(pid)
        print([os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in children])
        """
    )
    result = sandbox.run(code)
    if sandbox.memory_cgroup is None:
        assert os.geteuid() != 0 and result.ok and result.stdout == "[0, 0, 0]\n", (
            result.error,
            sandbox.memory_cgroup_missing,
        )
        return
    assert result.limit == "memory" and result.error == "memory limit: 256 MB", (result.error, result.stdout)
    assert "-9" in result.stdout  # the kernel killed one of them
    assert run_cgroups(sandbox) == []  # the run's cgroup is gone with it
    assert sandbox.run("print(sum(range(10)))").stdout == "45\n"


SLEEPER = "import time\ntime.sleep(1.5)"


@pytest.mark.skipif(os.geteuid() != 0, reason="reads another user's /proc entries and enters its namespaces")
def test_a_live_run_seen_from_the_host(sandbox):
    """From outside, while a run sleeps: its PID 1 is under the seccomp filter, with the
    descriptor, message-queue and pending-signal limits; it is in its own memory cgroup with the
    run's limit; its IPC namespace allows no SysV segment, queue or semaphore set."""
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(sandbox.run, SLEEPER)
        deadline = time.monotonic() + 10
        pid = None
        while pid is None and time.monotonic() < deadline:
            for entry in sandbox_processes():
                if "-X utf8" in entry and int(entry.split()[2].rstrip(":")) in UID_RANGE:
                    pid = int(entry.split()[0])
            time.sleep(0.05)
        assert pid is not None, "the run's PID 1 never showed"
        status = Path(f"/proc/{pid}/status").read_text()
        limits = Path(f"/proc/{pid}/limits").read_text()
        cgroups = Path(f"/proc/{pid}/cgroup").read_text()
        ipc = subprocess.run(
            ["nsenter", f"--ipc=/proc/{pid}/ns/ipc", "sh", "-c",
             "cat /proc/sys/kernel/shmmni /proc/sys/kernel/shmall /proc/sys/kernel/msgmni /proc/sys/kernel/sem"],
            capture_output=True, text=True, timeout=10,
        )  # fmt: skip
        cgroup_limit = None
        if sandbox.memory_cgroup:
            version = sandbox._cgroup_version
            prefix = (
                "0::" if version == 2 else next(line for line in cgroups.splitlines() if ":memory:" in line)
            )
            name = Path(
                next(line for line in cgroups.splitlines() if line.startswith(prefix)).split(":", 2)[2]
            ).name
            assert name.startswith(f"{sandbox_module._MARKER}-{os.getpid()}-"), cgroups
            limit_file = "memory.limit_in_bytes" if version == 1 else "memory.max"
            cgroup_limit = int((Path(sandbox.memory_cgroup) / name / limit_file).read_text())
        assert running.result().ok
    assert re.search(r"^Seccomp:\s+2$", status, re.MULTILINE), status
    for name, value in (("Max open files", 64), ("Max msgqueue size", 0), ("Max pending signals", 256)):
        assert re.search(rf"^{name}\s+{value}\s+{value}\s", limits, re.MULTILINE), limits
    assert ipc.returncode == 0 and ipc.stdout.split() == ["0", "0", "0", "0", "0", "0", "0"], ipc
    if sandbox.memory_cgroup:  # memory_mb and the directory, in whole pages
        page = os.sysconf("SC_PAGE_SIZE")
        assert cgroup_limit == ((256 << 20) + 4 * LIMITS.file_bytes + len(SLEEPER) + (1 << 20)) // page * page


@pytest.fixture(scope="module")
def checkout_under_tmp():
    """A checkout's venv under /tmp (as a clone there has): made with `venv`, its site-packages
    holding a module of its own and a .pth naming this venv's (so numpy and sympy import), with
    a secret file beside it in the checkout."""
    with tempfile.TemporaryDirectory(prefix="sandbox-checkout-", dir="/tmp") as directory:
        checkout = Path(directory)
        venv.EnvBuilder(symlinks=True, with_pip=False).create(checkout / ".venv")
        site = next((checkout / ".venv" / "lib").glob("python*/site-packages"))
        (site / "megatron_rl_tmp_probe.py").write_text("ANSWER = 42\n")
        (site / "this_venv.pth").write_text("\n".join(SITE_PACKAGES) + "\n")
        (checkout / "secret.txt").write_text("checkout secret")
        yield checkout


def test_a_checkout_under_tmp_runs_isolated(checkout_under_tmp, sandbox):
    """From a venv under /tmp the trial passes (its check is that no host file is visible, not
    that /tmp is absent: /tmp is on the way to the packages), the venv's packages import, and
    nothing else of /tmp or of the checkout exists in the run."""
    checkout = checkout_under_tmp
    tmp_sandbox = make(python=str(checkout / ".venv" / "bin" / "python"))
    site = os.path.realpath(next((checkout / ".venv" / "lib").glob("python*/site-packages")))
    assert tmp_sandbox.package_paths == (site, *SITE_PACKAGES)
    code = textwrap.dedent(
        f"""\
        import os, megatron_rl_tmp_probe, sympy
        print(megatron_rl_tmp_probe.ANSWER, sympy.Integer(6) * 7, os.listdir("/tmp"), os.listdir({str(checkout)!r}))
        try:
            open({str(checkout / "secret.txt")!r})
        except FileNotFoundError:
            print("secret not found")
        """
    )
    result = tmp_sandbox.run(code)
    assert result.ok, (result.error, result.stderr[-2000:])
    # /tmp: the first step of each package directory under it (this checkout's, and this venv's
    # when the suite itself runs from a checkout under /tmp)
    steps = sorted({Path(path).parts[2] for path in tmp_sandbox.package_paths if path.startswith("/tmp/")})
    assert result.stdout == f"42 42 {steps} ['.venv']\nsecret not found\n"
    # The check itself: a directory that shows more than the way to the packages is named.
    visible = sandbox_module._visible_tree(sandbox._binds)
    visible["/"] = [name for name in visible["/"] if name != "usr"]
    trial = sandbox.run(sandbox_module._trial_code(sandbox.package_paths, sandbox.rootless, visible))
    assert trial.stdout == "file isolation: host files visible in the new root: /usr\n", trial.stdout


def test_limits_are_validated_by_name():
    for field, bad in [
        ("timeout_s", 0), ("timeout_s", -1.0), ("timeout_s", float("inf")), ("timeout_s", float("nan")),
        ("timeout_s", "10"), ("timeout_s", True), ("memory_mb", 0), ("memory_mb", 1.5), ("processes", -1),
        ("output_bytes", None), ("file_bytes", 0), ("file_bytes", False),
    ]:  # fmt: skip
        with pytest.raises(ValueError, match=rf"SandboxLimits\.{field}"):
            SandboxLimits(**{field: bad})
    assert SandboxLimits().timeout_s == 10.0 and SandboxLimits(timeout_s=1).timeout_s == 1


def test_the_observation_is_bounded():
    long = SandboxResult(stdout="a" * 10_000 + "END", stderr="", exit_code=0, limit=None, error=None)
    assert len(long.observation()) <= 4096 and long.observation().endswith("END")
    failed = SandboxResult("o" * 10_000, "e" * 10_000 + "Boom", 1, None, "exit code 1: Boom")
    assert len(failed.observation()) <= 4096 and failed.observation().endswith("Boom")
    killed = SandboxResult("", "", None, "time", "time limit: killed after 2 s")
    assert killed.observation() == "error: time limit: killed after 2 s"


def test_a_disabled_namespace_is_refused_by_name(monkeypatch, tmp_path):
    for name in ("max_mnt_namespaces", "max_pid_namespaces", "max_ipc_namespaces", "max_uts_namespaces"):
        (tmp_path / name).write_text("100\n")
    (tmp_path / "max_net_namespaces").write_text("0\n")
    monkeypatch.setattr(sandbox_module, "_SYSCTL_USER", str(tmp_path))
    with pytest.raises(
        SandboxUnavailable, match=r"network namespace: disabled \(.*max_net_namespaces is 0\)"
    ):
        PythonSandbox(LIMITS)


def test_not_root_without_user_namespaces_is_refused_by_name(monkeypatch, tmp_path):
    for name in ("max_mnt_namespaces", "max_pid_namespaces", "max_ipc_namespaces", "max_uts_namespaces",
                 "max_net_namespaces"):  # fmt: skip
        (tmp_path / name).write_text("100\n")
    (tmp_path / "max_user_namespaces").write_text("0\n")
    monkeypatch.setattr(sandbox_module, "_SYSCTL_USER", str(tmp_path))
    monkeypatch.setattr(sandbox_module.os, "geteuid", lambda: 1000)
    with pytest.raises(SandboxUnavailable, match=r"user namespace: disabled \(.*max_user_namespaces is 0\)"):
        PythonSandbox(LIMITS)


# Run as an unprivileged user (nobody) by the system's interpreter (the venv's lives under root's
# home, closed to other users), with the sandbox's modules imported from a copy of them alone (the
# standard library only). PROBES: the probe programs above, formatted for this machine.
ROOTLESS_SCRIPT = """
import ctypes, json, os, platform, sys
sys.path.insert(0, sys.argv[1])
from megatron_rl.envs import sandbox as module, sandbox_kernel
outside, port = sys.argv[2], int(sys.argv[3])
number = lambda name: sandbox_kernel.syscall_number(platform.machine(), name)
# A key in this caller's own session keyring, which the runs must not read.
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall(number("keyctl"), 1, b"megatron-rl-rootless-test")  # KEYCTL_JOIN_SESSION_KEYRING
key = libc.syscall(number("add_key"), b"user", KEY_DESCRIPTION, KEY_PAYLOAD, len(KEY_PAYLOAD), -3)
box = module.PythonSandbox(module.SandboxLimits(timeout_s=3.0, memory_mb=256, processes=16, output_bytes=8192,
                                                file_bytes=1 << 20), python=sys.executable, packages=False)
codes = {
    "plain": "import os; print(os.getpid(), os.getuid(), sorted(os.listdir('/')))",
    "fork_bomb": "import os\\nwhile True: os.fork()",
    "endless": "while True: pass",
    "memory": "x = bytearray(1 << 30)",
    "print": "print('x' * 100000)",
    "read_outside": "print(open(%r).read())" % (outside + "/secret"),
    "write_outside": "open(%r, 'w').write('escaped')" % (outside + "/written"),
    "socket": "import socket; socket.create_connection(('127.0.0.1', %d), timeout=1)" % port,
    "remount": ("import ctypes, os; libc = ctypes.CDLL(None, use_errno=True); "
                "print(libc.mount(None, b'/usr', None, 32 | 4096, None), ctypes.get_errno())"),
    "setsid": ("import os, time\\nif os.fork() == 0:\\n    os.setsid()\\n    time.sleep(60)\\nprint('parent done')"),
    # SIGKILL to every process it may signal: the caller is the same user outside the namespace.
    "kill_all": "import os\\nif os.fork() == 0:\\n    os.kill(-1, 9)\\n    os._exit(0)\\nos.wait()\\nprint('alive')",
    "keyring": PROBES["keyring"].replace("SERIAL", str(key)),
    "kernel_memory": PROBES["kernel_memory"],
    "kernel": PROBES["kernel"],
}
results = {}
for name, code in codes.items():
    r = box.run(code)
    results[name] = {"ok": r.ok, "limit": r.limit, "error": r.error, "stdout": r.stdout}
cgroup = {name: getattr(box, name, "(no such attribute)") for name in ("memory_cgroup", "memory_cgroup_missing")}
print(json.dumps({"uid": os.geteuid(), "rootless": box.rootless, "key": key, **cgroup, "results": results}))
"""


def standalone_modules(directory: Path) -> Path:
    """A copy of the sandbox's two modules as the package path they import each other by."""
    package = directory / "megatron_rl" / "envs"
    package.mkdir(parents=True)
    for path in (directory / "megatron_rl" / "__init__.py", package / "__init__.py"):
        path.write_text("")
    for module in (sandbox_module, sandbox_kernel):
        (package / Path(module.__file__).name).write_text(Path(module.__file__).read_text())
    for path in [directory, *directory.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return directory


# Only root can start a process as another user: run by a non-root user, this test's caller is
# already not root, and every other test of this file then exercises the rootless mode itself.
@pytest.mark.skipif(os.geteuid() != 0, reason="becomes another user (nobody) to be a non-root caller")
def test_rootless_a_non_root_caller_gets_the_same_isolation(outside):
    """The rootless mode for real: a caller that is not root (uid nobody) runs each escape through
    a sandbox of its own user namespace; each is contained and named as for root, the code holds
    no capability (a remount is refused), cannot read the caller's keys, hold memory outside its
    address space or signal the caller, and nothing is left running (the autouse check)."""
    python = "/usr/bin/python3"
    assert os.access(python, os.X_OK), f"this test runs the sandbox as nobody with {python}: not found"
    (outside / "secret").write_text("host secret")
    os.chmod(outside / "secret", 0o644)
    directory = standalone_modules(Path(tempfile.mkdtemp(prefix="sandbox-rootless-")))
    script = directory / "rootless.py"
    probes = {"keyring": keyring_probe("SERIAL"), "kernel_memory": KERNEL_MEMORY_PROBE,
              "kernel": kernel_probe(os.getpid())}  # fmt: skip
    script.write_text(
        f"PROBES = {probes!r}\nKEY_DESCRIPTION = {KEY_DESCRIPTION.encode()!r}\n"
        f"KEY_PAYLOAD = {KEY_PAYLOAD.encode()!r}\n{ROOTLESS_SCRIPT}"
    )
    script.chmod(0o644)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    try:
        done = subprocess.run(
            [python, "-I", str(script), str(directory), str(outside), str(listener.getsockname()[1])],
            capture_output=True, text=True, timeout=120, cwd="/", user=65534, group=65534, extra_groups=[],
        )  # fmt: skip
    finally:
        listener.close()
        shutil.rmtree(directory)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    results = report["results"]
    assert report["uid"] == 65534 and report["rootless"] is True
    pid, uid, root = results["plain"]["stdout"].split(" ", 2)
    assert results["plain"]["ok"] and pid == "1" and int(uid) in UID_RANGE and "'sandbox'" in root
    assert "'tmp'" not in root and "'proc'" not in root and "'root'" not in root
    assert results["fork_bomb"]["limit"] == "processes"
    assert results["endless"]["limit"] == "time"
    assert results["memory"]["limit"] == "memory"
    assert results["print"]["limit"] == "output"
    assert (
        "FileNotFoundError" in results["read_outside"]["error"]
        and "host secret" not in results["read_outside"]["stdout"]
    )
    assert not results["write_outside"]["ok"] and not (outside / "written").exists()
    assert "Network is unreachable" in results["socket"]["error"]
    assert results["remount"]["stdout"].split() == ["-1", "1"]  # EPERM: no CAP_SYS_ADMIN left
    assert results["setsid"]["ok"] and results["setsid"]["stdout"] == "parent done\n"
    assert results["kill_all"]["stdout"] == "alive\n"  # and this script, nobody too, lived on
    # The caller's key exists (its add_key worked) and the run can reach none of it.
    assert report["key"] > 0
    assert_keys_unreachable(results["keyring"]["stdout"])
    # nobody cannot make a memory cgroup here: the rlimits and the refusals bound the run's memory.
    assert report["memory_cgroup"] is None and report["memory_cgroup_missing"]
    assert_kernel_memory_bounded(results["kernel_memory"]["stdout"])
    assert_kernel_refused(results["kernel"]["stdout"])


@pytest.mark.skipif(os.geteuid() != 0, reason="drops a capability of root")
def test_a_refused_namespace_is_named(tmp_path):
    """For real: without CAP_SYS_ADMIN (dropped from the bounding set before exec) the kernel
    refuses the namespaces, and the constructor says which and why."""
    script = tmp_path / "drop.py"
    script.write_text(
        textwrap.dedent(
            f"""\
            import ctypes, os, sys
            if len(sys.argv) == 1:
                if ctypes.CDLL(None, use_errno=True).prctl(24, 21, 0, 0, 0) != 0:  # PR_CAPBSET_DROP, CAP_SYS_ADMIN
                    sys.exit("prctl failed")
                os.execv(sys.executable, [sys.executable, "-I", __file__, "dropped"])
            sys.path.insert(0, {str(standalone_modules(tmp_path / "modules"))!r})
            from megatron_rl.envs import sandbox as module
            try:
                module.PythonSandbox()
            except module.SandboxUnavailable as exc:
                print(exc)
            """
        )
    )
    out = subprocess.run([sys.executable, "-I", str(script)], capture_output=True, text=True, timeout=60)
    assert (
        out.stdout.strip()
        == "network namespace: unshare(CLONE_NEWNET) failed: EPERM (Operation not permitted)"
    ), out


def test_a_run_whose_isolation_fails_refuses_to_run(sandbox, monkeypatch):
    missing = "/nonexistent-sandbox-bind"
    monkeypatch.setattr(sandbox, "_binds", [*sandbox._binds, ["dir", missing]])
    with pytest.raises(SandboxUnavailable, match=f"file isolation: bind mount of {missing} failed: ENOENT"):
        sandbox.run("print('never')")
    assert stat.S_ISDIR(os.stat("/usr").st_mode)  # (nothing of the host was touched)
