"""Resuming megatron's hybrid device optimizer (optimizer.cpu_offload), second GPU reading,
issue 36: the state a load fills is made without megatron's `dummy_step` gradient copy of every
parameter (defect 1, the resume part), and after a load each sub-optimizer keeps counting its own
Adam step (defect 8: FusedAdam's step stuck at the checkpoint's). The hybrid optimizer's host
copies are emulated on CPU (tests/support/host_offload.py) so that an offload fraction of 0.5
splits the parameters between a "device" and a host sub-optimizer; TE's FusedAdam, the device
sub-optimizer on a TE machine, is played by tests/support/fused_adam.py."""

from __future__ import annotations

import pytest
import torch
from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

from megatron_rl.trainer.optimizer import patch_hybrid_optimizer
from tests.support import host_offload
from tests.support.fused_adam import FusedAdamStandIn
from tests.support.memory import AllocationTracker

SETTINGS = dict(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, bias_correction=True, fused=True)


def _parameters(seed: int, sizes: list[int]) -> list[torch.nn.Parameter]:
    """16-bit weight shards and fp32 norm-like shards, as the distributed optimizer hands them."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for i, size in enumerate(sizes):
        dtype = torch.float32 if i % 3 == 2 else torch.bfloat16
        out.append(torch.nn.Parameter(torch.randn(size, generator=generator).to(dtype), requires_grad=False))
    return out


def _hybrid(params, gpu_optimizer_cls, fraction=0.5) -> HybridDeviceOptimizer:
    host_offload.install()
    groups = [{"params": params[: len(params) // 2], "wd_mult": 1.0},
              {"params": params[len(params) // 2 :], "wd_mult": 0.0}]  # fmt: skip
    return HybridDeviceOptimizer(
        groups, offload_fraction=fraction, cpu_optimizer_cls=torch.optim.AdamW,
        gpu_optimizer_cls=gpu_optimizer_cls, param_update_in_fp32=True, pin_cpu_grads=False,
        pin_cpu_params=False, overlap_cpu_optimizer_d2h_h2d=False, **SETTINGS,
    )  # fmt: skip


def _layout(hybrid: HybridDeviceOptimizer) -> list:
    """Per sub-optimizer: its class, its groups' step, and per stepped parameter (host copy or
    not) every state entry's (shape, dtype, device, placement beside the parameter)."""

    def entry(value, param):
        if not torch.is_tensor(value):
            return type(value).__name__, value
        beside = value.dim() == 0 or value.device == param.device
        return tuple(value.shape), value.dtype, value.device.type, beside, value.dim() == 0 and float(value)

    return [
        (
            type(opt).__name__,
            [group.get("step") for group in opt.param_groups],
            [
                (
                    host_offload.is_host_copy(p),
                    p.dtype,
                    sorted((k, entry(v, p)) for k, v in opt.state[p].items()),
                )
                for group in opt.param_groups
                for p in group["params"]
            ],
        )  # fmt: skip
        for opt in hybrid.sub_optimizers
    ]


@pytest.mark.parametrize("gpu_optimizer_cls", [torch.optim.AdamW, FusedAdamStandIn])
@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_state_made_without_every_gradient_has_megatron_dummy_step_layout(gpu_optimizer_cls, fraction):
    sizes = [48, 7, 16, 130, 5, 9, 64]
    megatrons = _hybrid(_parameters(0, sizes), gpu_optimizer_cls, fraction)
    HybridDeviceOptimizer.dummy_step(megatrons)  # megatron's, on an unpatched hybrid optimizer
    params = _parameters(0, sizes)
    ours = _hybrid(params, gpu_optimizer_cls, fraction)
    patch_hybrid_optimizer(ours)
    before = [p.detach().clone() for p in params]
    ours.dummy_step()
    assert _layout(ours) == _layout(megatrons)
    assert len(ours.sub_optimizers) == len(megatrons.sub_optimizers) >= (2 if fraction < 1 else 1)
    # the hybrid optimizer's own view: every parameter's state, its `master_param` the tensor its
    # sub-optimizer steps, in both
    for hybrid in (ours, megatrons):
        assert [id(p) for p in hybrid.state] == [id(p) for g in hybrid.param_groups for p in g["params"]]
        assert all(s["master_param"] is hybrid.param_to_inner_param[p] for p, s in hybrid.state.items())
    assert [sorted(s) for s in ours.state.values()] == [sorted(s) for s in megatrons.state.values()]
    # nothing moved, no gradient left behind
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))
    assert all(p.grad is None for opt in ours.sub_optimizers for g in opt.param_groups for p in g["params"])


def test_megatron_dummy_step_behind_our_step_hook_leaves_device_fp32_parameters_without_state():
    """Why megatron's dummy step is replaced, besides memory: without TE the device sub-optimizer
    is torch's AdamW, which makes state only for parameters with a gradient, and our step pre-hook
    hands the device share's fp32 parameters their `decoupled_grad` (None in a dummy step): megatron's
    left them without state, and a load then found no `master_param` for them."""
    params = _parameters(0, [48, 7, 16, 130, 5, 9, 64])
    hybrid = _hybrid(params, torch.optim.AdamW)
    patch_hybrid_optimizer(hybrid)
    HybridDeviceOptimizer.dummy_step(hybrid)
    device_fp32 = [p for p in params if p.dtype == torch.float32 and p not in hybrid.gpu_params_map_cpu_copy]
    assert device_fp32 and all("master_param" not in hybrid.state.get(p, {}) for p in device_fp32)
    hybrid = _hybrid(_parameters(0, [48, 7, 16, 130, 5, 9, 64]), torch.optim.AdamW)
    patch_hybrid_optimizer(hybrid)
    hybrid.dummy_step()
    assert len(hybrid.state) == len(params) and all("master_param" in s for s in hybrid.state.values())


class _FreedAllocations(AllocationTracker):
    """An AllocationTracker that also logs every allocation and free, so that the peak of the
    storages that do not survive the block (the transient ones, not the state made) is known."""

    def __init__(self):
        super().__init__()
        self.log: list[tuple[int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        known = set(self.live)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self.log += [(key, self.live[key]) for key in self.live.keys() - known]
        return out

    def _free(self, key: int) -> None:
        self.log.append((key, -self.live.get(key, 0)))
        super()._free(key)

    def transient_peak(self) -> int:
        kept, current, peak = set(self.live), 0, 0
        for key, change in self.log:
            if key not in kept:
                current += change
                peak = max(peak, current)
        return peak


@pytest.mark.parametrize("sizes", [[96, 7, 130, 64, 120, 9, 100], [1000, 3, 999, 17, 250, 640, 2, 11, 700]])
def test_resume_state_init_allocates_at_most_one_parameter_beyond_the_state(sizes):
    """Measured: bytes of the storages the init's ops create and free again, at their peak. megatron's
    dummy step holds a gradient of every parameter at once (and fp32 copies of the 16-bit ones);
    ours one zero buffer the size of the largest stepped (fp32) parameter. (torch's fused AdamW, as
    TE's FusedAdam, steps without temporaries; a sub-optimizer that makes some in its step adds them
    to either init, one parameter at a time.)"""
    peaks = {}
    for name in ("megatron", "ours"):
        hybrid = _hybrid(_parameters(1, sizes), torch.optim.AdamW)  # megatron's classes without TE
        if name == "ours":
            patch_hybrid_optimizer(hybrid)
        with _FreedAllocations() as tracker:
            hybrid.dummy_step()
        peaks[name] = tracker.transient_peak(), tracker.current
    stepped = [p for opt in hybrid.sub_optimizers for g in opt.param_groups for p in g["params"]]
    largest = max(p.numel() * p.element_size() for p in stepped)
    every_gradient = sum(p.numel() * p.element_size() for p in _parameters(1, sizes))
    assert 0 < peaks["ours"][0] <= largest
    assert peaks["megatron"][0] >= every_gradient > 2 * largest
    print(f"\nsizes {sizes}: transient peak megatron {peaks['megatron'][0]} B, ours {peaks['ours'][0]} B "
          f"(largest stepped parameter {largest} B, every gradient {every_gradient} B)")  # fmt: skip


def _train(hybrid: HybridDeviceOptimizer, params, steps) -> None:
    """Steps with gradients drawn per step (megatron's precision-aware path: `decoupled_grad`)."""
    for step in steps:
        generator = torch.Generator().manual_seed(1000 + step)
        for param in params:
            param.decoupled_grad = torch.randn(param.shape, generator=generator).to(param.dtype)
        hybrid.step()
        hybrid.zero_grad()


def _save_and_load_as_megatron_on_te(saved: HybridDeviceOptimizer, fresh: HybridDeviceOptimizer) -> int:
    """What megatron's DistributedOptimizer does to the hybrid optimizer on a TE machine
    (distrib_optimizer.py, state_dict / load_state_dict): the save takes `step` from the torch-Adam
    (host) sub-optimizer into every param group as an int; the load makes the state (dummy step),
    gives every state a `step` tensor and loads. Returns the step."""
    state_dict = saved.state_dict()
    host = next(o for o in saved.sub_optimizers if isinstance(o, torch.optim.AdamW) and o.state)
    step = int(next(iter(host.state.values()))["step"].item())
    for group in state_dict["param_groups"]:
        group["step"] = step
    fresh.dummy_step()
    for state in fresh.state.values():
        state["step"] = torch.tensor(float(step))
    fresh.load_state_dict(state_dict)
    return step


def _group_steps(hybrid: HybridDeviceOptimizer) -> list:
    return [
        g["step"] for o in hybrid.sub_optimizers if isinstance(o, FusedAdamStandIn) for g in o.param_groups
    ]


@pytest.mark.parametrize("megatron_step_handling", [True, False])
def test_after_a_resume_fused_adam_keeps_counting_its_own_step(megatron_step_handling):
    """Defect 8: the loaded `step` in the hybrid optimizer's groups was copied into FusedAdam's
    groups before every step, so after a resume at step 2 its bias correction stayed at step 3.
    Two steps, save, load into a fresh optimizer, two steps must equal four uninterrupted ones."""
    from megatron_rl.trainer.optimizer import Trainable, _state_beside_its_parameters, set_adam_steps

    sizes = [48, 7, 16, 130, 5, 9, 64]

    def build(params):
        hybrid = _hybrid(params, FusedAdamStandIn)
        patch_hybrid_optimizer(hybrid)
        if megatron_step_handling:  # our other fixes, megatron's step handling
            hybrid._move_new_state_to_right_device = lambda: _state_beside_its_parameters(hybrid)
        return hybrid

    uninterrupted_params = _parameters(2, sizes)
    uninterrupted = build(uninterrupted_params)
    _train(uninterrupted, uninterrupted_params, range(4))
    first = build(_parameters(2, sizes))
    _train(first, [p for g in first.param_groups for p in g["params"]], range(2))
    resumed_params = _parameters(2, sizes)
    resumed = build(resumed_params)
    assert _save_and_load_as_megatron_on_te(first, resumed) == 2
    _train(resumed, resumed_params, range(2, 4))
    same = [torch.equal(a, b) for a, b in zip(resumed_params, uninterrupted_params, strict=True)]
    assert set(_group_steps(uninterrupted)) == {4}
    if megatron_step_handling:  # the defect, reproduced: the device half's step stuck at 2 + 1
        assert set(_group_steps(resumed)) == {3}
        device_half = [p not in resumed.gpu_params_map_cpu_copy for p in resumed_params]
        assert not all(same) and all(s for s, device in zip(same, device_half) if not device)
        return
    assert set(_group_steps(resumed)) == {4} and all(same)
    assert all(torch.equal(resumed.state[a]["exp_avg"], uninterrupted.state[b]["exp_avg"])
               for a, b in zip(resumed_params, uninterrupted_params))  # fmt: skip
    # set_adam_steps (what a checkpoint load ends with) now sticks
    set_adam_steps(Trainable(model=[], optimizer=type("M", (), {"optimizer": resumed})(), scheduler=None), 7)
    _train(resumed, resumed_params, range(4, 6))
    assert set(_group_steps(resumed)) == {9}
