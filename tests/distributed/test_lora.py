"""LoRA: only adapters train, TP=2 equals TP=1, merged weights reproduce the adapted model."""

from __future__ import annotations

import torch

from megatron_rl import parallel
from megatron_rl.models.builder import build_gpt_model
from megatron_rl.models.sharding import full_parameters, load_full_state_dict
from tests.support.ranks import DENSE, gather_vocab, model_logits, reference_weights
from tests.support.spawn import run_ranks
from tests.support.tensors import tokens

ARCH = DENSE.model_copy(update=dict(num_layers=2))
MOE = ARCH.model_copy(update=dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32))


def test_lora_trains_only_adapters_and_matches_across_tp():
    full = run_ranks(reference_weights, 1, ARCH, 3)[0]
    ref_out, trainable, changed, ref_a, ref_merged, ref_stepped = run_ranks(lora_step, 1, ARCH, full)[0]
    assert trainable and all(".lora_a" in n or ".lora_b" in n for n in trainable)
    assert {n.rsplit(".", 2)[-2] for n in trainable} == {
        "linear_qkv",
        "linear_proj",
        "linear_fc1",
        "linear_fc2",
    }
    assert sorted(changed) == sorted(trainable)  # a step moves adapters and nothing else
    torch.testing.assert_close(ref_merged, ref_stepped, atol=1e-5, rtol=0)
    plain = run_ranks(model_logits, 1, ARCH, full, 1, 1, tokens(vocab=ARCH.vocab_size))[0]
    assert (ref_out - plain).abs().max() > 1e-3  # the adapters change the output
    for out, _, _, a, merged, stepped in run_ranks(lora_step, 2, ARCH, full, 2):
        torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=0)
        torch.testing.assert_close(stepped, ref_stepped, atol=1e-5, rtol=0)
        torch.testing.assert_close(merged, ref_merged, atol=1e-5, rtol=0)
        for name, value in ref_a.items():  # replicated A got the TP-summed gradient
            torch.testing.assert_close(a[name], value, atol=1e-6, rtol=0)


def test_lora_on_the_value_model_keeps_the_head_trainable():
    full = run_ranks(reference_weights, 1, ARCH, 3)[0]
    _, trainable, changed, _, merged, stepped = run_ranks(lora_step, 1, ARCH, full, 1, True)[0]
    assert "value_head.weight" in trainable and sorted(changed) == sorted(trainable)
    assert all(".lora_" in n or n.startswith("value_head.") for n in trainable)
    torch.testing.assert_close(merged, stepped, atol=1e-5, rtol=0)


def test_expert_adapters_under_ep2_get_their_own_experts_gradients():
    """DP = 2 at EP = 1 (every rank holds all 4 experts) against EP = 2 (each rank holds 2):
    the same initial adapters, and after megatron DDP's gradient reduction each expert's adapter
    gradient equals EP = 1's. Without allreduce=False on expert adapters DDP averages rank 0's
    expert 0 with rank 1's expert 2."""
    full = run_ranks(reference_weights, 1, MOE, 3)[0]
    ep1 = run_ranks(lora_ddp_gradients, 2, MOE, full, 1)
    ep2 = run_ranks(lora_ddp_gradients, 2, MOE, full, 2)
    for rank, (initial_a, grads, expert_local) in enumerate(ep2):
        experts = {n for n in grads if ".experts." in n}
        assert experts and all(expert_local[n] for n in experts)
        assert not any(expert_local[n] for n in set(grads) - experts)
        for name, a in initial_a.items():  # drawn from the layer's name in the full model
            assert torch.equal(a, ep1[rank][0][name]), name
        for name in grads:
            torch.testing.assert_close(grads[name], ep1[rank][1][name], atol=1e-6, rtol=1e-5, msg=name)
    assert {n for _, grads, _ in ep2 for n in grads} == set(ep1[0][1])  # the ranks hold every expert


def test_a_gathered_lora_model_merges_to_the_plain_models_weights_and_its_base_runs_without_a_copy():
    """At TP = 1 and TP = 2 (gated SwiGLU fc1, whose B rows are [gate; up] per shard like W's):
    the gathered state of a LoRA model keeps the plain model's names beside its adapters, and
    `merge_adapter_tensors` of it equals `merge_lora` at TP = 1; the merged weights run as the
    adapted model; within `adapters_disabled` the adapted model is the plain one, bit for bit."""
    from megatron_rl.conversion.hf_mapping import megatron_to_hf

    full = run_ranks(reference_weights, 1, ARCH, 3)[0]
    input_ids = tokens(vocab=ARCH.vocab_size)
    plain = run_ranks(model_logits, 1, ARCH, full, 1, 1, input_ids)[0]
    reference = run_ranks(lora_gathered, 1, ARCH, full, 1, input_ids)[0]
    merged_tp1, names_tp1, adapted_tp1, disabled_tp1, merged_by_layer = reference
    assert names_tp1 == sorted(full) and not any(".base." in n for n in merged_tp1)
    for name, tensor in merged_by_layer.items():  # merge_lora (per shard) at TP = 1
        torch.testing.assert_close(merged_tp1[name], tensor, atol=1e-6, rtol=0, msg=name)
    assert sum(not torch.equal(merged_tp1[n], full[n]) for n in full) == 4 * ARCH.num_layers  # the adapted layers
    assert torch.equal(disabled_tp1, plain) and (adapted_tp1 - plain).abs().max() > 1e-3
    merged_logits = run_ranks(model_logits, 1, ARCH, merged_tp1, 1, 1, input_ids)[0]
    torch.testing.assert_close(merged_logits, adapted_tp1, atol=1e-5, rtol=0)
    megatron_to_hf(merged_tp1, ARCH)  # every HF tensor of the plain model is there
    for merged, names, adapted, disabled, _ in run_ranks(lora_gathered, 2, ARCH, full, 2, input_ids):
        assert names == names_tp1
        for name, tensor in merged_tp1.items():
            torch.testing.assert_close(merged[name], tensor, atol=1e-6, rtol=0, msg=name)
        torch.testing.assert_close(adapted, adapted_tp1, atol=1e-5, rtol=0)
        torch.testing.assert_close(disabled, plain, atol=1e-5, rtol=0)


# Rank functions: module-level, so that the spawned ranks can import them.


def lora_gathered(rank, world_size, arch, full, tp, input_ids):
    """LoRA (rank 4, alpha 8; B drawn from each layer's name, so equal at every TP) at `tp`:
    (merge_adapter_tensors of the gathered state, the gathered names without adapters, adapted
    logits, logits within adapters_disabled, at TP = 1 the full weights after merge_lora)."""
    import zlib

    from megatron_rl.models.sharding import (
        gather_full_parameters,
        global_parameter_names,
        shard_full_state_dict,
    )
    from megatron_rl.transforms.lora import adapters_disabled, apply_lora, merge_adapter_tensors, merge_lora

    parallel.initialize_model_parallel(tp=tp)
    model = build_gpt_model(arch, tp=tp)
    load_full_state_dict(model, full)
    apply_lora(model, rank=4, alpha=8.0)
    names = global_parameter_names(model)
    full_b = {}
    for n, p in model.named_parameters():
        if n.endswith("lora_b"):  # a full B per layer, then this rank's shard of it
            rows = p.shape[0] * (tp if getattr(p, "tensor_model_parallel", False) else 1)
            g = torch.Generator().manual_seed(zlib.crc32(names[n].encode()))
            full_b[names[n]] = 0.05 * torch.randn(rows, p.shape[1], generator=g)
    assert model.config.gated_linear_unit  # fc1 holds [gate; up]
    shards = shard_full_state_dict(model, {**gather_full_parameters(model), **full_b})
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("lora_b"):
                p.copy_(shards[n])
    model.eval()
    positions = torch.arange(input_ids.shape[1]).expand_as(input_ids)
    with torch.no_grad():
        adapted = gather_vocab(model(input_ids, positions, attention_mask=None))
        with adapters_disabled(model) as count:
            assert count == 4 * arch.num_layers
            disabled = gather_vocab(model(input_ids, positions, attention_mask=None))
    gathered = gather_full_parameters(model)
    merged = merge_adapter_tensors(gathered, alpha=8.0)
    by_layer = {}
    if tp == 1:
        merge_lora(model)
        by_layer = full_parameters(model)
    return merged, sorted(merged), adapted, disabled, by_layer


def lora_ddp_gradients(rank, world_size, arch, full, ep):
    """LoRA on an MoE model at (DP, EP) = (world_size, ep) under megatron DDP; each rank's batch
    is its own. Returns (initial lora_a, adapter gradients after finalize_model_grads, whether
    each adapter is expert-local (allreduce False)), by name in the full model."""
    import zlib

    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )

    from megatron_rl.models.builder import transformer_config
    from megatron_rl.models.sharding import global_parameter_names
    from megatron_rl.transforms.lora import apply_lora

    parallel.initialize_model_parallel(ep=ep)
    config = transformer_config(arch, ep=ep)
    model = build_gpt_model(arch, config=config)
    load_full_state_dict(model, full)
    apply_lora(model, rank=4, alpha=8.0)
    names = global_parameter_names(model)
    initial_a = {names[n]: p.detach().clone() for n, p in model.named_parameters() if n.endswith("lora_a")}
    with torch.no_grad():  # B nonzero, different per adapter, the same at both layouts
        for n, p in model.named_parameters():
            if n.endswith("lora_b"):
                g = torch.Generator().manual_seed(zlib.crc32(names[n].encode()))
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    input_ids = tokens(vocab=arch.vocab_size, seed=rank)
    positions = torch.arange(input_ids.shape[1]).expand_as(input_ids)
    labels = torch.roll(input_ids, -1, dims=1)
    ddp(input_ids, positions, attention_mask=None, labels=labels).float().mean().backward()
    finalize_model_grads([ddp])
    adapters = [(n, p) for n, p in model.named_parameters() if ".lora_" in n]
    grads = {names[n]: p.main_grad.detach().clone() for n, p in adapters}
    expert_local = {names[n]: not getattr(p, "allreduce", True) for n, p in adapters}
    return initial_a, grads, expert_local


def lora_step(rank, world_size, arch, full, tp=1, value_model=False):
    """LoRA (rank 4, alpha 8, B set to 0.01 so adapters matter) on a GPT or value model:
    (output before the step, trainable names, changed names, replicated lora_a after an SGD step,
    output after merging the stepped adapters, output of the stepped LoRA model)."""
    from megatron_rl.models.value_model import build_value_model
    from megatron_rl.transforms.lora import apply_lora, merge_lora

    parallel.initialize_model_parallel(tp=tp)
    model = build_value_model(arch, tp=tp, head_init_std=0.1) if value_model else build_gpt_model(arch, tp=tp)
    reference = {k: v for k, v in full.items() if not k.startswith("value_head")}
    load_full_state_dict(model, {**full_parameters(model), **reference})
    apply_lora(model, rank=4, alpha=8.0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_b"):
                p.fill_(0.01)
    input_ids = tokens(vocab=arch.vocab_size)
    positions = torch.arange(input_ids.shape[1]).expand_as(input_ids)

    def output():
        out = model(input_ids, positions, attention_mask=None)
        return out if value_model else gather_vocab(out)

    before_step = output()
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    snapshot = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
    before_step.float().pow(2).mean().backward()
    optimizer.step()
    changed = [n for n, p in model.named_parameters() if not torch.equal(p.detach(), snapshot[n])]
    column_a = {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith("linear_qkv.lora_a")}
    model.eval()
    with torch.no_grad():
        stepped = output()
        merge_lora(model)
        merged = output()
    return before_step.detach(), trainable, changed, column_a, merged, stepped
