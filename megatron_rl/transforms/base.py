"""The model-transform seam: one object per way a role's model is changed after it is built (LoRA,
routing replay), which owns everything that change means elsewhere, so that the trainer, the
checkpoint code and the publishers ask it instead of naming the feature (torchtitan's
ModelConverter is the model).

A role's transforms come from `transforms.plan.role_transforms` (decided from the layout's plans);
`RoleTrainer` (trainer/role.py) builds the model with every transform's `build_options`, loads
the initial weights, `apply`s each before DDP and the optimizer exist, hands their `pass_hook`s
to every training and pi_old pass (`Trainable.hooks`), and gives them to the checkpoint code
(trainer/checkpoint.py), which writes what they keep and asks them whether a checkpoint resumes.
Every method has a default that changes nothing.
"""

from __future__ import annotations

from pathlib import Path

import torch


class ModelTransform:
    """A change to a role's model after it is built; the defaults change nothing."""

    # The entry a checkpoint's meta.json keeps for it (`checkpoint_meta`), and its name in logs.
    name: str = ""

    def build_options(self) -> dict:
        """Keyword arguments for the model builder (e.g. one linear per MoE expert)."""
        return {}

    def apply(self, model: torch.nn.Module) -> str | None:
        """Changes the built model (its initial weights loaded; DDP and the optimizer not yet
        there); returns a line for the log, or None."""
        return None

    def pass_hook(self):
        """What takes part in every training and pi_old pass over the model (`set_batch(batch)`
        before a micro-batch, `forward_pass(training)` around a pass), or None."""
        return None

    def frozen_reference(self, model: torch.nn.Module):
        """A frozen reference of the initial model that needs no copy of it, or None (the caller
        copies the initial weights)."""
        return None

    # -- checkpoints ------------------------------------------------------------------------------
    def checkpoint_meta(self) -> dict | None:
        """What a checkpoint's meta.json keeps under `name`, or None (nothing)."""
        return None

    def keeps(self, key: str) -> bool:
        """Whether a checkpoint holds this entry of the model's state (all by default)."""
        return True

    def check_checkpoint(self, saved: dict | None, path: Path) -> None:
        """Refuses (naming both) a checkpoint this run cannot resume: `saved` is its meta.json's
        entry under `name` (None: written without this transform)."""
        return None
