"""TrainingSample, MicroBatch, Grid, and packing into grids. Pure: no distributed, no sockets."""

from megatron_rl.data.types import Grid, MicroBatch, ScoreResult, TrainingSample

__all__ = ["Grid", "MicroBatch", "ScoreResult", "TrainingSample"]
