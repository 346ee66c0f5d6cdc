"""The model-transform seam: one object per way a role's model is changed after it is built (LoRA,
routing replay), which owns everything that change means elsewhere, so that the trainer, the
checkpoint code and the publishers ask it instead of naming the feature (torchtitan's
ModelConverter is the model).

A role's transforms come from `transforms.plan.role_transforms` (decided from the layout's plans);
`RoleTrainer` (trainer/role.py) builds the model with every transform's `build_options`, loads
the initial weights, `apply`s each before DDP and the optimizer exist, hands their `pass_hook`s
to every training and pi_old pass (`Trainable.hooks`), and gives them to the checkpoint code
(trainer/checkpoint.py), which writes what they keep and asks them whether a checkpoint resumes,
and to the publishers (policy/publish/), which publish the model with every transform folded in
(`merge`) or a transform's own tensors alone in their external format (`served_alone`: LoRA
adapters in PEFT's format). A policy snapshot asks the model for the plain model's sharded state
(`PLAIN_MODEL`), which a transform's modules honour. Every method has a default that changes
nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Protocol

import torch

# `model.sharded_state_dict(metadata={PLAIN_MODEL: True})`: the plain model's sharded state, every
# transform's tensors folded into the weights they change and none of their own (policy snapshots,
# which the critic loads as a plain model's backbone).
PLAIN_MODEL = "megatron_rl_plain_model"


class ExternalFormat(Protocol):
    """How a transform's own tensors are published alone, for inference to load beside the base
    model it already serves (LoRA: a PEFT adapter directory that vLLM loads)."""

    def select(self, key: str) -> bool:
        """Whether the model's parameter `key` is one of the published tensors."""

    def convert(self, tensors: dict, arch) -> dict:
        """Megatron-named tensors (gathered; one owner's share) under their external names."""

    def targets(self, tensors: dict) -> list[str]:
        """What the converted tensors change, as the external config names it."""

    def config(self, targets: list[str], base_model: str | None) -> dict:
        """The external format's config for `targets` of `base_model`."""

    def write(self, directory: Path, tensors: dict, base_model: str | None) -> None:
        """Writes converted tensors and their config as one loadable directory."""


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
        """A frozen reference of the initial model that needs no copy of it (an object whose
        `active()` context yields the model to run as the reference), or None (the caller copies
        the initial weights)."""
        return None

    # -- publishing ------------------------------------------------------------------------------
    def merge(self, tensors: dict) -> dict:
        """A gathered state dict of the model as the plain model's: this transform's tensors folded
        into the weights they change (what inference loads when it serves plain weights)."""
        return tensors

    def served_alone(self) -> ExternalFormat | None:
        """The format in which inference gets this transform's own tensors alone, or None: it gets
        the merged weights."""
        return None

    def serving_line(self) -> str | None:
        """How versions reach inference under this transform, for the policy's log, or None."""
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


def merged(transforms: Iterable[ModelTransform]) -> Callable[[dict], dict]:
    """Folds every transform's tensors into a gathered state dict, in order."""
    transforms = list(transforms)

    def merge(tensors: dict) -> dict:
        for transform in transforms:
            tensors = transform.merge(tensors)
        return tensors

    return merge


def served_alone(transforms: Iterable[ModelTransform]) -> ExternalFormat | None:
    """The one external format inference loads beside its base model, or None (merged weights);
    a ValueError naming them when two transforms each want their tensors served alone."""
    formats = [(t.name, f) for t in transforms if (f := t.served_alone()) is not None]
    if len(formats) > 1:
        raise ValueError(f"transforms {[name for name, _ in formats]} each publish their tensors alone; at most one can")
    return formats[0][1] if formats else None
