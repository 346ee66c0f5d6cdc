"""Published HF safetensors load into transformers and give the Megatron model's logits; an
interrupted publish leaves the previous version current; the manifest catches corruption."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from megatron_rl.config import Architecture
from megatron_rl.models.hf_mapping import hf_to_megatron
from megatron_rl.policy.publish import latest_published, verify_published
from megatron_rl.testing.spawn import run_ranks
from tests.distributed import megatron_workers as w
from tests.distributed.test_hf_parity import hf_logits


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
        w.publish_weights, tp * ep, arch, full, tp, ep, str(tmp_path), 5, tiny_models[family], input_ids
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
        w.publish_weights, 1, arch, full, 1, 1, str(tmp_path), 1, tiny_models["llama"], input_ids
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
    from megatron_rl.testing.spawn import run_ranks
    from tests.distributed.megatron_workers import publish_failing_mid_broadcast

    error, calls = run_ranks(publish_failing_mid_broadcast, 1)[0]
    assert error == "weight-update link lost"
    assert calls == [["pause", "receive_weights", "resume"]] * 2
