"""Every trainable parameter gets a gradient in a training step, or the step is an error.

A step in which some parameter that trains got no gradient at all is a silent no-op for it: the
optimizer steps it with a zero gradient (Adam's moments decay, nothing learns). It happens when
part of the graph is cut: activation recomputation whose checkpointed unit had no input that
required grad (a frozen embedding in front of LoRA adapters), a forward run under no_grad, a
detached tensor. Megatron's DDP clears `param.grad` in its own hook, so the gradients cannot be
looked at after the backward; instead each parameter DDP holds gets a post-accumulate-grad hook
that records that it fired. An expert that got no tokens still fires (SequentialMLP runs every
expert, TE's grouped linear takes every expert's weight: a zero gradient), which is fine.
"""

from __future__ import annotations

import torch

from megatron_rl.parallel import any_rank


class MissingGradients(RuntimeError):
    """Parameters that train got no gradient in a step's backward."""


class GradientHooks:
    """Records which of the DDP-held parameters of `chunks` got a gradient since `reset()`."""

    def __init__(self, chunks: list[torch.nn.Module]):
        self._names: dict[int, str] = {}
        self._fired: set[int] = set()
        self._params: list[torch.nn.Parameter] = []
        for chunk in chunks:
            held = {id(p) for buffer in _grad_buffers(chunk) for p in buffer.params}
            for name, param in chunk.named_parameters():
                if id(param) in held and id(param) not in self._names:
                    self._names[id(param)] = name.removeprefix("module.")
                    self._params.append(param)
                    param.register_post_accumulate_grad_hook(self._record)

    def _record(self, param: torch.Tensor) -> None:
        self._fired.add(id(param))

    def reset(self) -> None:
        self._fired.clear()

    def missing(self) -> list[str]:
        """Names of the parameters that require grad now (a head-only step freezes the others)
        and got none since `reset()`, in the model's order."""
        return [self._names[id(p)] for p in self._params if p.requires_grad and id(p) not in self._fired]

    def check(self, role: str = "training") -> None:
        """Collective over the role's ranks: raises `MissingGradients` on every rank when a
        parameter that trains got no gradient on any rank (naming this rank's, up to 5)."""
        missing = self.missing()
        if any_rank(bool(missing)):
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            where = (
                f"{len(missing)} on rank {rank}: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}"
                if missing
                else f"none on rank {rank}, some on another rank"
            )
            raise MissingGradients(
                f"{role} step: parameters that train got no gradient in the backward ({where}); the "
                "step would have trained nothing for them, so it is not applied. The graph is cut "
                "before them: a frozen input under activation recomputation, a forward under "
                "no_grad, or a detached tensor"
            )


def _grad_buffers(chunk: torch.nn.Module) -> list:
    return [*getattr(chunk, "buffers", []), *getattr(chunk, "expert_parallel_buffers", [])]
