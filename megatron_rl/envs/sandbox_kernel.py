"""The sandbox's kernel-side bounds (envs/sandbox.py): the seccomp filter of its code and the
memory cgroup of a run.

- **Seccomp.** `seccomp_filter(machine)` is the classic-BPF program the child installs just
  before it execs the interpreter (with no_new_privs, so it holds for everything the code
  starts). It refuses, with EPERM, the kernel resources that a process without capabilities
  could still use to read the caller's secrets, to hold memory that no rlimit counts, to reach
  past the network namespace or to reach the kernel's riskier interfaces (`DENIED`): the
  keyrings; SysV shared memory, message queues and semaphores; POSIX message queues; memfds;
  new namespaces of any kind (a user namespace would give the code capabilities over a tmpfs
  or network namespace of its own); io_uring, bpf, perf events, userfaultfd, inotify,
  fanotify, the kernel log; sockets other than AF_UNIX, AF_INET and AF_INET6 (AF_VSOCK is not
  confined by a network namespace); raising a socket's buffers or a pipe's size. clone3 is
  ENOSYS (its flags cannot be inspected; the C library falls back to clone, whose flags are),
  and so is any call of another ABI (i386, x32).
- **Memory cgroup.** `memory_cgroup_parent()` finds where a run's memory cgroup can be made:
  cgroup v1's memory hierarchy (a child of the caller's own cgroup) or cgroup v2 (a child of
  the caller's cgroup when it delegates `memory` to its children; else a sibling, when the
  caller's cgroup has no memory limit of its own that the sibling would escape). `make_cgroup`
  makes one (its limit: the run's memory, no swap), the run's PID 1 joins it, and after the run
  `oom_kills` reads how many of its processes the kernel killed for memory before
  `remove_cgroup` removes it.
"""

from __future__ import annotations

import errno
import os
import time

# Syscall numbers: x86_64 (arch/x86/entry/syscalls/syscall_64.tbl), aarch64 (asm-generic/unistd.h).
_SYSCALLS = {
    "x86_64": {
        "add_key": 248, "request_key": 249, "keyctl": 250,
        "shmget": 29, "shmat": 30, "shmctl": 31, "shmdt": 67, "msgget": 68, "msgsnd": 69, "msgrcv": 70,
        "msgctl": 71, "semget": 64, "semop": 65, "semctl": 66, "semtimedop": 220,
        "mq_open": 240, "mq_unlink": 241, "mq_timedsend": 242, "mq_timedreceive": 243, "mq_notify": 244,
        "mq_getsetattr": 245, "memfd_create": 319, "memfd_secret": 447,
        "setns": 308, "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "bpf": 321,
        "perf_event_open": 298, "userfaultfd": 323, "inotify_init": 253, "inotify_init1": 294,
        "inotify_add_watch": 254, "fanotify_init": 300, "fanotify_mark": 301, "syslog": 103,
        "unshare": 272, "clone": 56, "clone3": 435, "socket": 41, "socketpair": 53, "fcntl": 72,
        "setsockopt": 54,
    },
    "aarch64": {
        "add_key": 217, "request_key": 218, "keyctl": 219,
        "shmget": 194, "shmat": 196, "shmctl": 195, "shmdt": 197, "msgget": 186, "msgsnd": 189,
        "msgrcv": 188, "msgctl": 187, "semget": 190, "semop": 193, "semctl": 191, "semtimedop": 192,
        "mq_open": 180, "mq_unlink": 181, "mq_timedsend": 182, "mq_timedreceive": 183, "mq_notify": 184,
        "mq_getsetattr": 185, "memfd_create": 279, "memfd_secret": 447,
        "setns": 268, "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "bpf": 280,
        "perf_event_open": 241, "userfaultfd": 282, "inotify_init1": 26, "inotify_add_watch": 27,
        "fanotify_init": 262, "fanotify_mark": 263, "syslog": 116,
        "unshare": 97, "clone": 220, "clone3": 435, "socket": 198, "socketpair": 199, "fcntl": 25,
        "setsockopt": 208,
    },
}  # fmt: skip
_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_X32_SYSCALL_BIT = 0x40000000
# Refused whatever their arguments (EPERM), by what they would give the code.
DENIED = {
    "keyrings": ("add_key", "request_key", "keyctl"),
    "SysV IPC": ("shmget", "shmat", "shmctl", "shmdt", "msgget", "msgsnd", "msgrcv", "msgctl", "semget",
                 "semop", "semctl", "semtimedop"),
    "POSIX message queues": ("mq_open", "mq_unlink", "mq_timedsend", "mq_timedreceive", "mq_notify",
                             "mq_getsetattr"),
    "memfds": ("memfd_create", "memfd_secret"),
    "namespaces": ("setns",),
    "kernel interfaces": ("io_uring_setup", "io_uring_enter", "io_uring_register", "bpf", "perf_event_open",
                          "userfaultfd", "inotify_init", "inotify_init1", "inotify_add_watch", "fanotify_init",
                          "fanotify_mark", "syslog"),
}  # fmt: skip
# CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET; unshare also CLONE_NEWTIME (in
# clone's flags 0x80 is part of the exit signal's byte).
CLONE_NAMESPACES = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000
UNSHARE_NAMESPACES = CLONE_NAMESPACES | 0x00000080
SOCKET_FAMILIES = (1, 2, 10)  # AF_UNIX, AF_INET, AF_INET6
F_SETPIPE_SZ = 1031
SOL_SOCKET = 1
SOCKET_BUFFER_OPTIONS = (7, 8, 32, 33)  # SO_SNDBUF, SO_RCVBUF, SO_SNDBUFFORCE, SO_RCVBUFFORCE

# Classic BPF (linux/filter.h, linux/seccomp.h).
_LOAD, _JEQ, _JSET, _JGE, _RETURN = 0x20, 0x15, 0x45, 0x35, 0x06
_ALLOW, _ERRNO = 0x7FFF0000, 0x00050000
_NR, _ARCH = 0, 4


def syscall_number(machine: str, name: str) -> int:
    return _SYSCALLS[machine][name]


def _arg(index: int) -> int:
    """Offset of the low 32 bits of argument `index` in struct seccomp_data (little-endian)."""
    return 16 + 8 * index


def seccomp_filter(machine: str) -> list[tuple[int, int, int, int]]:
    """The filter for `machine` (platform.machine()) as (code, jt, jf, k) instructions."""
    numbers = _SYSCALLS[machine]
    program: list[list] = []  # jump targets as labels until the end

    def emit(code, k, jt=0, jf=0):
        program.append([code, jt, jf, k])

    emit(_LOAD, _ARCH)
    emit(_JEQ, _AUDIT_ARCH[machine], jt=0, jf="enosys")
    emit(_LOAD, _NR)
    if machine == "x86_64":
        emit(_JGE, _X32_SYSCALL_BIT, jt="enosys", jf=0)
    for names in DENIED.values():
        for name in names:
            if name in numbers:
                emit(_JEQ, numbers[name], jt="eperm", jf=0)
    emit(_JEQ, numbers["clone3"], jt="enosys", jf=0)
    # Calls allowed with some arguments: each jumps to its own check, which ends allowed or denied.
    checks = {"clone": "clone", "unshare": "unshare", "socket": "family", "socketpair": "family",
              "fcntl": "fcntl", "setsockopt": "setsockopt"}  # fmt: skip
    for name, label in checks.items():
        emit(_JEQ, numbers[name], jt=label, jf=0)
    emit(_RETURN, _ALLOW)
    labels: dict[str, int] = {}

    def label(name):
        labels[name] = len(program)

    label("clone")
    emit(_LOAD, _arg(0))
    emit(_JSET, CLONE_NAMESPACES, jt="eperm", jf="allow")
    label("unshare")
    emit(_LOAD, _arg(0))
    emit(_JSET, UNSHARE_NAMESPACES, jt="eperm", jf="allow")
    label("family")
    emit(_LOAD, _arg(0))
    for family in SOCKET_FAMILIES:
        emit(_JEQ, family, jt="allow", jf=0)
    emit(_RETURN, _ERRNO | errno.EPERM)
    label("fcntl")
    emit(_LOAD, _arg(1))
    emit(_JEQ, F_SETPIPE_SZ, jt="eperm", jf="allow")
    label("setsockopt")
    emit(_LOAD, _arg(1))
    emit(_JEQ, SOL_SOCKET, jt=0, jf="allow")
    emit(_LOAD, _arg(2))
    for option in SOCKET_BUFFER_OPTIONS:
        emit(_JEQ, option, jt="eperm", jf=0)
    label("allow")
    emit(_RETURN, _ALLOW)
    label("eperm")
    emit(_RETURN, _ERRNO | errno.EPERM)
    label("enosys")
    emit(_RETURN, _ERRNO | errno.ENOSYS)
    resolved = []
    for index, (code, jt, jf, k) in enumerate(program):
        jt, jf = (labels[j] - index - 1 if isinstance(j, str) else j for j in (jt, jf))
        assert 0 <= jt < 256 and 0 <= jf < 256, (index, jt, jf)
        resolved.append((code, jt, jf, k))
    return resolved


# --- memory cgroups ------------------------------------------------------------------------------


def _mounts(mountinfo: str) -> list[tuple[str, str, str, set[str]]]:
    """(fstype, mount point, root within the filesystem, super options) of each mount."""
    mounts = []
    for line in mountinfo.splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        tail = line.split(" - ", 1)[1].split()
        if len(tail) < 3:
            continue
        mounts.append((tail[0], _unescape(fields[4]), _unescape(fields[3]), set(tail[2].split(","))))
    return mounts


def _unescape(path: str) -> str:
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        path = path.replace(code, char)
    return path


def _below(mount_point: str, mount_root: str, path: str) -> str | None:
    """`path` of the cgroup filesystem as a path under `mount_point`; None when outside the mount."""
    root = mount_root.rstrip("/")
    if path != root and not path.startswith(root + "/"):
        return None
    return os.path.join(mount_point, path[len(root) :].lstrip("/")).rstrip("/") or "/"


def _read(path: str) -> str:
    try:
        with open(path) as file:
            return file.read().strip()
    except OSError:
        return ""


def memory_cgroup_parent(
    proc_cgroup: str | None = None, mountinfo: str | None = None
) -> tuple[int, str] | tuple[None, str]:
    """(version, directory) where this process may make a run's memory cgroup, or (None, why
    not). `proc_cgroup` and `mountinfo`: /proc/self/cgroup and /proc/self/mountinfo (read now
    when None)."""
    if proc_cgroup is None:
        proc_cgroup = _read("/proc/self/cgroup")
    if mountinfo is None:
        mountinfo = _read("/proc/self/mountinfo")
    paths: dict[str, str] = {}
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            for controller in parts[1].split(",") if parts[1] else [""]:
                paths[controller] = parts[2]
    mounts = _mounts(mountinfo)
    reasons = []
    if "memory" in paths:  # v1: the memory hierarchy is mounted on its own
        for fstype, point, root, options in mounts:
            if fstype == "cgroup" and "memory" in options:
                own = _below(point, root, paths["memory"])
                if own and os.path.isdir(own) and os.access(own, os.W_OK | os.X_OK):
                    return 1, own
                reasons.append(f"cgroup v1: {own or paths['memory']} is not writable here")
                break
        else:
            reasons.append("cgroup v1: the memory hierarchy is not mounted here")
    if "" in paths:
        for fstype, point, root, _ in mounts:
            if fstype != "cgroup2":
                continue
            own = _below(point, root, paths[""])
            if own is None or not os.path.isdir(own):
                continue
            if "memory" in _read(os.path.join(own, "cgroup.subtree_control")).split():
                if os.access(own, os.W_OK | os.X_OK):
                    return 2, own
                reasons.append(f"cgroup v2: {own} is not writable here")
                break
            parent = os.path.dirname(own)
            limits = [_read(os.path.join(own, name)) for name in ("memory.max", "memory.high")]
            if (
                own == point.rstrip("/")
                or "memory" not in _read(os.path.join(own, "cgroup.controllers")).split()
            ):
                reasons.append(f"cgroup v2: {own} has no memory controller")
            elif limits != ["max", "max"]:
                reasons.append(f"cgroup v2: {own} has a memory limit of its own that a sibling would escape")
            elif not os.access(parent, os.W_OK | os.X_OK):
                reasons.append(f"cgroup v2: {parent} is not writable here")
            else:
                return 2, parent
            break
    return None, "; ".join(reasons) or "no memory cgroup controller is mounted"


def _write(path: str, value: str) -> None:
    with open(path, "w") as file:
        file.write(value)


def make_cgroup(version: int, parent: str, name: str, limit_bytes: int) -> str:
    """A new memory cgroup `parent`/`name` holding at most `limit_bytes` and no swap; OSError
    when the kernel refuses (then nothing is left behind). Returns its directory."""
    path = os.path.join(parent, name)
    os.mkdir(path)
    try:
        if version == 1:
            _write(os.path.join(path, "memory.limit_in_bytes"), str(limit_bytes))
            if os.path.exists(os.path.join(path, "memory.memsw.limit_in_bytes")):  # swap accounting on
                _write(os.path.join(path, "memory.memsw.limit_in_bytes"), str(limit_bytes))
        else:
            _write(os.path.join(path, "memory.max"), str(limit_bytes))
            if os.path.exists(os.path.join(path, "memory.swap.max")):
                _write(os.path.join(path, "memory.swap.max"), "0")
    except OSError:
        remove_cgroup(path)
        raise
    return path


def oom_kills(version: int, path: str) -> int:
    """How many processes of the cgroup the kernel killed for memory."""
    text = _read(os.path.join(path, "memory.oom_control" if version == 1 else "memory.events"))
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill" and value.strip().isdigit():
            return int(value)
    return 0


def remove_cgroup(path: str, wait_s: float = 2.0) -> None:
    """Remove the (empty) cgroup, waiting up to `wait_s` for its last processes to be gone."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                return
            time.sleep(0.01)


def remove_stale_cgroups(parent: str, marker: str) -> None:
    """Remove the runs' cgroups (`marker`-PID-...) that a process no longer running left behind
    (killed during a run); a cgroup still holding processes is not removed."""
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        pid = name[len(marker) + 1 :].split("-", 1)[0]
        if not (name.startswith(marker + "-") and pid.isdigit()):
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            remove_cgroup(os.path.join(parent, name), wait_s=0)
        except PermissionError:  # alive, another user's
            pass
