"""Child processes that end with the process that started them.

Components (vLLM servers, vllm-router, torchrun groups, the orchestrator, test ranks) lead
process groups of their own, so that a launcher can signal each one as a whole; the price is
that a launcher killed before its teardown (SIGKILL, the OOM killer, a crashed pytest) would
leave them running. `bound_to_parent(command)` prefixes a command with a small shim that asks
Linux for SIGTERM when the starting process dies (prctl PR_SET_PDEATHSIG) and then execs the
command: the component keeps its pid and process group, and SIGTERM is what every component
already handles as "stop" (torchrun passes it on to its ranks; vLLM and the router shut down).

Linux ties the parent-death signal to the *thread* that forked, so only a start from the main
thread is bound (a thread that ends would otherwise stop its children); elsewhere, and off Linux,
the command is returned unchanged.
"""

from __future__ import annotations

import os
import sys
import threading

# argv: the starting process's pid, then the command. prctl(PR_SET_PDEATHSIG=1, SIGTERM=15).
# A parent that died before prctl ran left us with another parent: stop at once then.
_SHIM = (
    "import ctypes, os, signal, sys\n"
    "if ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0) != 0:\n"
    "    sys.exit('megatron_rl.lifetime: prctl(PR_SET_PDEATHSIG) failed: errno %d' % ctypes.get_errno())\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit('megatron_rl.lifetime: the starting process %s is gone; not starting' % sys.argv[1])\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def bound_to_parent(command: list[str]) -> list[str]:
    """`command`, to be started by this process, such that it gets SIGTERM when this process
    dies (see the module docstring for where that is not possible)."""
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return list(command)
    return [sys.executable, "-S", "-c", _SHIM, str(os.getpid()), *command]
