"""The value model: head size follows the backbone; freezing options train exactly what they say."""

from __future__ import annotations

import torch

from megatron_rl import parallel
from megatron_rl.models.sharding import full_parameters
from tests.support.ranks import DENSE
from tests.support.spawn import run_ranks
from tests.support.tensors import tokens


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


def test_sequence_parallel_value_model_gradients_equal_tp1():
    """MoE at TP = 2 turns on sequence parallel; the head gathers the sequence. Every gradient
    (backbone, experts, head) after megatron's finalize_model_grads equals TP = 1's."""
    arch = DENSE.model_copy(
        update=dict(num_layers=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    )
    full = run_ranks(value_model_weights, 1, arch)[0]
    _, reference_values, reference = run_ranks(value_model_gradients, 1, arch, full, 1)[0]
    for sequence_parallel, values, grads in run_ranks(value_model_gradients, 2, arch, full, 2):
        assert sequence_parallel
        torch.testing.assert_close(values, reference_values, atol=1e-5, rtol=0)
        assert set(grads) == set(reference)
        for name, grad in reference.items():
            torch.testing.assert_close(grads[name], grad, atol=1e-6, rtol=1e-4, msg=name)


# Rank functions: module-level, so that the spawned ranks can import them.


def value_model_weights(rank, world_size, arch):
    from megatron_rl.models.value_model import build_value_model

    parallel.initialize_model_parallel()
    torch.manual_seed(0)
    return full_parameters(build_value_model(arch, head_init_std=0.1))


def value_model_gradients(rank, world_size, arch, full, tp):
    """(sequence_parallel, values, every gradient gathered to full tensors by name) of a value
    model at TP = tp after one backward of a squared error and finalize_model_grads."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )

    from megatron_rl.models.builder import transformer_config
    from megatron_rl.models.sharding import gather_full_gradients, load_full_state_dict
    from megatron_rl.models.value_model import build_value_model

    parallel.initialize_model_parallel(tp=tp)
    config = transformer_config(arch, tp=tp)
    model = build_value_model(arch, config=config)
    load_full_state_dict(model, full)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    input_ids = tokens(vocab=arch.vocab_size)  # 24 positions: divisible by TP for sequence parallel
    values = ddp(input_ids, torch.arange(input_ids.shape[1]).expand_as(input_ids), attention_mask=None)
    target = torch.linspace(-1, 1, values.numel()).reshape(values.shape)
    ((values - target) ** 2).mean().backward()
    finalize_model_grads([ddp])
    return config.sequence_parallel, values.detach(), gather_full_gradients(model)


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
