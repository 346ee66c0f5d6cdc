"""Shared fixtures: tiny random HF models built locally once per session (no download).

And how tests/run.sh spreads the suite over pytest-xdist's workers (`-n 2 --dist loadgroup`):
tests that share an expensive fixture run on one worker, and the longest work starts first."""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path

import pytest

# Seconds per test file, measured (python scripts/suite_profile.py LOG... --write-durations).
DURATIONS = Path(__file__).with_name("durations.json")
SHARED_SCOPES = ("session", "package", "module", "class")


def xdist_group(item: pytest.Item) -> str | None:
    """The unit of work `item` goes to a worker with: tests that use the session's vLLM pool all
    on one worker (it starts one pool, not one per worker); a file's tests together when they share
    a fixture wider than the test (it starts once); a file's explicit `xdist_group` mark (tests
    that cannot run at once, e.g. the demos on the same ports); else the test alone."""
    if item.get_closest_marker("xdist_group"):
        return None
    if "vllm_pool" in item.fixturenames:
        return "vllm_pool"
    definitions = getattr(item, "_fixtureinfo", None)
    for fixturedefs in (definitions.name2fixturedefs.values() if definitions else ()):
        # baseid: "" for pytest's and plugins' own fixtures (tmp_path_factory, ...), else where ours are
        if any(d.scope in SHARED_SCOPES and d.baseid and d.argname != "tiny_models" for d in fixturedefs):
            return item.nodeid.split("::")[0]
    return None


def unit_of(item: pytest.Item) -> str:
    mark = item.get_closest_marker("xdist_group")
    return str(mark.args[0]) if mark else item.nodeid


def longest_first(items: list[pytest.Item], seconds: dict[str, float]) -> list[pytest.Item]:
    """`items` with the units of work that take longest first (in their collection order within),
    so that no long unit starts last while the other worker has nothing left (longest processing
    time first). A test costs its file's measured seconds shared among the file's tests."""
    paths = [item.nodeid.split("::")[0] for item in items]
    units = [unit_of(item) for item in items]
    per_file = Counter(paths)
    cost: dict[str, float] = defaultdict(float)
    first: dict[str, int] = {}
    for index, (path, unit) in enumerate(zip(paths, units)):
        cost[unit] += seconds.get(path, 1.0) / per_file[path]
        first.setdefault(unit, index)
    order = sorted(range(len(items)), key=lambda i: (-cost[units[i]], first[units[i]], i))
    return [items[i] for i in order]


@pytest.hookimpl(tryfirst=True)  # before xdist reads the marks (it suffixes node ids with the group)
def pytest_collection_modifyitems(config, items):
    for item in items:
        group = xdist_group(item)
        if group:
            item.add_marker(pytest.mark.xdist_group(group))
    if hasattr(config, "workerinput"):  # an xdist worker: its order is the queue the workers share
        seconds = json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}
        items[:] = longest_first(items, seconds)


def pytest_collection_finish(session):
    """A worker whose groups did not reach the scheduler stops the run: its tests would split over
    the workers (pytest-xdist's loadgroup marks a group in the node id; pytest 9.2 ignores that:
    setup.py pins pytest below it)."""
    config = session.config
    if hasattr(config, "workerinput") and getattr(config.option, "loadgroup", False):
        lost = [item.nodeid for item in session.items if item.get_closest_marker("xdist_group") and "@" not in item.nodeid]
        if lost:
            raise pytest.UsageError(
                f"pytest-xdist did not group {len(lost)} tests marked xdist_group (first {lost[0]}): "
                f"pytest {pytest.__version__} with this pytest-xdist; install setup.py's dev extra (pytest<9.2)"
            )


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """family -> directory with config.json, model.safetensors and a tokenizer."""
    from megatron_rl.models.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("tiny_models")
    return {
        family: make_tiny_model(family, root / family, seed=3)
        for family in ("qwen3", "qwen3_moe", "llama", "glm4_moe", "deepseek_v3")
    }
