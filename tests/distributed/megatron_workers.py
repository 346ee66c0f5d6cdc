"""Rank functions for tests/distributed/test_megatron_cpu.py (importable: ranks are spawned).

Every function takes (rank, world_size, ...) and returns plain tensors; the test compares them
against a single-process reference built from the same full weights.
"""

from __future__ import annotations

import torch

from megatron_rl import parallel
from megatron_rl.config import Architecture
from megatron_rl.models.builder import build_gpt_model, transformer_config
from megatron_rl.models.sharding import full_parameters, load_full_state_dict, local_to_global_name

DENSE = Architecture(
    family="qwen3",
    hidden_size=64,
    num_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=96,
    vocab_size=128,
    qk_norm=True,
)
MOE = DENSE.model_copy(
    update=dict(
        family="qwen3_moe", num_layers=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32
    )
)


def tokens(batch: int = 2, seq: int = 24, vocab: int = 128, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def reference_weights(rank: int, world_size: int, arch: Architecture, seed: int) -> dict[str, torch.Tensor]:
    """Random full weights from a TP=EP=PP=1 model."""
    parallel.initialize_model_parallel(seed=seed)
    torch.manual_seed(seed)
    return full_parameters(build_gpt_model(arch))


def _gather_vocab(logits: torch.Tensor) -> torch.Tensor:
    from megatron.core import tensor_parallel

    return tensor_parallel.gather_from_tensor_model_parallel_region(logits)


def logits(rank, world_size, arch, full, tp=1, ep=1, input_ids=None):
    """Full-vocabulary logits [batch, seq, vocab] of the model at (tp, ep), eval mode."""
    parallel.initialize_model_parallel(tp=tp, ep=ep)
    model = build_gpt_model(arch, tp=tp, ep=ep)
    load_full_state_dict(model, full)
    model.eval()
    input_ids = tokens() if input_ids is None else input_ids
    positions = torch.arange(input_ids.shape[1]).expand_as(input_ids)
    with torch.no_grad():
        out = model(input_ids, positions, attention_mask=None)
    return _gather_vocab(out)


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
        model.zero_grad_buffer()
        optimizer.zero_grad()
        input_ids = tokens(seed=100 * step + rank)
        positions = torch.arange(input_ids.shape[1]).expand_as(input_ids)
        labels = torch.roll(input_ids, -1, dims=1)
        loss = model(input_ids, positions, attention_mask=None, labels=labels).float().mean()
        loss.backward()
        model.finish_grad_sync()
        update_successful, _, _ = optimizer.step()
        assert update_successful
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
        return _gather_vocab(model(input_ids, positions, attention_mask=None))


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
        return _gather_vocab(model(input_ids, positions, attention_mask=None))


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


def vocab_parallel_logprob_grads(rank, world_size, logits_full, targets, weights):
    """Log-probs, entropy and the gradient of sum(w1*logp + w2*H) w.r.t. this rank's logits."""
    from megatron_rl.models.logprobs import megatron_vocab_parallel_logprobs

    parallel.initialize_model_parallel(tp=world_size)
    local = logits_full.chunk(world_size, dim=-1)[rank].clone().requires_grad_()
    logprobs, entropy = megatron_vocab_parallel_logprobs(local, targets)
    (weights[0] * logprobs + weights[1] * entropy).sum().backward()
    return logprobs.detach(), entropy.detach(), local.grad


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


def packed_logits(rank, world_size, arch, full, lengths, tp=1, ep=1, pad=0, seed=0):
    """Logits of sequences packed into one THD row (plus `pad` padding tokens), split back per
    sequence, and of each sequence run alone; full vocabulary."""
    from megatron_rl.models.attention import packed_seq_params

    parallel.initialize_model_parallel(tp=tp, ep=ep)
    model = build_gpt_model(arch, tp=tp, ep=ep)
    load_full_state_dict(model, full)
    model.eval()
    g = torch.Generator().manual_seed(seed)
    sequences = [torch.randint(0, arch.vocab_size, (n,), generator=g) for n in lengths]
    packed = torch.cat(sequences + [torch.zeros(pad, dtype=torch.long)])[None]
    positions = torch.cat([torch.arange(n) for n in lengths] + [torch.arange(pad)])[None]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    with torch.no_grad():
        out = _gather_vocab(
            model(
                packed,
                positions,
                attention_mask=None,
                packed_seq_params=packed_seq_params(cu, packed.shape[1]),
            )
        )[0]
        # Under sequence parallel (MoE at TP>1) a lone sequence must divide by TP to run at all.
        sp = tp if model.config.sequence_parallel else 1
        separate = [
            _gather_vocab(model(s[None], torch.arange(len(s))[None], attention_mask=None))[0]
            if len(s) % sp == 0
            else None
            for s in sequences
        ]
    return [out[a:b] for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())], separate, sequences


def context_parallel_step(rank, world_size, arch, full, lengths, tp=1, cp=1, pad=0, seed=0):
    """One forward/backward on sequences packed in one THD row, the row split contiguously over
    CP ranks. Returns (full-row logits [T, V], loss, grads of replicated params summed over CP)."""
    from megatron.core import parallel_state

    from megatron_rl.models.attention import packed_seq_params
    from megatron_rl.models.logprobs import megatron_vocab_parallel_logprobs
    from megatron_rl.models.sharding import _offsets

    parallel.initialize_model_parallel(tp=tp, cp=cp)
    model = build_gpt_model(arch, tp=tp, cp=cp)
    load_full_state_dict(model, full)
    g = torch.Generator().manual_seed(seed)
    row = torch.cat(
        [torch.randint(0, arch.vocab_size, (n,), generator=g) for n in lengths]
        + [torch.zeros(pad, dtype=torch.long)]
    )
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    total = len(row)
    targets = torch.roll(row, -1)
    mask = torch.zeros(total, dtype=torch.bool)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        mask[a : b - 1] = True  # predict the next token inside each sequence
    cp_rank = parallel_state.get_context_parallel_rank()
    local = slice(cp_rank * total // cp, (cp_rank + 1) * total // cp)
    logits = model(
        row[None, local],
        torch.arange(total)[None, local],
        attention_mask=None,
        packed_seq_params=packed_seq_params(cu, total),
    )[0]
    logprobs, _ = megatron_vocab_parallel_logprobs(logits, targets[local])
    loss = -(logprobs * mask[local]).sum() / mask.sum()  # normalised by the global token count
    loss.backward()
    cp_group = parallel_state.get_context_parallel_group()
    layer_offset, expert_offset = _offsets(model)
    grads = {}
    for name, p in model.named_parameters():
        if getattr(p, "tensor_model_parallel", False):
            continue
        grad = p.grad.detach().clone()
        if cp > 1:
            torch.distributed.all_reduce(grad, group=cp_group)
        if tp > 1 and ("q_layernorm" in name or "k_layernorm" in name):
            # As megatron's finalize_model_grads: each TP rank saw only its own heads.
            torch.distributed.all_reduce(grad, group=parallel_state.get_tensor_model_parallel_group())
        grads[local_to_global_name(name, layer_offset, expert_offset)] = grad
    full_logits = _gather_vocab(logits.detach()[:, None, :])[:, 0, :]
    if cp > 1:
        parts = [torch.empty_like(full_logits) for _ in range(cp)]
        torch.distributed.all_gather(parts, full_logits.contiguous(), group=cp_group)
        full_logits = torch.cat(parts)
    total_loss = loss.detach().clone()
    if cp > 1:
        torch.distributed.all_reduce(total_loss, group=cp_group)
    core = type(model.decoder.layers[0].self_attention.core_attention).__name__
    return full_logits, total_loss, grads, core


def lora_step(rank, world_size, arch, full, tp=1, value_model=False):
    """LoRA (rank 4, alpha 8, B set to 0.01 so adapters matter) on a GPT or value model:
    (output before the step, trainable names, changed names, replicated lora_a after an SGD step,
    output after merging the stepped adapters, output of the stepped LoRA model)."""
    from megatron_rl.models.lora import apply_lora, merge_lora
    from megatron_rl.models.value_model import build_value_model

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
        return out if value_model else _gather_vocab(out)

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


def value_head_stages(rank, world_size, arch, pp):
    """Which pipeline stages of a value model hold the value head."""
    from megatron_rl.models.value_model import build_value_model

    parallel.initialize_model_parallel(pp=pp)
    model = build_value_model(arch, pp=pp)
    return hasattr(model, "value_head"), hasattr(model, "output_layer"), len(model.decoder.layers)


def training_samples(count: int, vocab: int, seed: int = 0):
    """Random samples with prompts, action/observation spans, advantages, returns, old logprobs
    near a uniform policy's (so importance ratios land inside and outside the clip bands)."""
    import numpy as np

    from megatron_rl.data.types import TrainingSample

    rng = np.random.default_rng(seed)
    samples = []
    for i in range(count):
        n = int(rng.integers(6, 40))
        mask = np.zeros(n, dtype=bool)
        mask[3:] = rng.random(n - 3) < 0.75
        samples.append(
            TrainingSample(
                token_ids=rng.integers(0, vocab, n),
                loss_mask=mask,
                inference_logprobs=np.where(mask, -np.log(vocab) + rng.uniform(-0.4, 0.4, n), 0.0),
                reward=float(rng.normal()),
                group_id=i,
                values=rng.normal(size=n).astype(np.float32),
                advantages=np.where(mask, rng.normal(size=n), 0.0).astype(np.float32),
                returns=np.where(mask, rng.normal(size=n), 0.0).astype(np.float32),
            )
        )
    return samples


def one_training_step(rank, world_size, arch, full, tp, cp, algorithm_type, count=7, critic=False):
    """Packs `count` samples for this layout, runs one train_step; returns (metrics, params)."""
    from megatron.core import parallel_state

    from megatron_rl.config import AlgorithmConfig, OptimizerConfig
    from megatron_rl.data.packing import pack_into_grid
    from megatron_rl.models.sharding import gather_full_parameters
    from megatron_rl.models.value_model import build_value_model
    from megatron_rl.trainer.optimizer import build_trainable
    from megatron_rl.trainer.step import policy_loss_func, train_step, value_loss_func

    parallel.initialize_model_parallel(tp=tp, cp=cp)
    if critic:
        model = build_value_model(arch, tp=tp, cp=cp, head_init_std=0.1)
    else:
        model = build_gpt_model(arch, tp=tp, cp=cp)
    reference = full_parameters(model) if critic else {}
    load_full_state_dict(model, {**reference, **full})
    # Adam's first step is lr * g / (|g| + eps): output-layer rows of unseen tokens have |g| near
    # 1e-9, where summation-order noise (CP splits the sum differently) would be scaled up to a
    # visible fraction of lr with the default eps 1e-8. Metrics and larger gradients agree to ~1e-7.
    optimizer_config = OptimizerConfig(lr=1e-3, weight_decay=0.01, grad_clip=1.0, adam_eps=1e-6)
    trainable = build_trainable(model, optimizer_config, total_steps=10)
    dp = parallel_state.get_data_parallel_world_size()
    grid = pack_into_grid(training_samples(count, arch.vocab_size), 64, dp, cp)
    if critic:
        loss_func = value_loss_func(value_clip=0.5)
    else:
        loss_func = policy_loss_func(AlgorithmConfig(type=algorithm_type))
    metrics = train_step(trainable, grid[parallel_state.get_data_parallel_rank()], loss_func)
    dummies = sum(mb.is_dummy for row in grid for mb in row)
    return metrics, gather_full_parameters(model), dummies


def resumable_training(rank, world_size, arch, full, directory, steps, save_at=None, tp=1, keep_last=2):
    """Runs `steps` (a range) of SAO train_step on per-step samples; loads the latest checkpoint in
    `directory` first if there is one; saves after step `save_at`. Returns {step: loss}."""
    from megatron.core import parallel_state

    from megatron_rl.config import AlgorithmConfig, OptimizerConfig
    from megatron_rl.data.packing import pack_into_grid
    from megatron_rl.trainer.checkpoint import load_checkpoint, save_checkpoint
    from megatron_rl.trainer.optimizer import build_trainable
    from megatron_rl.trainer.step import policy_loss_func, train_step

    parallel.initialize_model_parallel(tp=tp)
    model = build_gpt_model(arch, tp=tp)
    load_full_state_dict(model, full)
    trainable = build_trainable(
        model, OptimizerConfig(lr=1e-3, warmup_steps=2, lr_decay_style="cosine"), total_steps=8
    )
    meta = load_checkpoint(directory, trainable)
    if meta is not None:
        assert meta["step"] == steps[0] - 1, (meta["step"], steps)
    loss_func = policy_loss_func(AlgorithmConfig(type="sao"))
    dp = parallel_state.get_data_parallel_world_size()
    losses = {}
    for step in steps:
        grid = pack_into_grid(training_samples(6, arch.vocab_size, seed=step), 64, dp)
        losses[step] = train_step(trainable, grid[parallel_state.get_data_parallel_rank()], loss_func)["loss"]
        if step == save_at:
            save_checkpoint(directory, step, trainable, extra={"policy_version": step}, keep_last=keep_last)
    return losses


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
    return _gather_vocab(out), str(path)


def policy_reference_losses(rank, world_size, resolved_path, steps, samples_per_step):
    """Single-process reference for the train-policy process: same config, weights and samples."""
    from megatron_rl.config import load_resolved
    from megatron_rl.data.packing import pack_into_grid
    from megatron_rl.policy.trainer import build_reference
    from megatron_rl.trainer.optimizer import build_trainable
    from megatron_rl.trainer.step import policy_loss_func, train_step
    from megatron_rl.trainer.weights import load_initial_weights

    resolved = load_resolved(resolved_path)
    parallel.initialize_model_parallel(seed=resolved.orchestrator.seed)
    arch = resolved.layout.policy_architecture
    model = build_gpt_model(arch, seq_len=resolved.model.seq_len)
    load_initial_weights(model, resolved.model.checkpoint, arch)
    kl_coef = resolved.algorithm.kl_coef
    reference = build_reference(model, resolved.layout.policy, resolved) if kl_coef > 0 else None
    trainable = build_trainable(model, resolved.optimizer, total_steps=resolved.orchestrator.num_steps)
    loss_func = policy_loss_func(resolved.algorithm)
    losses = []
    for step in range(steps):
        grid = pack_into_grid(
            training_samples(samples_per_step, arch.vocab_size, seed=step), resolved.model.seq_len, 1
        )
        losses.append(train_step(trainable, grid[0], loss_func, reference=reference)["loss"])
    return losses


def value_reference_weights(rank, world_size, arch, seed):
    """Random full weights of a TP=1 value model (non-zero head)."""
    from megatron_rl.models.value_model import build_value_model

    parallel.initialize_model_parallel(seed=seed)
    torch.manual_seed(seed)
    return full_parameters(build_value_model(arch, head_init_std=0.5))


def critic_scores(rank, world_size, arch, full, tp, cp, requests, seq_len=64, pp=1):
    """Scores each request (a list of token-id lists) with a value model at (tp, cp, pp,
    dp = rest); rank 0 returns its ScoreResults as plain lists, other ranks None."""
    from megatron_rl.critic.scoring import score_sequences
    from megatron_rl.models.value_model import build_value_model

    parallel.initialize_model_parallel(tp=tp, cp=cp, pp=pp)
    model = build_value_model(arch, tp=tp, cp=cp, pp=pp)
    load_full_state_dict(model, full)
    results = []
    for request in requests:
        result = score_sequences(model, request if rank == 0 else None, seq_len)
        if result is not None:
            results.append(([v.tolist() for v in result.values], result.bootstrap_values))
    return results if rank == 0 else None


def value_model_direct(rank, world_size, arch, full, batch):
    """Head output per token for each sequence alone ([T] float32 each), TP=1, unpacked."""
    from megatron_rl.models.value_model import build_value_model

    parallel.initialize_model_parallel()
    model = build_value_model(arch)
    load_full_state_dict(model, full)
    model.eval()
    with torch.no_grad():
        return [
            model(torch.tensor([ids]), torch.arange(len(ids))[None], attention_mask=None)[0] for ids in batch
        ]


def kl_training_steps(rank, world_size, arch, full, tp, cp, kl_coef, steps=2):
    """SAO steps with KL to a frozen reference (the initial weights); per-step metrics and the
    final full parameters."""
    from megatron.core import parallel_state

    from megatron_rl.config import AlgorithmConfig, OptimizerConfig
    from megatron_rl.data.packing import pack_into_grid
    from megatron_rl.models.sharding import gather_full_parameters
    from megatron_rl.trainer.optimizer import build_trainable
    from megatron_rl.trainer.step import policy_loss_func, train_step

    parallel.initialize_model_parallel(tp=tp, cp=cp)
    model = build_gpt_model(arch, tp=tp, cp=cp)
    load_full_state_dict(model, full)
    reference = build_gpt_model(arch, tp=tp, cp=cp)
    load_full_state_dict(reference, full)
    reference.requires_grad_(False)
    trainable = build_trainable(model, OptimizerConfig(lr=1e-3, grad_clip=1.0, adam_eps=1e-6), total_steps=10)
    dp = parallel_state.get_data_parallel_world_size()
    loss_func = policy_loss_func(AlgorithmConfig(type="sao", kl_coef=kl_coef))
    records = []
    for step in range(steps):
        grid = pack_into_grid(training_samples(6, arch.vocab_size, seed=step), 64, dp, cp)
        metrics = train_step(
            trainable,
            grid[parallel_state.get_data_parallel_rank()],
            loss_func,
            reference if kl_coef > 0 else None,
        )
        records.append(
            {k: metrics[k] for k in ("loss", "num_tokens", "grad_norm")}
            | {"kl_ref_sum": metrics.get("kl_ref_sum", 0.0)}
        )
    return records, gather_full_parameters(model)


def poisoned_then_clean_steps(rank, world_size, arch, full, poison_rank):
    """A step whose loss is NaN on `poison_rank` only, then a clean step. Returns (metrics of
    both, parameters before, after the poisoned step, after the clean step)."""
    from megatron.core import parallel_state

    from megatron_rl.config import AlgorithmConfig, OptimizerConfig
    from megatron_rl.data.packing import pack_into_grid
    from megatron_rl.models.sharding import gather_full_parameters
    from megatron_rl.trainer.optimizer import build_trainable
    from megatron_rl.trainer.step import policy_loss_func, train_step

    parallel.initialize_model_parallel(tp=1, cp=1)
    model = build_gpt_model(arch, tp=1, cp=1)
    load_full_state_dict(model, full)
    trainable = build_trainable(model, OptimizerConfig(lr=1e-3, grad_clip=1.0), total_steps=10)
    dp = parallel_state.get_data_parallel_world_size()
    grid = pack_into_grid(training_samples(6, arch.vocab_size), 64, dp, 1)
    clean = policy_loss_func(AlgorithmConfig(type="sao"))

    def poisoned(output, batch):
        loss, metrics = clean(output, batch)
        return (loss * float("nan") if rank == poison_rank else loss), metrics

    before = gather_full_parameters(model)
    rows = grid[parallel_state.get_data_parallel_rank()]
    first = train_step(trainable, rows, poisoned)
    after_poison = gather_full_parameters(model)
    second = train_step(trainable, rows, clean)
    return first, second, before, after_poison, gather_full_parameters(model)


class RecordingControl:
    """An inference server's control that records what it was asked (no server)."""

    def __init__(self):
        self.calls = []

    def pause(self):
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
    from megatron_rl.policy import publish
    from megatron_rl.transport import weight_buckets

    def lost(*args, **kwargs):
        raise ConnectionError("weight-update link lost")

    publish.owned_hf_tensors = lambda model, arch: {}
    weight_buckets.broadcast_end = lost
    controls = [RecordingControl(), RecordingControl()]
    publisher = publish.BroadcastPublisher(None, controls, "127.0.0.1", 0, backend="gloo", timeout_s=5)
    publisher.group = object()  # connected (the stream itself is what fails)
    try:
        publisher.publish(None, version=3)
        error = None
    except ConnectionError as exc:
        error = str(exc)
    return error, [c.calls for c in controls]


def trainer_path_logprobs(rank, world_size, arch, full, samples, seq_len, tp=1, cp=1):
    """The policy trainer's own path: pack_into_grid -> rank_batch (shift, CP slice) -> forward ->
    vocab-parallel log-probabilities of batch.targets, on every CP rank; the full rows are put
    back together and each masked log-probability is attributed, from the packer's own
    sample_index / position_ids, to (sample, position of the predicted token). Returns
    {(sample, position): logprob} for every loss-mask token."""
    from megatron.core import parallel_state

    from megatron_rl.data.packing import pack_into_grid
    from megatron_rl.models.attention import packed_seq_params
    from megatron_rl.models.logprobs import megatron_vocab_parallel_logprobs
    from megatron_rl.trainer.batches import rank_batch

    parallel.initialize_model_parallel(tp=tp, cp=cp)
    model = build_gpt_model(arch, tp=tp, cp=cp)
    load_full_state_dict(model, full)
    model.eval()
    cp_rank, cp_group = parallel_state.get_context_parallel_rank(), parallel_state.get_context_parallel_group()
    out = {}
    for mb in pack_into_grid(samples, seq_len, 1, cp)[0]:
        batch = rank_batch(mb, cp_rank, cp)
        with torch.no_grad():
            logits = model(batch.input_ids, batch.position_ids, attention_mask=None,
                           packed_seq_params=packed_seq_params(batch.cu_seqlens, batch.total_tokens))  # fmt: skip
            logprobs, _ = megatron_vocab_parallel_logprobs(logits[0], batch.targets)
        parts = [logprobs, batch.loss_mask.float()]
        if cp > 1:
            gathered = []
            for part in parts:
                chunks = [torch.empty_like(part) for _ in range(cp)]
                torch.distributed.all_gather(chunks, part.contiguous(), group=cp_group)
                gathered.append(torch.cat(chunks))
            parts = gathered
        row_logprobs, row_mask = parts
        for p in torch.nonzero(row_mask).flatten().tolist():  # output p predicts token p + 1
            out[(int(mb.sample_index[p + 1]), int(mb.position_ids[p + 1]))] = float(row_logprobs[p])
    return out


def recompute_step(rank, world_size, arch, full, recompute_fields, tp=1):
    """One SAO train_step on a model built with `recompute_fields` (TransformerConfig recompute
    settings); returns (metrics, full parameters after the step)."""
    from megatron.core import parallel_state

    from megatron_rl.config import AlgorithmConfig, OptimizerConfig
    from megatron_rl.data.packing import pack_into_grid
    from megatron_rl.models.sharding import gather_full_parameters
    from megatron_rl.trainer.optimizer import build_trainable
    from megatron_rl.trainer.step import policy_loss_func, train_step

    parallel.initialize_model_parallel(tp=tp)
    model = build_gpt_model(arch, tp=tp, **recompute_fields)
    load_full_state_dict(model, full)
    trainable = build_trainable(model, OptimizerConfig(lr=1e-3, grad_clip=1.0, adam_eps=1e-6), total_steps=10)
    grid = pack_into_grid(training_samples(6, arch.vocab_size, seed=3), 64, parallel_state.get_data_parallel_world_size())
    metrics = train_step(trainable, grid[parallel_state.get_data_parallel_rank()], policy_loss_func(AlgorithmConfig(type="sao")))
    return metrics, gather_full_parameters(model)
