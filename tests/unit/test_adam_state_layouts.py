"""The critic's Adam-state restarts (after head-only steps, at snapshot loads) and the step
unification before a checkpoint, on FusedAdam's state layout: TE's and Apex's FusedAdam (the GPU
optimizer whenever the optimizer is not fully offloaded) keep `step` in each param group, not
per parameter as torch's Adam does. A stand-in with that layout, checked against torch's AdamW."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_rl.trainer.optimizer import (
    HEAD_GROUP_KEY,
    Trainable,
    restart_untouched_adam_state,
    unify_adam_steps,
)

LR, BETAS, EPS = 1e-2, (0.9, 0.999), 1e-8


class GroupStepAdamW(torch.optim.Optimizer):
    """AdamW with FusedAdam's state layout: `step` in each group (incremented for every group
    at every step; an int, or a tensor as in Apex's capturable mode), `exp_avg`/`exp_avg_sq` per
    parameter with a gradient, bias correction from the group's step."""

    def __init__(self, groups, tensor_step: bool = False):
        super().__init__(groups, dict(lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0))
        self.tensor_step = tensor_step

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            if "step" in group:
                group["step"] += 1
            else:
                group["step"] = torch.ones(()) if self.tensor_step else 1
            step = float(group["step"])
            (beta1, beta2), lr = group["betas"], group["lr"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state["exp_avg"] = torch.zeros_like(param)
                    state["exp_avg_sq"] = torch.zeros_like(param)
                state["exp_avg"].mul_(beta1).add_(param.grad, alpha=1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(param.grad, param.grad, value=1 - beta2)
                denominator = (state["exp_avg_sq"] / (1 - beta2**step)).sqrt().add_(group["eps"])
                param.addcdiv_(state["exp_avg"], denominator, value=-lr / (1 - beta1**step))


def _critic_like(tensor_step: bool, seed: int = 0):
    """A head group and two backbone groups (as megatron's standard overrides make them)."""
    generator = torch.Generator().manual_seed(seed)
    shapes = {"head": [(1, 8), (1,)], "backbone": [(8, 8), (16, 8)], "norms": [(8,), (8,)]}
    params = {
        k: [torch.nn.Parameter(torch.randn(s, generator=generator)) for s in v] for k, v in shapes.items()
    }
    groups = [{"params": params["head"], HEAD_GROUP_KEY: True}, {"params": params["backbone"]},
              {"params": params["norms"]}]  # fmt: skip
    optimizer = GroupStepAdamW(groups, tensor_step)
    trainable = Trainable(model=[], optimizer=SimpleNamespace(optimizer=optimizer), scheduler=None)
    return trainable, optimizer, params, generator


def _step(optimizer, params, generator, head_only: bool):
    """One step; in a head-only step the backbone's gradients are zeros (megatron's distributed
    optimizer hands every parameter its slice of the zeroed gradient buffer) and its lr is 0."""
    for group in optimizer.param_groups:
        group["lr"] = LR if (group.get(HEAD_GROUP_KEY) or not head_only) else 0.0
    for kind, tensors in params.items():
        for p in tensors:
            frozen = head_only and kind != "head"
            p.grad = torch.zeros_like(p) if frozen else torch.randn(p.shape, generator=generator)
    optimizer.step()


@pytest.mark.parametrize("tensor_step", [False, True])
def test_backbone_groups_restart_after_head_only_steps_and_take_a_fresh_adam_step(tensor_step):
    trainable, optimizer, params, generator = _critic_like(tensor_step)
    for _ in range(3):
        _step(optimizer, params, generator, head_only=True)
    assert [int(g["step"]) for g in optimizer.param_groups] == [3, 3, 3]
    frozen = [p.detach().clone() for p in params["backbone"]]

    # Before: KeyError 'step' (the restart read state["step"] per parameter).
    assert restart_untouched_adam_state(trainable) == 4  # the backbone and norm parameters
    assert [int(g["step"]) for g in optimizer.param_groups] == [3, 0, 0]
    assert torch.is_tensor(optimizer.param_groups[1]["step"]) == tensor_step

    # The first full step of a restarted parameter is a fresh AdamW's first step.
    _step(optimizer, params, generator, head_only=False)
    for before, param in zip(frozen, params["backbone"]):
        fresh = torch.nn.Parameter(before.clone())
        fresh.grad = param.grad.clone()
        reference = torch.optim.AdamW([fresh], lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0)
        reference.step()
        torch.testing.assert_close(param.detach(), fresh.detach(), rtol=0, atol=1e-7)

    # A checkpoint needs one step count (megatron asserts FusedAdam's groups agree): the largest.
    assert unify_adam_steps(trainable) == 4
    assert [int(g["step"]) for g in optimizer.param_groups] == [4, 4, 4]
    assert unify_adam_steps(trainable) is None


def test_snapshot_reset_zeroes_backbone_moments_and_restarts_their_groups():
    trainable, optimizer, params, generator = _critic_like(tensor_step=False)
    for _ in range(2):
        _step(optimizer, params, generator, head_only=False)
    head_state = {k: v.clone() for k, v in optimizer.state[params["head"][0]].items()}
    assert restart_untouched_adam_state(trainable) == 0  # every parameter had gradients
    assert restart_untouched_adam_state(trainable, reset_moments=True) == 4
    assert [int(g["step"]) for g in optimizer.param_groups] == [2, 0, 0]
    for p in params["backbone"] + params["norms"]:
        assert not optimizer.state[p]["exp_avg"].any() and not optimizer.state[p]["exp_avg_sq"].any()
    for key, value in optimizer.state[params["head"][0]].items():  # the head keeps its state
        assert torch.equal(value, head_state[key])


def test_a_group_where_some_parameters_trained_keeps_its_step_count():
    trainable, optimizer, params, generator = _critic_like(tensor_step=False)
    _step(optimizer, params, generator, head_only=False)
    optimizer.state[params["norms"][0]]["exp_avg_sq"].zero_()  # one norm never had a gradient
    assert restart_untouched_adam_state(trainable) == 0
    assert [int(g["step"]) for g in optimizer.param_groups] == [1, 1, 1]


def test_torch_adam_layout_restarts_per_parameter():
    """torch's AdamW (the CPU optimizer, and the host side of the hybrid optimizer): `step` per
    parameter, restarted for the parameters that never had a gradient only."""
    generator = torch.Generator().manual_seed(1)
    head, trained, untouched = (torch.nn.Parameter(torch.randn(4, generator=generator)) for _ in range(3))
    optimizer = torch.optim.AdamW(
        [{"params": [head], HEAD_GROUP_KEY: True}, {"params": [trained, untouched]}], lr=LR
    )
    trainable = Trainable(model=[], optimizer=SimpleNamespace(optimizer=optimizer), scheduler=None)
    for _ in range(2):
        for p in (head, trained):
            p.grad = torch.randn(4, generator=generator)
        untouched.grad = torch.zeros(4)
        optimizer.step()
    assert restart_untouched_adam_state(trainable) == 1
    assert [int(optimizer.state[p]["step"]) for p in (head, trained, untouched)] == [2, 2, 0]
    assert unify_adam_steps(trainable) == 2
    assert [int(optimizer.state[p]["step"]) for p in (head, trained, untouched)] == [2, 2, 2]
