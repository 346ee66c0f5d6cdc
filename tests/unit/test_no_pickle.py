"""No code from a file we did not write ever runs: nothing in the package unpickles (checkpoints,
wire formats, RNG state); a checkpoint's RNG file that holds a pickled object is refused."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from megatron_rl.trainer.checkpoint import load_rng_file

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_rl"
FORBIDDEN = re.compile(r"\bimport (c?pickle|dill|cloudpickle)\b|\bpickle\.loads?\(|weights_only\s*=\s*False"
                       r"|allow_pickle\s*=\s*True|\bdill\b")  # fmt: skip
# (The multi-process test harness, tests/support/spawn.py, reads back arbitrary Python values its
# own child processes wrote into a fresh private directory: it is not part of the package.)


def test_the_package_never_unpickles():
    found: dict[str, int] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        hits = [line for line in path.read_text().splitlines() if FORBIDDEN.search(line)]
        if hits:
            found[str(path.relative_to(PACKAGE))] = len(hits)
    assert found == {}, found


class _Payload:
    def __reduce__(self):
        return (Path.touch, (Path("/tmp/megatron_rl_pickle_ran"),))


def test_a_pickled_object_in_a_checkpoint_rng_file_is_refused(tmp_path):
    marker = Path("/tmp/megatron_rl_pickle_ran")
    marker.unlink(missing_ok=True)
    evil = tmp_path / "rank00000.pt"
    torch.save({"torch": torch.get_rng_state(), "tracker": {"x": _Payload()}}, evil)
    with pytest.raises(ValueError, match=r"rank00000.pt: not a plain-tensor RNG state, refusing"):
        load_rng_file(evil)
    assert not marker.exists()
    good = tmp_path / "rank00001.pt"
    state = {"torch": torch.get_rng_state(), "tracker": {"model-parallel-rng": torch.get_rng_state()}}
    torch.save(state, good)
    loaded = load_rng_file(good)
    assert torch.equal(loaded["torch"], state["torch"]) and set(loaded["tracker"]) == {"model-parallel-rng"}
