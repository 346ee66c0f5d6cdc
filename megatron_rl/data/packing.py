"""Pack samples into a grid of micro-batches: `grid[data_rank][micro_step]`.

1. Bins: first-fit-decreasing by length into bins of `seq_len` tokens (complete sequences only).
2. Balance: bins go to DP ranks by longest-processing-time on a cost model with a linear and a
   quadratic (attention) term per sequence; then single-sequence moves and pairwise swaps
   between the most and least loaded ranks lower the maximum rank cost while bins stay within
   `seq_len`.
3. Every bin is padded to a multiple of CP size x sequence-parallel size (each CP rank gets an
   equal contiguous slice, which sequence parallel splits again over TP; padding is masked and
   belongs to no sequence); every DP rank gets the same number of micro-steps, filled with dummy micro-batches
   (all masked, `context_parallel_size` tokens) that contribute zero loss and gradient.

`pack_minibatches` first splits a step's samples into the policy's mini-batches (seeded, whole
samples) and packs each as its own balanced grid, so every data rank has the same number of
micro-steps in every mini-batch; one mini-batch is exactly `pack_into_grid`.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from megatron_rl.data.types import MICRO_BATCH_FLOAT_FIELDS, Grid, MicroBatch, TrainingSample, padding_routes

CostModel = Callable[[int], float]


def attention_cost(length: int, quadratic_scale: float = 8192.0) -> float:
    """Default cost of one sequence: its tokens (MLP, projections) plus length^2 / scale
    (attention). With the default scale, attention is half the cost at 8192 tokens."""
    return length + length * length / quadratic_scale


class PackingError(ValueError):
    pass


@dataclass
class _Bin:
    items: list[int]  # original sample indices
    used: int = 0


class _FreeSpace:
    """A max-segment tree over the bins' free tokens: the leftmost bin with room for `n` tokens
    in O(log bins) (first fit without scanning every bin)."""

    def __init__(self, capacity: int):
        self.size = 1 << max(0, capacity - 1).bit_length()
        self.tree = [-1] * (2 * self.size)  # -1: no bin at this leaf yet

    def set(self, index: int, free: int) -> None:
        node = index + self.size
        self.tree[node] = free
        node >>= 1
        while node:
            self.tree[node] = max(self.tree[2 * node], self.tree[2 * node + 1])
            node >>= 1

    def leftmost(self, n: int) -> int | None:
        """The first bin with at least `n` free tokens, or None."""
        if self.tree[1] < n:
            return None
        node = 1
        while node < self.size:
            node = 2 * node if self.tree[2 * node] >= n else 2 * node + 1
        return node - self.size


def _first_fit_decreasing(lengths: Sequence[int], seq_len: int) -> list[_Bin]:
    """First fit by decreasing length. A bin of `used` tokens takes `n` more when
    used + n <= seq_len: with seq_len a multiple of the padding unit, that is exactly
    padded(used + n) <= seq_len."""
    bins: list[_Bin] = []
    free = _FreeSpace(len(lengths))
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = lengths[index]
        k = free.leftmost(n)
        if k is None:
            k = len(bins)
            bins.append(_Bin([], 0))
        b = bins[k]
        b.items.append(index)
        b.used += n
        free.set(k, seq_len - b.used)
    return bins


def _nearest_first(keys: list[float], target: float):
    """Indices of the sorted `keys`, alternating outward from `target`: each direction in order
    of increasing distance (the caller stops a direction once it can no longer improve)."""
    right = bisect.bisect_left(keys, target)
    return range(right - 1, -1, -1), range(right, len(keys))


def _balance(bins: list[_Bin], lengths, costs, dp: int, seq_len: int, max_rounds: int = 500):
    """Assigns bins to ranks (LPT), then refines by moving/swapping sequences between the most
    loaded rank and the others. Each round takes the single move or swap that lowers the pair's
    maximum the most; candidates are searched outward from the ideal cost (half the gap) in
    cost order, so a round costs O(n log n) rather than O(n^2)."""
    bin_cost = [sum(costs[i] for i in b.items) for b in bins]
    ranks: list[list[_Bin]] = [[] for _ in range(dp)]
    load = [0.0] * dp
    for k in sorted(range(len(bins)), key=lambda k: -bin_cost[k]):
        r = min(range(dp), key=lambda r: (load[r], len(ranks[r])))
        ranks[r].append(bins[k])
        load[r] += bin_cost[k]

    def fits(b: _Bin, extra: int) -> bool:
        return b.used + extra <= seq_len

    for _ in range(max_rounds):
        hi = max(range(dp), key=lambda r: load[r])
        most_bins = max(len(r) for r in ranks)
        mine = sorted((costs[i], i, src) for src in ranks[hi] for i in src.items)
        mine_costs = [c for c, _, _ in mine]
        best = None  # (new max of the two ranks, action)
        limit = load[hi] - 1e-9  # what a candidate must beat: the best so far, else load[hi]
        for lo in range(dp):
            if lo == hi or load[hi] - load[lo] <= 1e-9:
                continue
            room = max((seq_len - b.used for b in ranks[lo]), default=-1)
            # Moves of one sequence from hi to lo: best near cost = gap / 2.
            for direction in _nearest_first(mine_costs, (load[hi] - load[lo]) / 2):
                for position in direction:
                    c, i, src = mine[position]
                    new_pair_max = max(load[hi] - c, load[lo] + c)
                    if new_pair_max >= limit:
                        break
                    dst = None
                    if room >= lengths[i]:
                        dst = next(b for b in ranks[lo] if fits(b, lengths[i]))
                    # A new bin on `lo` only where it adds no micro-step to the grid.
                    if dst is not None or len(ranks[lo]) < most_bins:
                        best, limit = (new_pair_max, ("move", hi, lo, src, i, dst)), new_pair_max
            # Swaps of i (hi) with j (lo), c_i > c_j: best near c_j = c_i - gap / 2.
            theirs = sorted((costs[j], j, dst) for dst in ranks[lo] for j in dst.items)
            their_costs = [c for c, _, _ in theirs]
            for c_i, i, src in mine:
                for direction in _nearest_first(their_costs, c_i - (load[hi] - load[lo]) / 2):
                    for position in direction:
                        c_j, j, dst = theirs[position]
                        delta = c_i - c_j
                        if delta <= 0:
                            break
                        new_pair_max = max(load[hi] - delta, load[lo] + delta)
                        if new_pair_max >= limit:
                            break
                        if fits(src, lengths[j] - lengths[i]) and fits(dst, lengths[i] - lengths[j]):
                            best, limit = (new_pair_max, ("swap", hi, lo, src, i, dst, j)), new_pair_max
        if best is None:
            break
        action = best[1]
        if action[0] == "move":
            _, hi, lo, src, i, dst = action
            src.items.remove(i)
            src.used -= lengths[i]
            if dst is None:
                dst = _Bin([], 0)
                ranks[lo].append(dst)
            dst.items.append(i)
            dst.used += lengths[i]
            if not src.items:
                ranks[hi].remove(src)
            load[hi] -= costs[i]
            load[lo] += costs[i]
        else:
            _, hi, lo, src, i, dst, j = action
            src.items[src.items.index(i)] = j
            dst.items[dst.items.index(j)] = i
            src.used += lengths[j] - lengths[i]
            dst.used += lengths[i] - lengths[j]
            load[hi] -= costs[i] - costs[j]
            load[lo] += costs[i] - costs[j]
    return ranks


def _routes(samples: Sequence[TrainingSample], items: list[int], total: int) -> tuple[np.ndarray, np.ndarray]:
    """A bin's `routes` [total, moe_layers, top_k] and `routed` [total]: each sample's routes,
    padding routes (experts 0..k-1) on the tokens the sampler did not route and the bin's tail."""
    shapes = set()
    for i in items:
        if samples[i].routes is None:
            raise PackingError(
                f"sample {i} (group {samples[i].group_id}, branch {samples[i].branch_index}) has no routes; "
                "routing replay needs the sampler's routes of every sample (the inference pool captures them)"
            )
        shapes.add((samples[i].routes.shape[1:], samples[i].routes.dtype))
    if len(shapes) != 1:
        raise PackingError(f"samples {sorted(items)} have routes of different layers, top-k or dtype: {sorted(map(str, shapes))}")
    ((layers, topk), dtype) = shapes.pop()
    routes = padding_routes(total, layers, topk, dtype)
    routed = np.zeros(total, dtype=np.bool_)
    start = 0
    for i in items:
        r = samples[i].routes
        routes[start : start + len(r)] = r
        routed[start : start + len(r)] = True
        start += len(samples[i])
    return routes, routed


def _teacher_top_k(samples: Sequence[TrainingSample], items: list[int], total: int) -> dict[str, np.ndarray]:
    """A bin's `teacher_top_ids` [total, K] int32 and `teacher_top_logprobs` [total, K] float32:
    each sample's rows, ids 0 and log-probabilities 0 on the bin's tail."""
    widths = set()
    for i in items:
        sample = samples[i]
        name = f"sample {i} (group {sample.group_id}, branch {sample.branch_index})"
        ids, logprobs = sample.teacher_top_ids, sample.teacher_top_logprobs
        if ids is None or logprobs is None:
            raise PackingError(
                f"{name} has no teacher_top_ids / teacher_top_logprobs; distillation.mode top_k_kl needs the "
                "teacher's top k of every sample (the orchestrator sets them from the teacher's reply)"
            )
        if np.ndim(ids) != 2 or np.shape(ids) != np.shape(logprobs) or len(ids) != len(sample):
            raise PackingError(
                f"{name}: teacher_top_ids of shape {np.shape(ids)} and teacher_top_logprobs of shape "
                f"{np.shape(logprobs)}; expected both [{len(sample)} tokens, K]"
            )
        widths.add(np.shape(ids)[1])
    if len(widths) != 1:
        raise PackingError(f"samples {sorted(items)} carry teacher top k of different K: {sorted(widths)}")
    k = widths.pop()
    top_ids = np.zeros((total, k), dtype=np.int32)
    top_logprobs = np.zeros((total, k), dtype=np.float32)
    start = 0
    for i in items:
        n = len(samples[i])
        top_ids[start : start + n] = samples[i].teacher_top_ids
        top_logprobs[start : start + n] = samples[i].teacher_top_logprobs
        start += n
    return {"teacher_top_ids": top_ids, "teacher_top_logprobs": top_logprobs}


def _micro_batch(samples: Sequence[TrainingSample], items: list[int], cp: int, routes: bool = False,
                 teacher: bool = False, teacher_top_k: bool = False) -> MicroBatch:  # fmt: skip
    lengths = [len(samples[i]) for i in items]
    real = sum(lengths)
    total = -(-real // cp) * cp
    pad = total - real

    def cat(get, dtype, fill=0):
        parts = [np.asarray(get(samples[i]), dtype=dtype) for i in items]
        parts.append(np.full(pad, fill, dtype=dtype))
        return np.concatenate(parts)

    def annotation(name):
        return lambda s: getattr(s, name) if getattr(s, name) is not None else np.zeros(len(s))

    old_values = annotation("values")
    floats = {
        "advantages": cat(annotation("advantages"), np.float32),
        "returns": cat(annotation("returns"), np.float32),
        "old_values": cat(old_values, np.float32),
        "inference_logprobs": cat(lambda s: s.inference_logprobs, np.float32),
    }
    assert set(floats) == set(MICRO_BATCH_FLOAT_FIELDS)
    route_arrays = dict(zip(("routes", "routed"), _routes(samples, items, total))) if routes else {}
    if teacher:
        route_arrays["teacher_logprobs"] = cat(annotation("teacher_logprobs"), np.float32)
    if teacher_top_k:
        route_arrays.update(_teacher_top_k(samples, items, total))
    return MicroBatch(
        input_ids=cat(lambda s: s.token_ids, np.int64),
        position_ids=np.concatenate(
            [np.arange(n, dtype=np.int64) for n in lengths] + [np.arange(pad, dtype=np.int64)]
        ),
        cu_seqlens=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32),
        loss_mask=cat(lambda s: s.loss_mask, np.bool_, False),
        sample_index=np.concatenate(
            [np.full(n, i, dtype=np.int64) for i, n in zip(items, lengths)]
            + [np.full(pad, -1, dtype=np.int64)]
        ),
        **floats,
        **route_arrays,
    )


def dummy_micro_batch(context_parallel_size: int = 1) -> MicroBatch:
    """All-masked filler: one sequence of `context_parallel_size` padding tokens."""
    n = context_parallel_size
    zeros = np.zeros(n, dtype=np.float32)
    return MicroBatch(
        input_ids=np.zeros(n, dtype=np.int64),
        position_ids=np.arange(n, dtype=np.int64),
        cu_seqlens=np.array([0, n], dtype=np.int32),
        loss_mask=np.zeros(n, dtype=np.bool_),
        advantages=zeros,
        returns=zeros.copy(),
        old_values=zeros.copy(),
        inference_logprobs=zeros.copy(),
        sample_index=np.full(n, -1, dtype=np.int64),
        is_dummy=True,
    )


def pack_into_grid(
    samples: Sequence[TrainingSample],
    seq_len: int,
    data_parallel_size: int,
    context_parallel_size: int = 1,
    cost: CostModel | None = None,
    sequence_parallel_size: int = 1,
    routes: bool = False,
    teacher: bool = False,
    teacher_top_k: bool = False,
) -> Grid:
    """Packs `samples` into `grid[data_rank][micro_step]` (see the module docstring).

    `sequence_parallel_size` is the TP size when the model runs sequence parallel (megatron MoE
    with TP > 1), else 1. `routes`: the micro-batches carry the samples' routes (the policy's
    grid under routing replay; every sample must have them). `teacher`: they carry the samples'
    `teacher_logprobs` (distillation's kl_penalty). `teacher_top_k`: they carry the samples'
    `teacher_top_ids` and `teacher_top_logprobs` ([tokens, K], distillation's top_k_kl; every
    sample must have both, of one K within a micro-batch).
    """
    dp = data_parallel_size
    if dp < 1 or context_parallel_size < 1 or sequence_parallel_size < 1:
        raise PackingError(
            f"data_parallel_size ({dp}), context_parallel_size ({context_parallel_size}) and "
            f"sequence_parallel_size ({sequence_parallel_size}) must be >= 1"
        )
    cp = context_parallel_size * sequence_parallel_size  # every bin pads to a multiple of this
    if seq_len % cp:
        raise PackingError(
            f"seq_len ({seq_len}) must be a multiple of context_parallel_size x sequence_parallel_size ({cp})"
        )
    cost = cost or attention_cost
    lengths = [len(s) for s in samples]
    for i, (sample, n) in enumerate(zip(samples, lengths)):
        if n > seq_len:
            raise PackingError(
                f"sample {i} (group {sample.group_id}, branch {sample.branch_index}) has {n} tokens, "
                f"longer than seq_len {seq_len}; samples are never truncated"
            )
        if n == 0:
            raise PackingError(f"sample {i} (group {sample.group_id}, branch {sample.branch_index}) is empty")

    costs = [cost(n) for n in lengths]
    bins = _first_fit_decreasing(lengths, seq_len)
    ranks = _balance(bins, lengths, costs, dp, seq_len)
    steps = max(1, max(len(r) for r in ranks))
    grid: Grid = []
    for rank_bins in ranks:
        # Longest bins first: the heaviest micro-steps line up across ranks.
        ordered = sorted(rank_bins, key=lambda b: (-sum(costs[i] for i in b.items), min(b.items)))
        row = [_micro_batch(samples, sorted(b.items), cp, routes, teacher, teacher_top_k) for b in ordered]
        row += [dummy_micro_batch(cp) for _ in range(steps - len(row))]
        grid.append(row)
    return grid


def unpack(
    grid: Grid, per_token_outputs: Sequence[Sequence[np.ndarray]], num_samples: int | None = None
) -> list:
    """Per-sample slices of per-token outputs (same [rank][step] shape as `grid`), in original
    sample order. Returns a list whose entry i is the output for sample i."""
    found: dict[int, np.ndarray] = {}
    for rank_grid, rank_out in zip(grid, per_token_outputs, strict=True):
        for mb, out in zip(rank_grid, rank_out, strict=True):
            if mb.is_dummy:
                continue
            if len(out) != mb.num_tokens:
                raise ValueError(f"output has {len(out)} tokens for a micro-batch of {mb.num_tokens}")
            for start, end in zip(mb.cu_seqlens[:-1], mb.cu_seqlens[1:]):
                found[int(mb.sample_index[start])] = out[start:end]
    count = num_samples if num_samples is not None else len(found)
    missing = [i for i in range(count) if i not in found]
    if missing:
        raise ValueError(f"unpack: no output for samples {missing[:10]}")
    return [found[i] for i in range(count)]


def packing_stats(grid: Grid, seq_len: int, cost: CostModel | None = None) -> dict:
    """Fill ratio, bins vs the lower bound ceil(total_tokens / seq_len), DP cost imbalance
    (max / mean of per-rank cost), and the number of dummy micro-batches."""
    cost = cost or attention_cost
    real_bins = [mb for row in grid for mb in row if not mb.is_dummy]
    total_tokens = sum(int(mb.cu_seqlens[-1]) for mb in real_bins)
    rank_costs = [sum(cost(int(n)) for mb in row if not mb.is_dummy for n in mb.seq_lens) for row in grid]
    mean = sum(rank_costs) / len(rank_costs)
    return {
        "num_bins": len(real_bins),
        "lower_bound_bins": math.ceil(total_tokens / seq_len) if total_tokens else 0,
        "fill_ratio": total_tokens / (len(real_bins) * seq_len) if real_bins else 0.0,
        "dp_imbalance": max(rank_costs) / mean if mean else 1.0,
        "dummies": sum(mb.is_dummy for row in grid for mb in row),
        "micro_steps": len(grid[0]),
        "total_tokens": total_tokens,
    }


def split_into_minibatches(num_samples: int, num_minibatches: int, seed) -> list[list[int]]:
    """Sample indices of each mini-batch: a permutation drawn from `seed` (an int or a sequence
    of ints, e.g. (run seed, step)) cut into min(num_minibatches, num_samples) parts whose sizes
    differ by at most one, each in ascending order. One mini-batch (or no samples) is the
    identity: [[0, 1, ..., num_samples - 1]]."""
    if num_minibatches < 1:
        raise PackingError(f"num_minibatches must be >= 1, got {num_minibatches}")
    if num_minibatches == 1 or num_samples <= 1:
        return [list(range(num_samples))]
    order = np.random.default_rng(seed).permutation(num_samples)
    return [sorted(part.tolist()) for part in np.array_split(order, min(num_minibatches, num_samples))]


def pack_minibatches(
    samples: Sequence[TrainingSample],
    num_minibatches: int,
    seed,
    seq_len: int,
    data_parallel_size: int,
    context_parallel_size: int = 1,
    sequence_parallel_size: int = 1,
    cost: CostModel | None = None,
    routes: bool = False,
    teacher: bool = False,
    teacher_top_k: bool = False,
) -> Grid:
    """`grid[data_rank]` = mini-batch 0's micro-steps, then mini-batch 1's, ... (each MicroBatch
    carries its `minibatch`; `sample_index` refers to `samples`). Each mini-batch is packed on its
    own (`pack_into_grid`), so each is balanced over the data ranks with the same number of
    micro-steps on every rank. `routes`, `teacher` and `teacher_top_k` as in `pack_into_grid`."""
    parts = split_into_minibatches(len(samples), num_minibatches, seed)
    if len(parts) == 1:
        return pack_into_grid(samples, seq_len, data_parallel_size, context_parallel_size, cost,
                              sequence_parallel_size, routes, teacher, teacher_top_k)  # fmt: skip
    grid: Grid = [[] for _ in range(data_parallel_size)]
    for k, indices in enumerate(parts):
        original = np.asarray(indices, dtype=np.int64)
        part = pack_into_grid([samples[i] for i in indices], seq_len, data_parallel_size, context_parallel_size,
                              cost, sequence_parallel_size, routes, teacher, teacher_top_k)  # fmt: skip
        for rank, row in enumerate(part):
            for mb in row:
                mb.minibatch = k
                mb.sample_index = np.where(mb.sample_index >= 0, original[np.maximum(mb.sample_index, 0)], -1)
                grid[rank].append(mb)
    return grid
