"""The value model: head size follows the backbone; freezing options train exactly what they say."""

from __future__ import annotations

from megatron_rl.testing.spawn import run_ranks
from tests.distributed import megatron_workers as w


def test_value_head_input_size_follows_the_backbone():
    for hidden in (64, 96):
        arch = w.DENSE.model_copy(update=dict(hidden_size=hidden, num_layers=2))
        shape, trainable, changed = run_ranks(w.value_model_step, 1, arch, "none")[0]
        assert shape == (1, hidden)
        assert "value_head.weight" in trainable and not any("output_layer" in n for n in trainable)
        assert set(changed) == set(trainable)  # a full step moves every trainable tensor


def test_freeze_attention_and_head_only_change_only_the_intended_parameters():
    arch = w.DENSE.model_copy(update=dict(num_layers=2))
    _, trainable, changed = run_ranks(w.value_model_step, 1, arch, "freeze_attention")[0]
    assert not any(".self_attention." in n for n in trainable)
    assert any(".mlp." in n for n in trainable) and "value_head.weight" in trainable
    assert set(changed) == set(trainable)
    _, trainable, changed = run_ranks(w.value_model_step, 1, arch, "head_only")[0]
    assert sorted(trainable) == ["value_head.bias", "value_head.weight"]
    assert sorted(changed) == ["value_head.bias", "value_head.weight"]


def test_value_head_lives_on_the_last_pipeline_stage():
    stages = run_ranks(w.value_head_stages, 2, w.DENSE, 2)
    assert [s[0] for s in stages] == [False, True]
    assert not any(s[1] for s in stages)  # no vocabulary projection anywhere
    assert [s[2] for s in stages] == [2, 2]
