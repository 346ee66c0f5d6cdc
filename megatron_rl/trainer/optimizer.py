"""megatron DDP + (distributed) optimizer + LR/WD scheduler from our OptimizerConfig.

Two megatron facts this encodes: per-group weight-decay multipliers (no decay on norms and
biases) only take effect through `get_standard_config_overrides` plus OptimizerParamScheduler,
and `finalize_model_grads` must be the config's finalize function (q/k-norm and sequence-parallel
norm gradients are summed over TP there; with calculate_per_token_loss it also divides every
gradient by the global token count).
"""

from __future__ import annotations

from dataclasses import dataclass

import megatron_rl.compat  # noqa: F401  (megatron-core on CPU needs its patches first)

import torch
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
from megatron.core.optimizer import ParamKey, get_megatron_optimizer, get_standard_config_overrides
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_rl.config import OptimizerConfig

# Optimizer parameter groups whose parameters match this pattern carry `{HEAD_GROUP_KEY: True}`;
# with `Trainable.head_only` every other group gets learning rate 0 for the step.
HEAD_GROUP_KEY = "megatron_rl_head"


@dataclass
class Trainable:
    model: list  # DDP-wrapped model chunks
    optimizer: object
    scheduler: object
    head_only: bool = False  # train only the head groups this step (see set_head_only)
    skipped_steps: int = 0  # optimizer steps skipped for a non-finite loss or gradient


def build_trainable(
    model: torch.nn.Module, config: OptimizerConfig, total_steps: int, head_pattern: str | None = None
) -> Trainable:
    """Wraps `model` in megatron DDP and builds its optimizer and scheduler.

    `head_pattern` (an fnmatch pattern on parameter names, e.g. "*value_head.*") puts the
    matching parameters in their own optimizer groups so that `Trainable.head_only` can train
    them alone."""

    transformer_config = model.config
    transformer_config.finalize_model_grads_func = finalize_model_grads
    # Losses are sums over tokens; megatron divides gradients by the global token count. DDP
    # reads this flag when it is built (it then sums instead of averaging over DP).
    transformer_config.calculate_per_token_loss = True
    ddp = DistributedDataParallel(
        transformer_config,
        DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=config.overlap_grad_reduce,
            use_distributed_optimizer=config.distributed_optimizer,
        ),
        model,
    )
    optimizer_config = megatron_optimizer_config(config, transformer_config)
    overrides = get_standard_config_overrides(optimizer_config)
    if head_pattern is not None:
        overrides[ParamKey(name=head_pattern)] = {HEAD_GROUP_KEY: True}
    optimizer = get_megatron_optimizer(optimizer_config, [ddp], config_overrides=overrides)
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


def megatron_optimizer_config(config: OptimizerConfig, transformer_config):
    """megatron's OptimizerConfig for ours (Adam; CPU offload through its hybrid device optimizer,
    with pinned host buffers on CUDA)."""

    return MegatronOptimizerConfig(
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
        optimizer_cpu_offload=config.cpu_offload,
        optimizer_offload_fraction=config.offload_fraction if config.cpu_offload else 0.0,
        pin_cpu_grads=torch.cuda.is_available(),
        pin_cpu_params=torch.cuda.is_available(),
    )


def torch_optimizers(optimizer) -> list:
    """The torch optimizers inside a megatron (possibly chained) optimizer."""
    inner = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return [o.optimizer for o in inner]


def freeze_non_head_groups(trainable: Trainable) -> None:
    """Learning rate 0 for every group but the head's, for this step only (the scheduler sets
    every group's rate again after the step). With AdamW, lr 0 leaves a parameter exactly
    unchanged, weight decay included."""
    for group in trainable.optimizer.param_groups:
        if not group.get(HEAD_GROUP_KEY, False):
            group["lr"] = 0.0


@torch.no_grad()
def restart_untouched_adam_state(trainable: Trainable, reset_moments: bool = False) -> int:
    """Adam state of non-head parameters that never received a gradient (second moment all
    zero) restarts at step 0, so their first real update gets the usual bias correction instead
    of one shaped by the frozen steps. `reset_moments` zeroes every non-head parameter's moments
    first (new weights from a snapshot: the old moments belong to other weights). Returns the
    number of parameters restarted."""
    count = 0
    for opt in torch_optimizers(trainable.optimizer):
        for group in opt.param_groups:
            if group.get(HEAD_GROUP_KEY, False):
                continue
            for param in group["params"]:
                state = opt.state.get(param)
                if not state or "exp_avg_sq" not in state:
                    continue
                if reset_moments:
                    state["exp_avg"].zero_()
                    state["exp_avg_sq"].zero_()
                if not state["exp_avg_sq"].any():
                    if torch.is_tensor(state["step"]):
                        state["step"] = torch.zeros_like(state["step"])
                    else:
                        state["step"] = 0
                    count += 1
    return count


@torch.no_grad()
def unify_adam_steps(trainable: Trainable) -> int | None:
    """Gives every parameter's Adam state the largest step count and returns it (None when the
    counts already agree). Megatron's distributed optimizer checkpoints one step count for all
    parameters (as fused Adam keeps it), so parameters restarted after head-only steps
    (`restart_untouched_adam_state`) must share it before a checkpoint; unifying in memory too
    keeps a resumed run identical to an uninterrupted one. Their first updates after this use
    the global bias correction."""
    states = [
        state
        for opt in torch_optimizers(trainable.optimizer)
        for state in opt.state.values()
        if state and "step" in state
    ]
    steps = {float(state["step"]) for state in states}
    if len(steps) <= 1:
        return None
    top = max(steps)
    for state in states:
        if torch.is_tensor(state["step"]):
            state["step"].fill_(top)
        else:
            state["step"] = type(state["step"])(top)
    return int(top)
