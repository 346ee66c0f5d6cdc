"""Bad input refused before anything is touched, each naming what it refused: a weight-update
group's backend, a conversion into a checkpoint directory that already holds one; and a value
algorithm asked to score no samples makes no call to the critic."""

from __future__ import annotations

import asyncio

import pytest

from megatron_rl.algorithms.base import make_algorithm
from megatron_rl.conversion import checkpoint_io
from megatron_rl.conversion.convert import hf_to_checkpoint
from megatron_rl.parallel import free_port
from megatron_rl.transport.weight_buckets import WeightUpdateGroup
from tests.support.orchestrator import orchestrator_config


def test_a_weight_update_group_refuses_an_unknown_backend():
    with pytest.raises(ValueError, match=r"backend must be 'nccl' or 'gloo', got 'mpi'"):
        WeightUpdateGroup("127.0.0.1", free_port(), rank=0, world_size=1, backend="mpi", timeout_s=5)


def test_conversion_refuses_to_overwrite_a_checkpoint_and_leaves_it(tiny_models, tmp_path):
    existing = tmp_path / "ckpt" / checkpoint_io.MODEL_DIR
    existing.mkdir(parents=True)
    (existing / "common.pt").write_bytes(b"an earlier checkpoint")
    with pytest.raises(checkpoint_io.CheckpointError, match=r"ckpt/model: not empty; refusing to overwrite"):
        hf_to_checkpoint(tiny_models["qwen3"], tmp_path / "ckpt")
    assert (existing / "common.pt").read_bytes() == b"an earlier checkpoint"


def test_scoring_no_samples_calls_no_critic():
    class Scorer:
        async def score(self, token_ids):
            raise AssertionError("no samples: the critic must not be called")

    algorithm = make_algorithm(orchestrator_config("sao").algorithm, Scorer())
    assert asyncio.run(algorithm.score_samples([])) is None
