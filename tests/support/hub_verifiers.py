"""Helpers for tests of environments written with verifiers 0.4 (envs/hubs/verifiers.py): the
folder of environment modules on the import path of this process and of its subprocesses (a tool
server runs as `python -m <module>`), as an installed package would be, and the episodes an
environment ran, recorded from outside."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import pytest

HUB_ENVS = Path(__file__).resolve().parent / "hub_envs"


@contextlib.contextmanager
def hub_envs_importable():
    """tests/support/hub_envs on sys.path and PYTHONPATH while the context is open."""
    patch = pytest.MonkeyPatch()
    try:
        patch.syspath_prepend(str(HUB_ENVS))
        patch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(HUB_ENVS), os.environ.get("PYTHONPATH")) if p))
        yield HUB_ENVS
    finally:
        patch.undo()
        for name in [n for n in sys.modules if n.startswith("mrl_vf_")]:
            del sys.modules[name]


def record_episodes(environment) -> list:
    """Wraps the verifiers Env's `run_episode` of `environment` (a VerifiersEnvironment) so that
    every (task, episode) it runs lands in the returned list."""
    episodes, original = [], environment.env.run_episode

    async def recording(task, context, **kwargs):
        episode = await original(task, context, **kwargs)
        episodes.append((task, episode))
        return episode

    environment.env.run_episode = recording
    return episodes


async def library_score(task, trace):
    """`await task.score(trace)` on a copy of `trace` with its rewards and metrics cleared: what
    verifiers' own scoring gives for the same conversation."""
    fresh = trace.model_copy(deep=True)
    fresh.rewards, fresh.metrics = {}, {}
    await task.score(fresh)
    return fresh
