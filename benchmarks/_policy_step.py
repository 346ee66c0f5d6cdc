"""What the policy-step benchmarks (minibatches.py, routing_replay.py) share: this process as the
one rank of a gloo group, and the step's random samples (prompt a quarter, the rest actions,
sampler log-probs near a uniform policy's), with routes when asked for."""

from __future__ import annotations

import os


def one_rank() -> None:
    """This process as rank 0 of 1 (megatron's groups at size 1), torch on OMP_NUM_THREADS threads."""
    import megatron_rl.compat  # noqa: F401  (before megatron-core)

    import torch

    from megatron_rl import parallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(parallel.free_port()), RANK="0", WORLD_SIZE="1")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    parallel.initialize_distributed()
    parallel.initialize_model_parallel()


def random_samples(count: int, seq_len: int, vocab_size: int, routes: tuple[int, int, int] | None = None) -> list:
    """`count` samples of seq_len / 8 .. seq_len / 2 tokens (seeded); `routes` (layers, experts,
    top_k): random distinct experts for every token but the last, as vLLM returns them."""
    import numpy as np

    from megatron_rl.data.types import TrainingSample

    rng = np.random.default_rng(0)
    samples = []
    for i in range(count):
        n = int(rng.integers(seq_len // 8, seq_len // 2))
        mask = np.zeros(n, dtype=bool)
        mask[n // 4 :] = True
        chosen = None
        if routes is not None:
            layers, experts, topk = routes
            chosen = np.argsort(rng.random((n - 1, layers, experts)), -1)[..., :topk].astype(np.uint8)
        samples.append(TrainingSample(
            token_ids=rng.integers(0, vocab_size, n), loss_mask=mask,
            inference_logprobs=np.where(mask, -np.log(vocab_size) + rng.normal(scale=0.1, size=n), 0.0),
            reward=1.0, group_id=i, advantages=np.where(mask, rng.normal(size=n), 0.0).astype(np.float32),
            returns=np.zeros(n, dtype=np.float32), values=np.zeros(n, dtype=np.float32), routes=chosen,
        ))  # fmt: skip
    return samples
