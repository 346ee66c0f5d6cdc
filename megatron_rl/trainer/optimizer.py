"""megatron DDP + (distributed) optimizer + LR/WD scheduler from our OptimizerConfig.

Two megatron facts this encodes: per-group weight-decay multipliers (no decay on norms and
biases) only take effect through `get_standard_config_overrides` plus OptimizerParamScheduler,
and `finalize_model_grads` must be the config's finalize function (q/k-norm and sequence-parallel
norm gradients are summed over TP there; with calculate_per_token_loss it also divides every
gradient by the global token count).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_rl.config import OptimizerConfig


@dataclass
class Trainable:
    model: list  # DDP-wrapped model chunks
    optimizer: object
    scheduler: object


def build_trainable(model: torch.nn.Module, config: OptimizerConfig, total_steps: int) -> Trainable:
    """Wraps `model` in megatron DDP and builds its optimizer and scheduler."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
    from megatron.core.optimizer import get_megatron_optimizer, get_standard_config_overrides
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    transformer_config = model.config
    transformer_config.finalize_model_grads_func = finalize_model_grads
    # Losses are sums over tokens; megatron divides gradients by the global token count. DDP
    # reads this flag when it is built (it then sums instead of averaging over DP).
    transformer_config.calculate_per_token_loss = True
    ddp = DistributedDataParallel(
        transformer_config,
        DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=config.distributed_optimizer,
        ),
        model,
    )
    optimizer_config = MegatronOptimizerConfig(
        optimizer="adam",
        lr=config.lr,
        min_lr=config.min_lr,
        weight_decay=config.weight_decay,
        adam_beta1=config.adam_beta1,
        adam_beta2=config.adam_beta2,
        adam_eps=config.adam_eps,
        clip_grad=config.grad_clip,
        use_distributed_optimizer=config.distributed_optimizer,
        bf16=transformer_config.bf16,
        fp16=transformer_config.fp16,
        params_dtype=transformer_config.params_dtype,
    )
    optimizer = get_megatron_optimizer(
        optimizer_config, [ddp], config_overrides=get_standard_config_overrides(optimizer_config)
    )
    decay_steps = max(total_steps, config.warmup_steps + 1)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if config.warmup_steps else config.lr,
        max_lr=config.lr,
        min_lr=config.min_lr if config.lr_decay_style != "constant" else config.lr,
        lr_warmup_steps=config.warmup_steps,
        lr_decay_steps=decay_steps,
        lr_decay_style=config.lr_decay_style,
        start_wd=config.weight_decay,
        end_wd=config.weight_decay,
        wd_incr_steps=decay_steps,
        wd_incr_style="constant",
    )
    return Trainable([ddp], optimizer, scheduler)
