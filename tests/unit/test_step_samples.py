"""policy/update.py's step_samples in one process (no process group): the distinct samples of the
rank's micro-batches, padding (-1) and a sample split over micro-batches counted once. With a
data-parallel group it sums the ranks' counts (tests/distributed/test_policy_update.py)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from megatron_rl.policy.update import step_samples


def test_distinct_samples_of_the_micro_batches_without_a_process_group():
    assert not torch.distributed.is_initialized()
    micro_batches = [
        SimpleNamespace(sample_index=np.array([[0, 0, 1, 1, -1]])),
        SimpleNamespace(sample_index=np.array([[1, 2, 2, -1, -1], [3, 3, 3, 3, 3]])),  # sample 1 continues
    ]
    assert step_samples(micro_batches) == 4
    assert step_samples([SimpleNamespace(sample_index=np.full((1, 4), -1))]) == 0
