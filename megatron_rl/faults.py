"""Kill points: the places where a restart test SIGKILLs a process to prove nothing is lost.

`MEGATRON_RL_KILL_AT=POINT@STEP` (read once, at import) makes a process kill itself with
SIGKILL when it reaches `kill_point(POINT)` during training step STEP: the same as a `kill -9`
from outside at that instant, but at a chosen place, so a seeded test reaches each place on
purpose (tests/e2e/test_restart.py). Unset, as always outside such tests, a kill point is one
comparison. The training loops say which step they are in with `set_step`.

    step.begin          a step's grid item arrived; nothing done with it yet
    train.backward      train_step: gradients computed, the optimizer step not taken
    step.minibatch      the policy: some of the step's mini-batch updates taken, not all
    step.trained        the step's update is in memory; nothing of it written
    publish.written     a published version's safetensors written, its manifest and commit not
    snapshot.written    a policy snapshot's files written, not committed
    checkpoint.written  a checkpoint's model/optimizer/RNG files written, meta.json and commit not
    commit.replacing    a redone step's directory: the old one moved aside, the new one not in place
"""

from __future__ import annotations

import os
import signal

ENV = "MEGATRON_RL_KILL_AT"
POINTS = (
    "step.begin",
    "train.backward",
    "step.minibatch",
    "step.trained",
    "publish.written",
    "snapshot.written",
    "checkpoint.written",
    "commit.replacing",
)


def _parse(text: str | None) -> tuple[str, int] | None:
    if not text:
        return None
    point, _, step = text.partition("@")
    if point not in POINTS or not step.lstrip("-").isdigit():
        raise ValueError(f"{ENV}={text!r}: expected POINT@STEP with POINT one of {', '.join(POINTS)}")
    return point, int(step)


_target = _parse(os.environ.get(ENV))
_step: int | None = None


def set_step(step: int) -> None:
    """The training step this process works on now (kill points fire only in their step)."""
    global _step
    _step = step


def kill_point(point: str) -> None:
    if _target is not None and _target == (point, _step):
        os.kill(os.getpid(), signal.SIGKILL)
