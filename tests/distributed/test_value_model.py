"""The value model: head size follows the backbone; freezing options train exactly what they say."""

from __future__ import annotations

import torch

from megatron_rl import parallel
from megatron_rl.models.sharding import full_parameters
from megatron_rl.testing.ranks import DENSE
from megatron_rl.testing.spawn import run_ranks
from megatron_rl.testing.tensors import tokens


def test_value_head_input_size_follows_the_backbone():
    for hidden in (64, 96):
        arch = DENSE.model_copy(update=dict(hidden_size=hidden, num_layers=2))
        shape, trainable, changed = run_ranks(value_model_step, 1, arch, "none")[0]
        assert shape == (1, hidden)
        assert "value_head.weight" in trainable and not any("output_layer" in n for n in trainable)
        assert set(changed) == set(trainable)  # a full step moves every trainable tensor


def test_freeze_attention_and_head_only_change_only_the_intended_parameters():
    arch = DENSE.model_copy(update=dict(num_layers=2))
    _, trainable, changed = run_ranks(value_model_step, 1, arch, "freeze_attention")[0]
    assert not any(".self_attention." in n for n in trainable)
    assert any(".mlp." in n for n in trainable) and "value_head.weight" in trainable
    assert set(changed) == set(trainable)
    _, trainable, changed = run_ranks(value_model_step, 1, arch, "head_only")[0]
    assert sorted(trainable) == ["value_head.bias", "value_head.weight"]
    assert sorted(changed) == ["value_head.bias", "value_head.weight"]


def test_value_head_lives_on_the_last_pipeline_stage():
    stages = run_ranks(value_head_stages, 2, DENSE, 2)
    assert [s[0] for s in stages] == [False, True]
    assert not any(s[1] for s in stages)  # no vocabulary projection anywhere
    assert [s[2] for s in stages] == [2, 2]


# Rank functions: module-level, so that the spawned ranks can import them.


def value_model_step(rank, world_size, arch, option):
    """Builds a value model, applies `option` (none | freeze_attention | head_only), takes one
    SGD step; returns (head weight shape, trainable names, names whose values changed)."""
    from megatron_rl.models.value_model import build_value_model, freeze_attention, set_head_only

    parallel.initialize_model_parallel()
    torch.manual_seed(0)
    model = build_value_model(arch, head_init_std=0.1)
    if option == "freeze_attention":
        freeze_attention(model)
    elif option == "head_only":
        set_head_only(model, True)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    before = full_parameters(model)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    input_ids = tokens(vocab=arch.vocab_size)
    values = model(input_ids, torch.arange(input_ids.shape[1]).expand_as(input_ids), attention_mask=None)
    assert values.shape == input_ids.shape and values.dtype == torch.float32
    ((values - 1.0) ** 2).mean().backward()
    optimizer.step()
    changed = [n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])]
    return tuple(model.value_head.weight.shape), trainable, changed

def value_head_stages(rank, world_size, arch, pp):
    """Which pipeline stages of a value model hold the value head."""
    from megatron_rl.models.value_model import build_value_model

    parallel.initialize_model_parallel(pp=pp)
    model = build_value_model(arch, pp=pp)
    return hasattr(model, "value_head"), hasattr(model, "output_layer"), len(model.decoder.layers)
