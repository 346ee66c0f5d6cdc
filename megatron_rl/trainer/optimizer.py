"""megatron DDP + (distributed) optimizer + LR/WD scheduler from our OptimizerConfig.

Megatron facts this encodes: per-group weight-decay multipliers (no decay on norms and biases)
only take effect through `get_standard_config_overrides` plus OptimizerParamScheduler, and
`finalize_model_grads` must be the config's finalize function (q/k-norm and sequence-parallel
norm gradients are summed over TP there; with calculate_per_token_loss it also divides every
gradient by the global token count).

CPU offload (`optimizer.cpu_offload`) is megatron's hybrid device optimizer on the
precision-aware path, as Megatron-LM's own argument check requires: without it the distributed
optimizer makes an fp32 master shard of every 16-bit parameter on the GPU and the hybrid
optimizer only copies it to the host, so the masters stay on the GPU (4 bytes per sharded
parameter). On the precision-aware path the hybrid optimizer's fp32 copies are the masters, on
the host for the offloaded fraction. Adam state comes in two layouts: torch's Adam keeps `step`
per parameter, TE's and Apex's FusedAdam per parameter group (`adam_optimizers`,
`restart_untouched_adam_state` and `unify_adam_steps` handle both). `patch_hybrid_optimizer` lists
what we change in megatron's hybrid optimizer (resume state without a gradient copy of every
parameter; a load that keeps its sub-optimizers, their state placement and step counts).
"""

from __future__ import annotations

import contextlib
import os
import types
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
from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer import TransformerConfig

from megatron_rl.config import OptimizerConfig, ResolvedConfig
from megatron_rl.trainer.gradient_check import GradientHooks

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
    optimizer_step_s: float = 0.0  # seconds in optimizer.step() since the role last reported them
    gradients: GradientHooks | None = None  # which trainable parameters got a gradient this step
    # What takes part in every training pass (trainer/forward.py `passes`): a model transform's
    # pass hook, such as routing replay's.
    hooks: tuple = ()


def training_ranks_per_node(resolved: ResolvedConfig, role: str) -> int:
    """The training ranks (policy and critic) that share a node with a rank of `role`: a shared
    critic's GPUs sit on the policy's nodes, a dedicated critic has nodes of its own."""
    deployment, style = resolved.deployment, resolved.layout.deployment_style
    if role == "critic" and style == "dedicated":
        return min(resolved.layout.value_gpus, deployment.gpus_per_node)
    shared = deployment.num_value_gpus_per_train_node if style == "shared" else 0
    return min(deployment.policy_gpus, deployment.gpus_per_node - shared) + shared


def offload_threads(resolved: ResolvedConfig, role: str, config: OptimizerConfig,
                    cores: int | None = None) -> int | None:  # fmt: skip
    """Threads for this rank's offloaded optimizer step, or None (no host step: no offload, or
    the CPU device, where every process keeps one thread). `config.cpu_threads` when set, else
    `cores` (this process's CPU affinity) divided among the node's training ranks."""
    if not config.cpu_offload or resolved.deployment.device != "cuda":
        return None
    if config.cpu_threads is not None:
        return config.cpu_threads
    cores = cores if cores is not None else len(os.sched_getaffinity(0))
    return max(1, cores // training_ranks_per_node(resolved, role))


def build_trainable(
    model: torch.nn.Module, config: OptimizerConfig, total_steps: int, head_pattern: str | None = None,
    hooks: tuple = (),
) -> Trainable:
    """Wraps `model` in megatron DDP and builds its optimizer and scheduler.

    `head_pattern` (an fnmatch pattern on parameter names, e.g. "*value_head.*") puts the
    matching parameters in their own optimizer groups so that `Trainable.head_only` can train
    them alone. `hooks` take part in every training pass (`Trainable.hooks`)."""

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
    # The distributed optimizer hands the hybrid optimizer views of the fp32 parameters (norms,
    # the value head); built with autograd on they are non-leaf tensors, which torch's optimizer
    # refuses ("can't optimize a non-leaf Tensor"). Without autograd they are plain views.
    with torch.no_grad() if config.cpu_offload else contextlib.nullcontext():
        optimizer = get_megatron_optimizer(optimizer_config, [ddp], config_overrides=overrides)
    for hybrid in hybrid_optimizers(optimizer):
        patch_hybrid_optimizer(hybrid)
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
    return Trainable([ddp], optimizer, scheduler, gradients=GradientHooks([ddp]), hooks=tuple(hooks))


def megatron_optimizer_config(
    config: OptimizerConfig, transformer_config: TransformerConfig
) -> MegatronOptimizerConfig:
    """megatron's OptimizerConfig for ours (Adam; CPU offload through its hybrid device optimizer
    on the precision-aware path, with pinned host buffers on CUDA)."""

    if config.cpu_offload and not config.distributed_optimizer:
        raise ValueError("optimizer.cpu_offload: needs optimizer.distributed_optimizer: true")
    megatron = MegatronOptimizerConfig(
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
    if config.cpu_offload:
        _use_precision_aware_path(megatron)
    return megatron


def _use_precision_aware_path(megatron) -> None:
    """Turns on megatron's precision-aware optimizer for CPU offload: the hybrid optimizer then
    steps the 16-bit parameter shards through its own fp32 copies (the masters, on the host for the
    offloaded fraction) and no fp32 master is made on the GPU. Set after construction because
    megatron 0.16.1's `OptimizerConfig.__post_init__` compares TE's version with None when TE is
    absent (a TypeError) before it returns early for CPU offload; what it checks and derives on
    that path is done here. Masters, moments and gradients stay fp32."""
    assert megatron.optimizer == "adam" and megatron.use_distributed_optimizer
    megatron.use_precision_aware_optimizer = True
    megatron.main_grads_dtype = torch.float32
    megatron.main_params_dtype = torch.float32
    megatron.exp_avg_dtype = torch.float32
    megatron.exp_avg_sq_dtype = torch.float32
    # Read only by TE's FusedAdam with master weights, which the hybrid optimizer does not use.
    megatron.store_param_remainders = False
    # What __post_init__ derives: precision-aware, and gradients in `.decoupled_grad`.
    megatron.use_precision_aware_optimizer_no_fp8_or_ds_fp8 = True


def torch_optimizers(optimizer) -> list:
    """The torch optimizers inside a megatron (possibly chained) optimizer."""
    inner = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return [o.optimizer for o in inner]


def hybrid_optimizers(optimizer) -> list[HybridDeviceOptimizer]:
    """The hybrid device optimizers (CPU offload) inside a megatron optimizer."""
    return [o for o in torch_optimizers(optimizer) if isinstance(o, HybridDeviceOptimizer)]


def adam_optimizers(optimizer) -> list:
    """The torch optimizers that hold the Adam state: those inside a megatron optimizer, and for
    a hybrid device optimizer its host and device sub-optimizers (their state dicts are the ones
    the hybrid optimizer's `state` shows, but only their own param groups carry FusedAdam's
    per-group `step`)."""
    out = []
    for opt in torch_optimizers(optimizer):
        out += list(opt.sub_optimizers) if isinstance(opt, HybridDeviceOptimizer) else [opt]
    return out


def patch_hybrid_optimizer(hybrid: HybridDeviceOptimizer) -> None:
    """Installs our fixes of megatron's hybrid device optimizer on `hybrid` (once, where it is
    built): the device share's fp32 parameters get their gradient; a load keeps the sub-optimizers,
    refreshes every stepped copy, places the state beside its parameters and leaves each
    sub-optimizer its own step count; the state a load fills is made without a gradient for every
    parameter (second GPU reading, defects 1 (resume), 4 and 8)."""
    hybrid.register_step_pre_hook(_give_device_fp32_params_their_gradient)
    hybrid._update_fp32_params_by_new_state = types.MethodType(_stepped_copies_from_state, hybrid)
    hybrid._move_new_state_to_right_device = types.MethodType(_settle_loaded_state, hybrid)
    hybrid.dummy_step = types.MethodType(initialise_state_with_one_gradient_buffer, hybrid)
    hybrid._init_sub_optimizers = types.MethodType(_keep_sub_optimizers, hybrid)


def _keep_sub_optimizers(hybrid: HybridDeviceOptimizer) -> None:
    """Replaces HybridDeviceOptimizer._init_sub_optimizers once the hybrid optimizer is built;
    megatron's load hook calls it to rebuild the sub-optimizers over new copies "as the parameters
    may change", which a load into our optimizer never does (torch's load keeps the parameters). The
    rebuild failed at an offload fraction below 1: the device share's fp32 parameters are views made
    without autograd, and once stepped in place torch refuses to ask a new optimizer whether they
    are leaves ("A view was created in no_grad mode ..."), so no resume at fraction 0.5 loaded.
    Kept, the sub-optimizers, their copies and hooks stay; the load hook then refreshes their groups
    and state as before."""
    built_for = list(hybrid.param_to_inner_param)
    current = [param for group in hybrid.param_groups for param in group["params"]]
    if len(current) != len(built_for) or any(a is not b for a, b in zip(current, built_for)):
        raise RuntimeError(
            f"hybrid device optimizer: its parameters changed after it was built ({len(built_for)} then, "
            f"{len(current)} now, or other tensors); its sub-optimizers step copies of the old ones"
        )


@torch.no_grad()
def initialise_state_with_one_gradient_buffer(hybrid: HybridDeviceOptimizer) -> None:
    """Replaces HybridDeviceOptimizer.dummy_step, which makes the state a checkpoint load fills in
    place (megatron's distributed optimizer calls it when the state is empty). megatron's sets a
    `randn_like` gradient on every parameter at once and steps: a second copy of every shard, +28.4
    GiB on a 30B rank's GPU (second GPU reading, defect 1). Here every parameter a sub-optimizer
    steps gets a zero gradient that is a view of one buffer per (device, dtype), as large as the
    largest such parameter, and each sub-optimizer steps once at learning rate and weight decay 0:
    the sub-optimizers' own code makes their state (keys, shapes, dtypes, devices, `step` 1, as
    megatron's would), the parameters keep their values, and the extra memory is one parameter's
    worth per device. Unlike megatron's without TE, the device share's fp32 parameters get state too
    (our step pre-hook gave them no gradient in megatron's dummy step, torch's AdamW then made no
    state for them, and the load failed with a KeyError)."""
    stepped = [p for opt in hybrid.sub_optimizers for group in opt.param_groups for p in group["params"]]
    largest: dict[tuple, int] = {}
    for param in stepped:
        key = (param.device, param.dtype)
        largest[key] = max(largest.get(key, 0), param.numel())
    zeros = {key: torch.zeros(numel, dtype=key[1], device=key[0]) for key, numel in largest.items()}
    hybrid._sync_hdo_param_groups_to_sub_optimizers()  # as its step() does first
    settings = []
    for optimizer in hybrid.sub_optimizers:
        for group in optimizer.param_groups:
            settings.append((group, group["lr"], group.get("weight_decay")))
            group["lr"] = 0.0
            if "weight_decay" in group:
                group["weight_decay"] = 0.0
    for param in stepped:
        param.grad = zeros[(param.device, param.dtype)][: param.numel()].view_as(param)
    try:
        for optimizer in hybrid.sub_optimizers:
            optimizer.step()
    finally:
        for param in stepped:
            param.grad = None
        for group, lr, weight_decay in settings:
            group["lr"] = lr
            if weight_decay is not None:
                group["weight_decay"] = weight_decay
    hybrid._sync_sub_optimizers_state_to_hdo()


def _give_device_fp32_params_their_gradient(hybrid: HybridDeviceOptimizer, args, kwargs) -> None:
    """Step pre-hook of a hybrid device optimizer: on the precision-aware path megatron puts every
    gradient in `.decoupled_grad`; the hybrid optimizer reads it for the parameters it offloads and
    for its fp32 copies of 16-bit ones, but its device sub-optimizer reads `.grad`, so fp32
    parameters left on the device (offload_fraction < 1) would never be updated."""
    device_optimizer = hybrid.gpu_optimizer
    if device_optimizer is None:
        return
    for group in device_optimizer.param_groups:
        for param in group["params"]:
            if param not in hybrid.fp32_param_to_orig_param:  # an original fp32 parameter
                param.grad = getattr(param, "decoupled_grad", None)


@torch.no_grad()
def _stepped_copies_from_state(hybrid: HybridDeviceOptimizer) -> None:
    """Replaces HybridDeviceOptimizer._update_fp32_params_by_new_state (run when its state is
    loaded): the tensors its sub-optimizers step (fp32 copies of 16-bit parameters, host copies
    of offloaded fp32 parameters, fp32 parameters themselves) take the loaded `master_param`.
    megatron's version looks every parameter up among the fp32 copies of 16-bit ones, a KeyError
    for the first fp32 parameter (norms, the value head), so no checkpoint with offload loads.
    `master_param` then names the stepped tensor again, as after a step."""
    for param, state in hybrid.state.items():
        stepped, master = hybrid.param_to_inner_param.get(param, param), state.get("master_param")
        if master is not None and master is not stepped:
            stepped.data.copy_(master)
            # what the next step's state sync would do: the loaded copy is freed now, not then
            state["master_param"] = stepped


@torch.no_grad()
def _state_beside_its_parameters(hybrid: HybridDeviceOptimizer) -> None:
    """Replaces HybridDeviceOptimizer._move_new_state_to_right_device (run when its state is
    loaded): each state tensor of a parameter's size goes to the device of the parameter its
    sub-optimizer steps; scalars (torch Adam's `step`) stay where the load put them. megatron's
    version decides by `isinstance(sub_optimizer, cpu_optimizer_cls)`: without TE or Apex the
    device and host sub-optimizers are both torch's Adam, so at an offload fraction below 1 the
    device half's moments went to the host and its next CUDA step met host tensors (second GPU
    reading, defect 4)."""
    for optimizer in hybrid.sub_optimizers:
        for param, state in optimizer.state.items():
            original = hybrid.inner_param_to_orig_param.get(param, param)
            for key, value in state.items():
                if torch.is_tensor(value) and value.dim() > 0:
                    hybrid.state[original][key] = state[key] = value.to(param.device)


def _keeps_step_per_parameter(optimizer) -> bool:
    """torch's Adam and AdamW keep `step` in each parameter's state; TE's and Apex's FusedAdam in
    each param group (megatron's DistributedOptimizer.state_dict tells them apart the same way)."""
    return isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW))


@torch.no_grad()
def _own_step_counts(hybrid: HybridDeviceOptimizer) -> None:
    """After a load, each sub-optimizer keeps its step count where it counts it. megatron's load
    puts the checkpoint's `step` in the hybrid optimizer's param groups (which the sub-optimizers'
    groups copied when the load rebuilt them) and a `step` tensor in every parameter's state. Left
    there, `_sync_hdo_param_groups_to_sub_optimizers` copied the loaded `step` into FusedAdam's
    groups before every step, so its bias correction stayed at the checkpoint's step + 1 and
    `set_adam_steps` / `restart_untouched_adam_state` were undone (second GPU reading, defect 8);
    and the per-parameter `step` made FusedAdam's groups look like torch Adam's to them."""
    for group in hybrid.param_groups:
        group.pop("step", None)
    for optimizer in hybrid.sub_optimizers:
        if not _keeps_step_per_parameter(optimizer):
            for state in optimizer.state.values():
                state.pop("step", None)


def _settle_loaded_state(hybrid: HybridDeviceOptimizer) -> None:
    """Replaces HybridDeviceOptimizer._move_new_state_to_right_device, the last thing its
    `_sync_hdo_state_to_sub_optimizers` does after a load: the state beside its parameters, and
    the step counts where their sub-optimizers keep them."""
    _state_beside_its_parameters(hybrid)
    _own_step_counts(hybrid)


@torch.no_grad()
def reload_main_params(trainable: Trainable) -> None:
    """After the model's weights were replaced in place (a policy snapshot loaded into the
    critic): the weights the optimizer steps from take the new values too. megatron's
    `reload_model_params` does this for the distributed optimizer's fp32 masters; under the
    hybrid device optimizer it refreshes only its fp32 copies of 16-bit parameters, so the host
    copies of fp32 parameters (norms, the value head; every parameter of an fp32 model) would keep
    the old weights and the next step would copy them back."""
    trainable.optimizer.reload_model_params()
    for hybrid in hybrid_optimizers(trainable.optimizer):
        for param, host_copy in hybrid.gpu_params_map_cpu_copy.items():
            if param not in hybrid.param_to_fp32_param:
                host_copy.copy_(param)


def freeze_non_head_groups(trainable: Trainable) -> None:
    """Learning rate 0 for every group but the head's, for this step only (the scheduler sets
    every group's rate again after the step). With AdamW, lr 0 leaves a parameter exactly
    unchanged, weight decay included."""
    for group in trainable.optimizer.param_groups:
        if not group.get(HEAD_GROUP_KEY, False):
            group["lr"] = 0.0


def _zero_step(step):
    return torch.zeros_like(step) if torch.is_tensor(step) else type(step)(0)


def _steps_per_group(opt, group: dict) -> bool:
    """Whether `group` keeps its Adam step count itself (TE's/Apex's FusedAdam: an int or tensor
    in the group, none in the parameters' state) rather than per parameter (torch's Adam)."""
    return "step" in group and not any("step" in (opt.state.get(p) or {}) for p in group["params"])


@torch.no_grad()
def restart_untouched_adam_state(trainable: Trainable, reset_moments: bool = False) -> int:
    """Adam state of non-head parameters that never received a gradient (second moment all
    zero) restarts at step 0, so their first real update gets the usual bias correction instead
    of one shaped by the frozen steps. `reset_moments` zeroes every non-head parameter's moments
    first (new weights from a snapshot: the old moments belong to other weights). Where the step
    count is kept per group (FusedAdam), a group restarts when none of its parameters ever
    received a gradient (after head-only steps or `reset_moments`, every non-head group); a group
    where some did keeps its count. Returns the number of parameters restarted."""
    count = 0
    for opt in adam_optimizers(trainable.optimizer):
        for group in opt.param_groups:
            if group.get(HEAD_GROUP_KEY, False):
                continue
            states = [opt.state.get(p) for p in group["params"]]
            states = [state for state in states if state and "exp_avg_sq" in state]
            if reset_moments:
                for state in states:
                    state["exp_avg"].zero_()
                    state["exp_avg_sq"].zero_()
            untouched = [state for state in states if not state["exp_avg_sq"].any()]
            if _steps_per_group(opt, group):
                if states and len(untouched) == len(states):
                    group["step"] = _zero_step(group["step"])
                    count += len(states)
                continue
            for state in untouched:
                if "step" in state:
                    state["step"] = _zero_step(state["step"])
                    count += 1
    return count


def _step_holders(trainable: Trainable) -> list[dict]:
    """Every dict that holds an Adam step count: per-parameter states (torch's Adam) and, where
    FusedAdam keeps it there, param groups."""
    holders = []
    for opt in adam_optimizers(trainable.optimizer):
        for group in opt.param_groups:
            if _steps_per_group(opt, group):
                holders.append(group)
                continue
            holders += [opt.state[p] for p in group["params"] if "step" in (opt.state.get(p) or {})]
    return holders


def _set_step(holder: dict, step: float) -> None:
    if torch.is_tensor(holder["step"]):
        holder["step"].fill_(step)
    else:
        holder["step"] = type(holder["step"])(step)


@torch.no_grad()
def unify_adam_steps(trainable: Trainable) -> int | None:
    """Gives every parameter's (or, with FusedAdam, every group's) Adam state the largest step
    count and returns it (None when the counts already agree). Megatron's distributed optimizer
    checkpoints one step count for all parameters (it asserts that FusedAdam's groups agree), so
    parameters restarted after head-only steps (`restart_untouched_adam_state`) must share it
    before a checkpoint; unifying in memory too keeps a resumed run identical to an uninterrupted
    one. Their first updates after this use the global bias correction."""
    holders = _step_holders(trainable)
    steps = {float(holder["step"]) for holder in holders}
    if len(steps) <= 1:
        return None
    top = max(steps)
    for holder in holders:
        _set_step(holder, top)
    return int(top)


def adam_step(trainable: Trainable) -> int | None:
    """The (largest) Adam step count of the optimizer; None before its first step."""
    steps = [float(holder["step"]) for holder in _step_holders(trainable)]
    return int(max(steps)) if steps else None


@torch.no_grad()
def set_adam_steps(trainable: Trainable, step: int) -> None:
    """Every Adam step count to `step` (after a checkpoint load: see trainer/checkpoint.py)."""
    for holder in _step_holders(trainable):
        _set_step(holder, step)
