"""`bash launch/demo.sh` (`python -m megatron_rl.launch.demo`): the CPU demo of megatron_rl/demo/run.py
(its options are there), each run launched on this machine by the local launcher (`run_local`)."""

from __future__ import annotations

import sys

from megatron_rl.demo.run import main as demo_main
from megatron_rl.launch.local import run_local


def main(argv: list[str] | None = None) -> int:
    return demo_main(argv, launcher=run_local)


if __name__ == "__main__":
    sys.exit(main())
