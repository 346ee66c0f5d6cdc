"""megatron-core on CPU/gloo through megatron_rl.compat: parallel layouts equal their references.

Each test spawns fresh gloo ranks (tests.support.spawn) and compares with a single-process
run on the same full weights.
"""

from __future__ import annotations

import pytest
import torch

from megatron_rl import parallel
from megatron_rl.models.builder import build_gpt_model, transformer_config
from megatron_rl.models.sharding import full_parameters, load_full_state_dict, local_to_global_name
from tests.support.ranks import DENSE, gather_vocab, model_logits, reference_weights
from tests.support.spawn import run_ranks
from tests.support.tensors import tokens


@pytest.fixture(scope="module")
def dense_weights():
    return run_ranks(reference_weights, 1, DENSE, 7)[0]


@pytest.fixture(scope="module")
def moe_weights():
    return run_ranks(reference_weights, 1, MOE, 11)[0]


def test_tp2_logits_equal_tp1(dense_weights):
    reference = run_ranks(model_logits, 1, DENSE, dense_weights)[0]
    for rank_logits in run_ranks(model_logits, 2, DENSE, dense_weights, 2):
        assert rank_logits.shape == reference.shape == (2, 24, DENSE.vocab_size)
        torch.testing.assert_close(rank_logits, reference, atol=1e-5, rtol=0)


def test_ep2_moe_equals_ep1(moe_weights):
    reference = run_ranks(model_logits, 1, MOE, moe_weights)[0]
    for rank_logits in run_ranks(model_logits, 2, MOE, moe_weights, 1, 2):
        torch.testing.assert_close(rank_logits, reference, atol=1e-5, rtol=0)
    # The comparison is not vacuous: moving expert 3's weights onto expert 0 changes the output.
    swapped = dict(moe_weights)
    for key in [k for k in moe_weights if ".local_experts.0." in k]:
        swapped[key] = moe_weights[key.replace(".local_experts.0.", ".local_experts.3.")]
    changed = run_ranks(model_logits, 2, MOE, swapped, 1, 2)[0]
    assert (changed - reference).abs().max() > 1e-3


@pytest.mark.slow
def test_tp2_ep2_moe_equals_reference_with_sequence_parallel(moe_weights):
    """4 ranks: TP=2 x EP=2 (sequence parallel, uneven expert all-gather on gloo)."""
    reference = run_ranks(model_logits, 1, MOE, moe_weights)[0]
    for rank_logits in run_ranks(model_logits, 4, MOE, moe_weights, 2, 2):
        torch.testing.assert_close(rank_logits, reference, atol=1e-5, rtol=0)
    # Replicated weights (norms, router) get the TP=1 gradient after finalize_model_grads: the
    # sequence-parallel tag on torch norms makes their gradient sum over TP.
    ref_loss, ref_grads = run_ranks(train_loss_and_grads, 1, MOE, moe_weights)[0]
    for loss, grads in run_ranks(train_loss_and_grads, 4, MOE, moe_weights, 2, 2):
        torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=0)
        norm_names = [n for n in grads if "layernorm" in n]
        assert any("input_layernorm" in n for n in norm_names) and any("k_layernorm" in n for n in norm_names)
        for name in norm_names:
            torch.testing.assert_close(grads[name], ref_grads[name], atol=1e-5, rtol=1e-4, msg=name)


def test_pp2_loss_equals_pp1(dense_weights):
    ref_losses, ref_grad_sq = run_ranks(pipeline_losses, 1, DENSE, dense_weights, 1)[0]
    stages = run_ranks(pipeline_losses, 2, DENSE, dense_weights, 2)
    last_stage_losses = stages[1][0]
    assert len(last_stage_losses) == len(ref_losses) == 3
    torch.testing.assert_close(torch.stack(last_stage_losses), torch.stack(ref_losses), atol=1e-6, rtol=0)
    # Gradients: both stages together carry the PP=1 model's gradient norm.
    torch.testing.assert_close(stages[0][1] + stages[1][1], ref_grad_sq, atol=1e-5, rtol=1e-5)


def test_distributed_optimizer_step_equals_plain_adamw(dense_weights):
    lr, weight_decay, steps = 1e-2, 0.1, 2
    ranks = run_ranks(distributed_optimizer_step, 2, DENSE, dense_weights, lr, weight_decay, steps)
    reference = run_ranks(plain_adamw_steps, 1, DENSE, dense_weights, lr, weight_decay, 2, steps)[0]
    assert set(ranks[0]) == set(reference)
    moved = max((reference[k] - dense_weights[k]).abs().max() for k in reference)
    assert moved > 1e-3  # the step really changed the weights
    for params in ranks:
        for name, value in reference.items():
            torch.testing.assert_close(params[name], value, atol=2e-6, rtol=0, msg=name)


def test_dist_checkpoint_saved_at_tp2_loads_at_tp1(dense_weights, tmp_path):
    (tmp_path / "ckpt").mkdir()
    saved = run_ranks(save_checkpoint_then_logits, 2, DENSE, dense_weights, 2, str(tmp_path / "ckpt"))
    loaded = run_ranks(load_checkpoint_then_logits, 1, DENSE, 1, str(tmp_path / "ckpt"))[0]
    torch.testing.assert_close(loaded, saved[0], atol=1e-5, rtol=0)
    # The freshly initialised TP=1 model (different seed) is far from the checkpoint before loading.
    fresh = run_ranks(model_logits, 1, DENSE, run_ranks(reference_weights, 1, DENSE, 999)[0])[0]
    assert (fresh - loaded).abs().max() > 1e-2


def test_distributed_optimizer_checkpoint_resume_is_exact(dense_weights, tmp_path):
    """Save model + distributed-optimizer state after 2 steps (fully_reshardable format), load in
    fresh processes, train 2 more steps: same losses and weights as an uninterrupted run."""
    lr = 1e-2
    uninterrupted = run_ranks(optimizer_checkpoint, 2, DENSE, dense_weights, lr, str(tmp_path), "plain")
    run_ranks(optimizer_checkpoint, 2, DENSE, dense_weights, lr, str(tmp_path), "save")
    resumed = run_ranks(optimizer_checkpoint, 2, DENSE, dense_weights, lr, str(tmp_path), "load")
    for (losses, params), (ref_losses, ref_params) in zip(resumed, uninterrupted):
        assert torch.equal(torch.stack(losses), torch.stack(ref_losses))
        for name, value in ref_params.items():
            assert torch.equal(params[name], value), name


# Rank functions: module-level, so that the spawned ranks can import them.


MOE = DENSE.model_copy(
    update=dict(
        family="qwen3_moe", num_layers=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32
    )
)

def train_loss_and_grads(rank, world_size, arch, full, tp=1, ep=1):
    """Loss and the gradients of replicated (not TP-sharded) weights after one backward and
    megatron's finalize_model_grads; every DP replica sees the same batch."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )

    from megatron_rl.models.sharding import _offsets

    parallel.initialize_model_parallel(tp=tp, ep=ep)
    config = transformer_config(arch, tp=tp, ep=ep)
    model = build_gpt_model(arch, config=config)
    load_full_state_dict(model, full)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    input_ids = tokens()
    positions = torch.arange(input_ids.shape[1]).expand_as(input_ids)
    labels = torch.roll(input_ids, -1, dims=1)
    loss = ddp(input_ids, positions, attention_mask=None, labels=labels).float().mean()
    loss.backward()
    # DP all-reduce, plus the TP sum of sequence-parallel norm and q/k-norm gradients.
    finalize_model_grads([ddp])
    layer_offset, expert_offset = _offsets(model)
    grads = {}
    for name, p in model.named_parameters():
        if not getattr(p, "tensor_model_parallel", False):
            grads[local_to_global_name(name, layer_offset, expert_offset)] = p.main_grad.detach().clone()
    return loss.detach(), grads

def pipeline_losses(rank, world_size, arch, full, pp, num_microbatches=3, seq=16):
    """Per-micro-batch losses from megatron's forward-backward schedule at the given PP size."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    parallel.initialize_model_parallel(pp=pp)
    config = transformer_config(arch, pp=pp)
    model = build_gpt_model(arch, config=config)
    load_full_state_dict(model, full)
    batches = [tokens(batch=2, seq=seq, seed=10 + i) for i in range(num_microbatches)]

    def forward_step(data_iterator, model):
        input_ids = next(data_iterator)
        positions = torch.arange(input_ids.shape[1]).expand_as(input_ids)
        labels = torch.roll(input_ids, -1, dims=1)
        output = model(input_ids, positions, attention_mask=None, labels=labels)

        def loss_func(per_token):
            loss = per_token.float().mean()
            return loss, {"loss": loss.detach().clone()}

        return output, loss_func

    losses = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(batches),
        model=[model],
        num_microbatches=num_microbatches,
        seq_length=seq,
        micro_batch_size=2,
        forward_only=False,
    )
    # Each stage holds its own layers' gradients: the squared norms add up across stages.
    grad_sq = sum((p.grad.float() ** 2).sum() for p in model.parameters() if p.grad is not None)
    return [d["loss"] for d in losses], grad_sq

def _named_full_parameters(model) -> dict[str, torch.Tensor]:
    from megatron_rl.models.sharding import _offsets

    layer_offset, expert_offset = _offsets(model)
    return {
        local_to_global_name(n, layer_offset, expert_offset): p.detach().clone()
        for n, p in model.named_parameters()
    }

def distributed_optimizer_step(rank, world_size, arch, full, lr, weight_decay, steps=2):
    """DP=world_size: megatron DDP + distributed optimizer; each rank trains on its own batch.

    Returns the parameters after `steps` optimizer steps (DP replicas are identical).
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer, get_standard_config_overrides

    parallel.initialize_model_parallel()
    config = transformer_config(arch)
    model = build_gpt_model(arch, config=config)
    load_full_state_dict(model, full)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=True
    )
    model = DistributedDataParallel(config, ddp_config, model)
    optimizer_config = OptimizerConfig(
        optimizer="adam",
        lr=lr,
        weight_decay=weight_decay,
        adam_beta1=0.9,
        adam_beta2=0.95,
        adam_eps=1e-8,
        clip_grad=0.0,
        use_distributed_optimizer=True,
        params_dtype=torch.float32,
    )
    # No weight decay on 1-D and bias parameters (megatron applies it everywhere without these).
    optimizer = get_megatron_optimizer(
        optimizer_config, [model], config_overrides=get_standard_config_overrides(optimizer_config)
    )
    # The scheduler writes each group's weight_decay (wd * wd_mult) and lr into the optimizer.
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=lr,
        max_lr=lr,
        min_lr=lr,
        lr_warmup_steps=0,
        lr_decay_steps=steps + 1,
        lr_decay_style="constant",
        start_wd=weight_decay,
        end_wd=weight_decay,
        wd_incr_steps=steps + 1,
        wd_incr_style="constant",
    )
    for step in range(steps):
        _train_step(model, optimizer, step, rank)  # asserts the update succeeded
        scheduler.step(1)
    return _named_full_parameters(model.module)

def save_checkpoint_then_logits(rank, world_size, arch, full, tp, directory):
    """Saves the model with dist_checkpointing at this TP size; returns its full-vocab logits."""
    from megatron.core import dist_checkpointing

    parallel.initialize_model_parallel(tp=tp)
    model = build_gpt_model(arch, tp=tp)
    load_full_state_dict(model, full)
    dist_checkpointing.save(model.sharded_state_dict(), directory)
    model.eval()
    input_ids = tokens()
    positions = torch.arange(input_ids.shape[1]).expand_as(input_ids)
    with torch.no_grad():
        return gather_vocab(model(input_ids, positions, attention_mask=None))

def load_checkpoint_then_logits(rank, world_size, arch, tp, directory, seed=999):
    """A freshly initialised model at this TP size, loaded from `directory`; full-vocab logits."""
    from megatron.core import dist_checkpointing

    parallel.initialize_model_parallel(tp=tp, seed=seed)
    model = build_gpt_model(arch, tp=tp)
    state = dist_checkpointing.load(model.sharded_state_dict(), directory)
    model.load_state_dict(state)
    model.eval()
    input_ids = tokens()
    positions = torch.arange(input_ids.shape[1]).expand_as(input_ids)
    with torch.no_grad():
        return gather_vocab(model(input_ids, positions, attention_mask=None))

def plain_adamw_steps(rank, world_size, arch, full, lr, weight_decay, dp_size, steps=2):
    """Reference for distributed_optimizer_step: torch AdamW in one process over all DP ranks'
    batches (DDP averages gradients), with megatron's rule of no decay on 1-D and bias params."""
    parallel.initialize_model_parallel()
    model = build_gpt_model(arch)
    load_full_state_dict(model, full)
    decays = {n: p.ndim > 1 and not n.endswith(".bias") for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for n, p in model.named_parameters() if decays[n]], "weight_decay": weight_decay},
            {"params": [p for n, p in model.named_parameters() if not decays[n]], "weight_decay": 0.0},
        ],
        lr=lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    for step in range(steps):
        optimizer.zero_grad()
        losses = []
        for dp_rank in range(dp_size):
            input_ids = tokens(seed=100 * step + dp_rank)
            positions = torch.arange(input_ids.shape[1]).expand_as(input_ids)
            labels = torch.roll(input_ids, -1, dims=1)
            losses.append(model(input_ids, positions, attention_mask=None, labels=labels).float().mean())
        (sum(losses) / dp_size).backward()
        optimizer.step()
    return full_parameters(model)

def _ddp_model_and_optimizer(arch, full, lr, tp=1):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer, get_standard_config_overrides

    config = transformer_config(arch, tp=tp)
    model = build_gpt_model(arch, config=config)
    load_full_state_dict(model, full)
    model = DistributedDataParallel(
        config, DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True), model
    )
    optimizer_config = OptimizerConfig(
        optimizer="adam",
        lr=lr,
        weight_decay=0.0,
        clip_grad=0.0,
        use_distributed_optimizer=True,
        params_dtype=torch.float32,
    )
    optimizer = get_megatron_optimizer(
        optimizer_config, [model], config_overrides=get_standard_config_overrides(optimizer_config)
    )
    return model, optimizer

def _train_step(model, optimizer, step, rank):
    model.zero_grad_buffer()
    optimizer.zero_grad()
    input_ids = tokens(seed=100 * step + rank)
    positions = torch.arange(input_ids.shape[1]).expand_as(input_ids)
    labels = torch.roll(input_ids, -1, dims=1)
    loss = model(input_ids, positions, attention_mask=None, labels=labels).float().mean()
    loss.backward()
    model.finish_grad_sync()
    assert optimizer.step()[0]
    return loss.detach()

def optimizer_checkpoint(rank, world_size, arch, full, lr, directory, mode, tp=1):
    """mode 'save': 2 steps, save, 2 more steps; 'load': load the checkpoint, 2 steps.
    Returns the losses of the last two steps and the final parameters."""
    from megatron.core import dist_checkpointing

    parallel.initialize_model_parallel(tp=tp)
    model, optimizer = _ddp_model_and_optimizer(arch, full, lr, tp=tp)
    metadata = {"distrib_optim_sharding_type": "fully_reshardable"}
    if mode == "plain":
        for step in range(2):
            _train_step(model, optimizer, step, rank % 2)
    elif mode == "save":
        for step in range(2):
            _train_step(model, optimizer, step, rank % 2)
        model_state = model.module.sharded_state_dict()
        state = {
            "model": model_state,
            "optimizer": optimizer.sharded_state_dict(model_state, metadata=metadata),
        }
        dist_checkpointing.save(state, directory)
    else:
        model_state = model.module.sharded_state_dict()
        template = {
            "model": model_state,
            "optimizer": optimizer.sharded_state_dict(model_state, is_loading=True, metadata=metadata),
        }
        loaded = dist_checkpointing.load(template, directory)
        model.module.load_state_dict(loaded["model"])
        optimizer.load_state_dict(loaded["optimizer"])
    losses = [_train_step(model, optimizer, step, rank % 2) for step in (2, 3)]
    return losses, _named_full_parameters(model.module)
