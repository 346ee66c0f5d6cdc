"""Published HF safetensors load into transformers and give the Megatron model's logits; an
interrupted publish leaves the previous version current; the manifest catches corruption."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from megatron_rl import parallel
from megatron_rl.config import Architecture
from megatron_rl.conversion.hf_mapping import hf_to_megatron
from megatron_rl.models.builder import build_gpt_model
from megatron_rl.models.sharding import load_full_state_dict
from megatron_rl.policy.publish import latest_published, verify_published
from tests.support.ranks import gather_vocab, hf_logits
from tests.support.spawn import run_ranks


def perturbed(directory):
    """The tiny model's weights with noise, so the published model differs from the source."""
    arch = Architecture.from_hf_config(json.loads((directory / "config.json").read_text()), str(directory))
    full = hf_to_megatron(load_file(directory / "model.safetensors"), arch)
    g = torch.Generator().manual_seed(0)
    return arch, {k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in full.items()}


@pytest.mark.parametrize("family,tp,ep", [("qwen3", 2, 1), ("qwen3_moe", 1, 2)])
def test_published_weights_load_into_transformers(family, tp, ep, tiny_models, tmp_path):
    arch, full = perturbed(tiny_models[family])
    input_ids = torch.randint(0, arch.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    ranks = run_ranks(
        publish_weights, tp * ep, arch, full, tp, ep, str(tmp_path), 5, tiny_models[family], input_ids
    )
    megatron = ranks[0][0]
    version = latest_published(tmp_path)
    assert version.name == "version_00000005"
    assert all(path == str(version) for _, path in ranks)  # every rank is told the new version
    manifest = verify_published(version)
    assert manifest["step"] == 5 and manifest["num_tensors"] == len(
        load_file(tiny_models[family] / "model.safetensors")
    )
    torch.testing.assert_close(hf_logits(version, input_ids), megatron, atol=1e-4, rtol=0)
    assert (hf_logits(tiny_models[family], input_ids) - megatron).abs().max() > 1e-3  # really the new weights


def test_interrupted_publish_keeps_the_previous_version(tiny_models, tmp_path):
    arch, full = perturbed(tiny_models["llama"])
    input_ids = torch.randint(0, arch.vocab_size, (1, 12), generator=torch.Generator().manual_seed(4))
    megatron = run_ranks(
        publish_weights, 1, arch, full, 1, 1, str(tmp_path), 1, tiny_models["llama"], input_ids
    )[0][0]
    # Version 2 died midway: half its files written, no manifest, `latest` not moved.
    partial = tmp_path / "version_00000002.partial"
    shutil.copytree(tmp_path / "version_00000001", partial)
    (partial / "manifest.json").unlink()
    version = latest_published(tmp_path)
    assert version.name == "version_00000001"
    verify_published(version)
    torch.testing.assert_close(hf_logits(version, input_ids), megatron, atol=1e-4, rtol=0)
    # A corrupted file is caught by the manifest.
    victim = next(version.glob("model-*.safetensors"))
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="sha256 does not match"):
        verify_published(version)


def test_a_failed_broadcast_still_resumes_every_inference_server():
    """Path (b) pauses the servers before streaming; when the stream fails they are resumed
    (they keep serving the previous version) and the failure reaches the caller."""
    from tests.support.spawn import run_ranks

    error, calls = run_ranks(publish_failing_mid_broadcast, 1)[0]
    assert error == "weight-update link lost"
    assert calls == [["pause", "receive_weights", "resume"]] * 2


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_publishing_reads_the_live_parameters_without_a_model_copy(family, tiny_models):
    """owned_hf_tensors at TP = 1 (what both paths publish) gives the policy's HF tensors and
    creates no storage but the q, k and v split out of each fused linear_qkv (interleaved per
    query group, so not views): every other tensor is the live parameter or a view of it
    (aabdc61: gather_full_parameters cloned every parameter first, the model's bytes more)."""
    allocated, qkv_bytes, model_bytes, aliased, mismatched = run_ranks(
        owned_tensor_allocations, 1, tiny_models[family]
    )[0]
    print(
        f"{family}: owned_hf_tensors allocates {allocated} B (q/k/v splits {qkv_bytes} B; model {model_bytes} B)"
    )
    assert mismatched == []
    assert allocated == qkv_bytes, (allocated, qkv_bytes, model_bytes)
    assert aliased > 0


# Rank functions: module-level, so that the spawned ranks can import them.


def owned_tensor_allocations(rank, world_size, hf_dir):
    """(bytes owned_hf_tensors allocates, bytes of the fused qkv parameters, model bytes, HF
    tensors sharing a parameter's storage, names whose value differs from a copying gather)."""
    from megatron_rl.conversion.checkpoint_io import read_architecture
    from megatron_rl.conversion.hf_mapping import megatron_to_hf
    from megatron_rl.models.sharding import gather_full_parameters
    from megatron_rl.policy.publish import owned_hf_tensors
    from megatron_rl.trainer.weights import load_initial_weights
    from tests.support.memory import AllocationTracker

    parallel.initialize_model_parallel()
    arch = read_architecture(hf_dir)
    model = build_gpt_model(arch)
    load_initial_weights(model, hf_dir, arch)
    with AllocationTracker() as tracker:
        owned = owned_hf_tensors(model, arch)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    aliased = sum(t.untyped_storage().data_ptr() in params for t in owned.values())
    expected = megatron_to_hf(gather_full_parameters(model, copy=True), arch)
    mismatched = [n for n in expected if n not in owned or not torch.equal(owned[n], expected[n])]
    qkv = sum(
        p.numel() * p.element_size() for n, p in model.named_parameters() if n.endswith("linear_qkv.weight")
    )
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return tracker.peak, qkv, model_bytes, aliased, mismatched


def publish_weights(rank, world_size, arch, full, tp, ep, directory, step, hf_dir, input_ids):
    """Publishes the model's weights as HF safetensors; returns (full-vocab logits, the path
    publish_hf_weights returned)."""
    from megatron_rl.policy.publish import publish_hf_weights

    parallel.initialize_model_parallel(tp=tp, ep=ep)
    model = build_gpt_model(arch, tp=tp, ep=ep)
    load_full_state_dict(model, full)
    path = publish_hf_weights(model, arch, directory, step, hf_side_files=hf_dir)
    model.eval()
    with torch.no_grad():
        out = model(input_ids, torch.arange(input_ids.shape[1]).expand_as(input_ids), attention_mask=None)
    return gather_vocab(out), str(path)


class RecordingControl:
    """An inference server's control that records what it was asked (no server)."""

    def __init__(self):
        self.calls = []

    def pause(self, mode="keep", clear_cache=True):
        self.calls.append("pause")

    def resume(self):
        self.calls.append("resume")

    def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")

    def collective_rpc(self, method, kwargs):
        self.calls.append(method)


def publish_failing_mid_broadcast(rank, world_size):
    """BroadcastPublisher.publish on one rank whose stream fails after the servers were paused;
    returns (the error text, each server's calls)."""
    from megatron_rl.policy.publish import broadcast
    from megatron_rl.transport import weight_buckets
    from tests.support.ranks import DENSE

    def lost(*args, **kwargs):
        raise ConnectionError("weight-update link lost")

    broadcast.owned_hf_tensors = lambda model, arch, merge=None: {}
    weight_buckets.broadcast_end = lost
    controls = [RecordingControl(), RecordingControl()]
    publisher = broadcast.BroadcastPublisher(DENSE, controls, "127.0.0.1", 0, backend="gloo", timeout_s=5)
    publisher.group = object()  # connected (the stream itself is what fails)
    try:
        publisher.publish(None, version=3)
        error = None
    except ConnectionError as exc:
        error = str(exc)
    return error, [c.calls for c in controls]
