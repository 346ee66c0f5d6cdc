"""The sandbox's kernel-side bounds without starting it (envs/sandbox_kernel.py): the seccomp
filter's decisions, worked out by a plain classic-BPF interpreter, for x86_64 and aarch64 (the
second cannot run here), its syscall numbers against this machine's kernel headers; where a
run's memory cgroup is made, on cgroup v1 and v2 trees laid out in a temporary directory (this
machine mounts v1 only; the sandbox's tests make real v1 cgroups)."""

from __future__ import annotations

import errno
import re
import struct
from pathlib import Path

import pytest

from megatron_rl.envs import sandbox_kernel
from megatron_rl.envs.sandbox_kernel import memory_cgroup_parent, seccomp_filter

ALLOW, EPERM, ENOSYS = 0x7FFF0000, 0x00050000 | errno.EPERM, 0x00050000 | errno.ENOSYS
ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
I386 = 0x40000003
# Calls every Python program makes, from the kernel's tables.
ORDINARY = {
    "x86_64": {"read": 0, "write": 1, "mmap": 9, "execve": 59, "openat": 257, "exit_group": 231},
    "aarch64": {"read": 63, "write": 64, "mmap": 222, "execve": 221, "openat": 56, "exit_group": 94},
}
HEADERS = {
    "x86_64": Path("/usr/include/x86_64-linux-gnu/asm/unistd_64.h"),
    "aarch64": Path("/usr/include/asm-generic/unistd.h"),
}


def decide(program, arch: int, nr: int, *args: int) -> int:
    """What the kernel would do: run `program` on struct seccomp_data {nr, arch, ip, args[6]}."""
    data = struct.pack("<iIQ6Q", nr, arch, 0, *(list(args) + [0] * (6 - len(args))))
    accumulator, pc = 0, 0
    while True:
        code, jt, jf, k = program[pc]
        pc += 1
        if code == 0x20:  # BPF_LD | BPF_W | BPF_ABS
            accumulator = struct.unpack_from("<I", data, k)[0]
        elif code == 0x15:  # BPF_JMP | BPF_JEQ | BPF_K
            pc += jt if accumulator == k else jf
        elif code == 0x35:  # BPF_JGE
            pc += jt if accumulator >= k else jf
        elif code == 0x45:  # BPF_JSET
            pc += jt if accumulator & k else jf
        elif code == 0x06:  # BPF_RET | BPF_K
            return k
        else:
            raise AssertionError(f"instruction {pc - 1}: unknown code {code:#x}")


@pytest.mark.parametrize("machine", ["x86_64", "aarch64"])
def test_the_seccomp_filter_refuses_what_it_lists_and_allows_the_rest(machine):
    program, arch = seccomp_filter(machine), ARCH[machine]
    number = lambda name: sandbox_kernel.syscall_number(machine, name)  # noqa: E731
    assert len(program) < 4096  # BPF_MAXINSNS
    for name, nr in ORDINARY[machine].items():
        assert decide(program, arch, nr) == ALLOW, name
    for group, names in sandbox_kernel.DENIED.items():
        for name in names:
            if name == "inotify_init" and machine == "aarch64":  # not in aarch64's table
                continue
            assert decide(program, arch, number(name), 0, 0) == EPERM, (group, name)
    clone_new_user, sigchld = 0x10000000, 17
    assert decide(program, arch, number("clone"), sigchld) == ALLOW  # fork
    assert decide(program, arch, number("clone"), 0x003D0F00) == ALLOW  # a thread (CLONE_VM | ... | SETTLS)
    assert decide(program, arch, number("clone"), clone_new_user | sigchld) == EPERM
    assert decide(program, arch, number("clone3"), 0) == ENOSYS
    for flag in (0x00020000, 0x40000000, 0x00000080, clone_new_user):  # mount, net, time, user
        assert decide(program, arch, number("unshare"), flag) == EPERM, hex(flag)
    assert decide(program, arch, number("unshare"), 0x00000400) == ALLOW  # CLONE_FILES: no namespace
    for family in (1, 2, 10):  # AF_UNIX, AF_INET, AF_INET6
        assert decide(program, arch, number("socket"), family, 1) == ALLOW
    assert decide(program, arch, number("socketpair"), 1, 1) == ALLOW
    for family in (16, 17, 38, 40):  # AF_NETLINK, AF_PACKET, AF_ALG, AF_VSOCK
        assert decide(program, arch, number("socket"), family, 1) == EPERM, family
        assert decide(program, arch, number("socketpair"), family, 1) == EPERM, family
    assert decide(program, arch, number("fcntl"), 3, 1031, 1 << 20) == EPERM  # F_SETPIPE_SZ
    assert decide(program, arch, number("fcntl"), 3, 3) == ALLOW  # F_GETFL
    for option in (7, 8, 32, 33):  # SO_SNDBUF, SO_RCVBUF and their FORCE forms
        assert decide(program, arch, number("setsockopt"), 3, 1, option) == EPERM, option
    assert decide(program, arch, number("setsockopt"), 3, 1, 2) == ALLOW  # SO_REUSEADDR
    assert decide(program, arch, number("setsockopt"), 3, 6, 7) == ALLOW  # IPPROTO_TCP's option 7
    # Another ABI: i386 on x86_64 (int 0x80), x32 (the syscall number's bit 30).
    assert decide(program, I386, 0) == ENOSYS
    if machine == "x86_64":
        assert decide(program, arch, 0x40000000 | 0) == ENOSYS


@pytest.mark.parametrize("machine", ["x86_64", "aarch64"])
def test_the_syscall_numbers_are_the_kernel_headers(machine):
    """Each number of the filter's table as this machine's kernel headers define it (both tables
    ship with the x86_64 headers: asm-generic's is aarch64's)."""
    header = HEADERS[machine]
    assert header.is_file(), f"{header}: the kernel headers the numbers are checked against"
    defined = {
        name: int(value)
        for name, value in re.findall(
            r"^#define __NR(?:3264)?_(\w+)\s+(\d+)\s*$", header.read_text(), re.MULTILINE
        )
    }
    table = sandbox_kernel._SYSCALLS[machine]
    assert {name: defined.get(name) for name in table} == table
    assert {name: defined.get(name) for name in ORDINARY[machine]} == ORDINARY[machine]


def mountinfo(*mounts: tuple[str, str, str, str]) -> str:
    """mountinfo lines of (root, mount point, fstype, super options)."""
    return "".join(f"{30 + i} 25 0:{26 + i} {root} {point} rw,relatime - {kind} {kind} {options}\n"
                   for i, (root, point, kind, options) in enumerate(mounts))  # fmt: skip


def cgroup_dir(path: Path, **files: str) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (path / name.replace("_", ".", 1)).write_text(text + "\n")
    return path


def test_where_a_runs_memory_cgroup_is_made(tmp_path):
    """cgroup v1: a child of the caller's own memory cgroup (also under a container's mount
    root); v2: a child of the caller's cgroup when it delegates memory to its children, else a
    sibling when the caller's own cgroup has no limit of its own; otherwise none, and why."""
    v1 = tmp_path / "memory"
    own = cgroup_dir(v1 / "jobs" / "a")
    assert memory_cgroup_parent(
        "4:memory:/jobs/a\n0::/\n", mountinfo(("/", str(v1), "cgroup", "rw,memory"))
    ) == (
        1,
        str(own),
    )
    # A container's view: the mount's root is the container's cgroup.
    inner = mountinfo(("/docker/abc", str(v1), "cgroup", "rw,memory"))
    assert memory_cgroup_parent("4:memory:/docker/abc/jobs/a\n", inner) == (1, str(own))
    assert (
        memory_cgroup_parent("4:memory:/jobs/b\n", mountinfo(("/", str(v1), "cgroup", "rw,memory")))[0]
        is None
    )
    # v2, the caller's cgroup delegates memory (it holds no processes of its own: the root)
    v2 = tmp_path / "unified"
    cgroup_dir(v2, cgroup_subtree_control="cpu memory", cgroup_controllers="cpu memory")
    v2_mount = mountinfo(("/", str(v2), "cgroup2", "rw"))
    assert memory_cgroup_parent("0::/\n", v2_mount) == (2, str(v2))
    # a leaf with the memory controller and no limit of its own: a sibling, under the same parent
    job = cgroup_dir(v2 / "job", cgroup_subtree_control="memory", cgroup_controllers="memory")
    cgroup_dir(job / "task", cgroup_subtree_control="", cgroup_controllers="cpu memory", memory_max="max",
               memory_high="max")  # fmt: skip
    assert memory_cgroup_parent("0::/job/task\n", v2_mount) == (2, str(job))
    (job / "task" / "memory.max").write_text("1073741824\n")
    version, why = memory_cgroup_parent("0::/job/task\n", v2_mount)
    assert version is None and "has a memory limit of its own that a sibling would escape" in why
    cgroup_dir(job / "other", cgroup_subtree_control="", cgroup_controllers="cpu")
    version, why = memory_cgroup_parent("0::/job/other\n", v2_mount)
    assert version is None and why == f"cgroup v2: {job / 'other'} has no memory controller"
    assert memory_cgroup_parent("0::/\n", "") == (None, "no memory cgroup controller is mounted")


def test_a_runs_cgroup_is_made_limited_and_read(tmp_path):
    """The files make_cgroup writes (v1: the limit, the swap limit where swap is accounted; v2:
    memory.max, no swap) and the OOM kills oom_kills reads back."""
    v2 = sandbox_kernel.make_cgroup(2, str(tmp_path), "run", 300 << 20)
    assert (Path(v2) / "memory.max").read_text() == str(300 << 20)
    (Path(v2) / "memory.events").write_text("low 0\nhigh 0\nmax 4\noom 2\noom_kill 2\n")
    assert sandbox_kernel.oom_kills(2, v2) == 2
    v1 = sandbox_kernel.make_cgroup(1, str(tmp_path), "run-v1", 300 << 20)
    assert (Path(v1) / "memory.limit_in_bytes").read_text() == str(300 << 20)
    assert not (Path(v1) / "memory.memsw.limit_in_bytes").exists()  # swap not accounted in this tree
    (Path(v1) / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 3\n")
    assert sandbox_kernel.oom_kills(1, v1) == 3
    with pytest.raises(FileExistsError):
        sandbox_kernel.make_cgroup(2, str(tmp_path), "run", 1 << 20)
