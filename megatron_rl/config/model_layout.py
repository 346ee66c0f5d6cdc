"""One process group's parallel layout (`ModelLayout`), in a module of its own so that both
layout.py (the policy's and the critic's) and services.py (a Megatron teacher's) can hold it."""

from __future__ import annotations

from megatron_rl.config.base import Strict


class ModelLayout(Strict):
    """One process group's parallel layout. world = tp * cp * pp * dp."""

    world_size: int
    tp: int
    cp: int
    pp: int
    ep: int
    dp: int
    expert_dp: int  # data-parallel size of expert weights: world / (tp * ep * pp)
    # Sequence-parallel size: tp when the model runs sequence parallel (the builder turns it on
    # for MoE at tp > 1), else 1. Packed rows pad to a multiple of cp * sp.
    sp: int = 1
