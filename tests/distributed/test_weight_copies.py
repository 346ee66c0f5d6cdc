"""Loading HF weights and gathering parameters to publish hold no avoidable copies of the model
(measured on CPU: anonymous memory of the rank, and storages the ops create)."""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_rl import parallel
from tests.support.spawn import run_ranks


def test_loading_hf_weights_copies_one_tensor_at_a_time(tmp_path):
    """load_initial_weights from an HF directory: every parameter gets its HF value, and the
    rank's peak extra memory is that of the largest tensor it builds (a fused q/k/v) and its
    shard, not of the model (aabdc61: hf_to_megatron fused every q/k/v and gate/up,
    full_parameters cloned the model and each shard was cloned again: about 3x the model)."""
    from megatron_rl.models.tiny import make_tiny_model

    hf_dir = make_tiny_model("qwen3_moe", tmp_path / "hf", seed=2, hidden_size=1024, tokenizer="char")
    for tp in (1, 2):
        results = run_ranks(load_hf_weights, tp, str(hf_dir), tp)
        for extra, largest, model_bytes, mismatched in results:
            assert mismatched == [], mismatched
            assert extra < 2 * largest + (1 << 20) and extra < 0.25 * model_bytes, (
                tp,
                extra,
                largest,
                model_bytes,
            )


def test_gathering_parameters_to_publish_can_alias_them():
    """gather_full_parameters(copy=False) at TP = 1 creates no storage (the parameters
    themselves); copy=True creates one copy."""
    no_copy, copied, model_bytes = run_ranks(gather_allocations, 1)[0]
    assert no_copy == 0
    assert copied == model_bytes


# Rank functions: module-level, so that the spawned ranks can import them.


def load_hf_weights(rank, world_size, hf_dir, tp):
    """(peak extra anonymous bytes of load_initial_weights, the largest full tensor's bytes, the
    model's bytes on this rank, parameters whose loaded value differs from the HF checkpoint's)."""
    from megatron_rl.conversion import checkpoint_io as io
    from megatron_rl.conversion.hf_mapping import hf_to_megatron
    from megatron_rl.models.builder import build_gpt_model
    from megatron_rl.models.sharding import gather_full_parameters
    from megatron_rl.trainer.weights import load_initial_weights
    from tests.support.process_memory import peak_anonymous_memory, release_freed_memory

    release_freed_memory()
    arch = io.read_architecture(Path(hf_dir))
    parallel.initialize_model_parallel(tp=tp)
    model = build_gpt_model(arch, tp=tp)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    with peak_anonymous_memory() as memory:
        load_initial_weights(model, hf_dir, arch)
    expected = hf_to_megatron(io.read_hf_state_dict(Path(hf_dir)), arch)
    loaded = gather_full_parameters(model)
    mismatched = [n for n, t in expected.items() if not torch.equal(loaded[n], t)]
    largest = max(t.numel() * t.element_size() for t in expected.values())
    return memory.extra, largest, model_bytes, mismatched


def gather_allocations(rank, world_size):
    from megatron_rl.models.builder import build_gpt_model
    from megatron_rl.models.sharding import gather_full_parameters
    from tests.support.memory import AllocationTracker
    from tests.support.ranks import DENSE

    parallel.initialize_model_parallel()
    model = build_gpt_model(DENSE)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    with AllocationTracker() as no_copy:
        aliased = gather_full_parameters(model, copy=False)
    assert all(
        aliased[name].data_ptr() == p.data_ptr() for name, p in zip(aliased, model.parameters(), strict=True)
    )
    with AllocationTracker() as copied:
        kept = gather_full_parameters(model)
    assert len(kept) == len(aliased)
    return no_copy.peak, copied.peak, model_bytes
