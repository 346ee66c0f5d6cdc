"""Weight-broadcast bucketing and plan metadata (pure parts)."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.transport.weight_buckets import (
    decode_plan,
    encode_plan,
    pack_bucket,
    plan_buckets,
    unpack_bucket,
)
from tests.support.tensors import named_tensors


def test_buckets_group_by_dtype_respect_the_size_and_keep_every_tensor():
    tensors = named_tensors()
    plan = plan_buckets(((n, t.dtype, tuple(t.shape)) for n, t in tensors.items()), bucket_bytes=200)
    for bucket in plan.buckets:
        sizes = {
            torch.empty((), dtype=t.dtype).element_size() for t in (tensors[e.name] for e in bucket.entries)
        }
        assert len(sizes) == 1 and len({str(tensors[e.name].dtype) for e in bucket.entries}) == 1
        assert bucket.numel * sizes.pop() <= 200 or len(bucket.entries) == 1
    names = [e.name for b in plan.buckets for e in b.entries]
    assert sorted(names) == sorted(tensors)
    assert [e.name for b in plan.buckets for e in b.entries if e.name == "c"] == ["c"]
    assert any(len(b.entries) == 1 and b.entries[0].name == "c" for b in plan.buckets)
    # round trip through bytes and flat buckets: byte-exact tensors and shapes
    again = decode_plan(encode_plan(plan))
    assert again == plan
    for bucket in again.buckets:
        flat = pack_bucket(bucket, tensors)
        for name, tensor in unpack_bucket(bucket, flat):
            assert tensor.dtype == tensors[name].dtype and torch.equal(tensor, tensors[name])


def test_plan_version_and_dtype_errors():
    plan = plan_buckets([("x", torch.float32, (2,))], 64)
    plan.version = 9
    with pytest.raises(ValueError, match="plan version 9"):
        decode_plan(encode_plan(plan))
    with pytest.raises(ValueError, match="unsupported dtype"):
        plan_buckets([("z", torch.complex64, (1,))], 64)
