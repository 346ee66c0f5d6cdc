"""Batched scoring across the critic's ranks (the collective behind `POST /score`), and the
pass it shares with the Megatron teacher (`per_token_outputs`; teacher/scoring.py).

`score_sequences(model, request, seq_len)` is called by every critic rank; global rank 0 passes
the request (a list of token-id lists), the others None. Rank 0 broadcasts it as int64 tensors
(never pickle); every rank packs it identically with `pack_into_grid` (complete sequences up to
the critic's seq_len, bins balanced across DP replicas, padded for CP and sequence parallel);
each replica runs its bins (the same number of forwards on every replica, dummies included;
with pipeline parallel through megatron's forward-only schedule), CP ranks of the last stage
all-gather their slices, and all-reduces over DP and then PP bring every value to global rank 0.
With `request_sizes` (the sequences of each merged HTTP request, in order; what the service
passes unless `value.service.isolate_requests` is false) every request is packed into bins of
its own, with the same bins whatever else was merged with it, and the bins are spread over the
DP replicas: a sequence's values are then bit for bit those of its request scored alone (on
CPU the position of a sequence in a packed row, and its row-mates, change the float32
rounding). Without it the whole merged batch is packed together (fewer forward passes when
requests are short).
Rank 0 gets a ScoreResult in the request's order:
    values[i][t] = V(state before token t) = head output at t - 1 (values[i][0] = 0.0)
    bootstrap_values[i] = head output at the last token.
"""

from __future__ import annotations

import megatron_rl.compat  # noqa: F401  (megatron-core on CPU needs its patches first)

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_rl.data.packing import attention_cost, dummy_micro_batch, pack_into_grid
from megatron_rl.data.types import ScoreResult, TrainingSample
from megatron_rl.parallel import collective_device
from megatron_rl.trainer.batches import rank_batch
from megatron_rl.trainer.forward import forward_only
from megatron_rl.transport.broadcast import broadcast_bytes


def _broadcast_request(
    request: list[list[int]] | None, request_sizes: list[int] | None
) -> tuple[list[list[int]], list[int] | None]:
    """Global rank 0's request and request sizes on every rank, sent as int64
    [count, parts, lengths..., sizes..., tokens...] (parts 0: no sizes)."""
    if dist.get_world_size() == 1:
        return request, request_sizes
    data = None
    if dist.get_rank() == 0:
        sizes = list(request_sizes or [])
        flat = [len(request), len(sizes), *(len(ids) for ids in request), *sizes,
                *(t for ids in request for t in ids)]  # fmt: skip
        data = np.asarray(flat, dtype=np.int64).tobytes()
    flat = np.frombuffer(broadcast_bytes(data, 0, device=collective_device()), dtype=np.int64)
    count, parts = int(flat[0]), int(flat[1])
    lengths = flat[2 : 2 + count]
    sizes = [int(n) for n in flat[2 + count : 2 + count + parts]] or None
    ends = np.cumsum(lengths)
    tokens = flat[2 + count + parts :]
    return [tokens[end - n : end].tolist() for n, end in zip(lengths, ends)], sizes


def _isolated_grid(samples: list[TrainingSample], request_sizes: list[int], seq_len: int, dp: int, cp: int, sp: int):
    """grid[data_rank][micro_step] where each bin holds sequences of one request only, packed
    as that request alone would be (first fit over its own sequences), the bins spread over the
    replicas heaviest first onto the least loaded, then padded with dummies to equal counts."""
    if sum(request_sizes) != len(samples) or min(request_sizes, default=1) < 1:
        raise ValueError(f"score_sequences: request_sizes {request_sizes} do not split {len(samples)} sequences")
    bins, start = [], 0
    for size in request_sizes:
        (row,) = pack_into_grid(samples[start : start + size], seq_len, 1, cp, sequence_parallel_size=sp)
        for mb in row:
            mb.sample_index = np.where(mb.sample_index >= 0, mb.sample_index + start, -1)
            bins.append(mb)
        start += size
    load, rows = [0.0] * dp, [[] for _ in range(dp)]
    costs = [sum(attention_cost(int(n)) for n in np.diff(mb.cu_seqlens)) for mb in bins]
    for index in sorted(range(len(bins)), key=lambda i: (-costs[i], i)):
        rank = min(range(dp), key=lambda r: (load[r], r))
        rows[rank].append(bins[index])
        load[rank] += costs[index]
    steps = max(len(row) for row in rows)
    return [row + [dummy_micro_batch(cp * sp) for _ in range(steps - len(row))] for row in rows]


@torch.no_grad()
def per_token_outputs(
    model,
    request: list[list[int]] | None,
    seq_len: int,
    request_sizes: list[int] | None,
    rank_batch_of,
    forward,
    columns: int | None = None,
) -> tuple[np.ndarray, np.ndarray] | None:
    """The collective scoring pass every model service shares (the critic's values, the Megatron
    teacher's log-probabilities and top k): rank 0's request broadcast, packed (`request_sizes`:
    each request into bins of its own, see the module docstring), each replica's bins run
    through `forward(model, batches)` (float32 outputs per position of each RankBatch built by
    `rank_batch_of(mb, cp_rank, cp)`: [n] each, or [n, columns] with `columns`; on the last
    pipeline stage; None elsewhere), CP slices gathered, DP and PP reduced (summed: every
    position is written by one rank, zeros elsewhere, so the outputs must be finite) to global
    rank 0. Returns (outputs of every token of every sequence end to end, float32 [sum T] or
    [sum T, columns]; offsets [count + 1]) on global rank 0, None elsewhere."""

    sequences, request_sizes = _broadcast_request(request, request_sizes)
    dp, cp = ps.get_data_parallel_world_size(), ps.get_context_parallel_world_size()
    sp = ps.get_tensor_model_parallel_world_size() if model.config.sequence_parallel else 1
    samples = [
        TrainingSample(
            token_ids=ids,
            loss_mask=np.zeros(len(ids), bool),
            inference_logprobs=np.zeros(len(ids)),
            reward=0.0,
        )
        for ids in sequences
    ]
    if request_sizes is None:
        grid = pack_into_grid(samples, seq_len, dp, cp, sequence_parallel_size=sp)
    else:
        grid = _isolated_grid(samples, request_sizes, seq_len, dp, cp, sp)
    lengths = np.array([len(ids) for ids in sequences], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    shape = (int(offsets[-1]),) if columns is None else (int(offsets[-1]), columns)
    head = torch.zeros(shape, dtype=torch.float32, device=collective_device())  # output per token
    # Dropout is the only train/eval difference in these models; switching modes walks every
    # module, so only do it when dropout is on.
    toggle = model.training and (model.config.hidden_dropout > 0 or model.config.attention_dropout > 0)
    if toggle:
        model.eval()
    micro_batches = grid[ps.get_data_parallel_rank()]
    for mb, values in zip(micro_batches, _forward(model, micro_batches, rank_batch_of, forward)):
        if mb.is_dummy or values is None:  # values is None off the last pipeline stage
            continue
        for start, end in zip(mb.cu_seqlens[:-1], mb.cu_seqlens[1:]):
            index = int(mb.sample_index[start])
            head[offsets[index] : offsets[index + 1]] = values[start:end]
    if toggle:
        model.train()
    if dp > 1:  # every sample was scored by exactly one replica
        dist.all_reduce(head, group=ps.get_data_parallel_group())
    if ps.get_pipeline_model_parallel_world_size() > 1:  # only the last stage holds values
        dist.all_reduce(head, group=ps.get_pipeline_model_parallel_group())
    if dist.get_rank() != 0:
        return None
    return head.cpu().numpy(), offsets


def _value_head(model, batches):
    return forward_only(model, batches, lambda values, batch: values[0].float())


def score_sequences(
    model, request: list[list[int]] | None, seq_len: int, request_sizes: list[int] | None = None
) -> ScoreResult | None:
    """Collective over all critic ranks; returns the ScoreResult on global rank 0, None elsewhere.
    `request_sizes` (rank 0's): the sequences of each merged request, packed apart (see above)."""
    outputs = per_token_outputs(model, request, seq_len, request_sizes, rank_batch, _value_head)
    if outputs is None:
        return None
    head, offsets = outputs
    values_out, bootstrap = [], []
    for start, end in zip(offsets[:-1], offsets[1:]):
        h = head[start:end]
        values_out.append(np.concatenate([[0.0], h[:-1]]).astype(np.float32))
        bootstrap.append(float(h[-1]))
    return ScoreResult(values=values_out, bootstrap_values=bootstrap)


def _forward(model, micro_batches, rank_batch_of, forward) -> list[torch.Tensor | None]:
    """The per-position output of every micro-batch over its whole packed row (CP slices
    gathered), on the last pipeline stage; None on other stages."""

    cp, cp_rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
    batches = [rank_batch_of(mb, cp_rank, cp) for mb in micro_batches]
    outputs = forward(model, batches)
    if outputs is None:
        return [None] * len(batches)
    if cp > 1:
        gathered = []
        for values in outputs:
            parts = [torch.empty_like(values) for _ in range(cp)]
            dist.all_gather(parts, values.contiguous(), group=ps.get_context_parallel_group())
            gathered.append(torch.cat(parts))
        outputs = gathered
    return outputs
