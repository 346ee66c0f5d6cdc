"""A stand-in for TransformerEngine's FusedAdam (the device sub-optimizer of megatron's hybrid
device optimizer on a TE machine) that runs on CPU, with its state semantics as in
transformer_engine/pytorch/optimizers/fused_adam.py (TE 2.x, not capturable, no master weights):
`step` is kept in each param group, an int incremented once per `step()` for every non-empty
group; at a group's step every parameter without state gets zero `exp_avg` / `exp_avg_sq` (fp32)
whether or not it has a gradient; parameters without a gradient are then skipped; AdamW (decoupled
weight decay) with bias correction from the group's step."""

from __future__ import annotations

import torch


class FusedAdamStandIn(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0.0, **unused):  # fmt: skip
        # megatron's hybrid optimizer builds it from param groups alone; its groups carry the
        # hybrid's other settings (cpu_optimizer_cls, fused, ...), which FusedAdam ignores too
        super().__init__(params, dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                                      weight_decay=weight_decay))  # fmt: skip

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            if not group["params"]:
                continue
            group["step"] = group["step"] + 1 if "step" in group else 1
            step, (beta1, beta2) = group["step"], group["betas"]
            correction1 = 1 - beta1**step if group["bias_correction"] else 1.0
            correction2 = 1 - beta2**step if group["bias_correction"] else 1.0
            for param in group["params"]:
                state = self.state[param]
                if len(state) == 0:
                    state["exp_avg"] = torch.zeros_like(param, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(param, dtype=torch.float32)
                if param.grad is None:
                    continue
                grad = param.grad
                state["exp_avg"].mul_(beta1).add_(grad, alpha=1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                denominator = (state["exp_avg_sq"] / correction2).sqrt_().add_(group["eps"])
                param.mul_(1 - group["lr"] * group["weight_decay"])
                param.addcdiv_(state["exp_avg"], denominator, value=-group["lr"] / correction1)
        return None
