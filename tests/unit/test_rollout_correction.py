"""Rollout correction (algorithms/rollout_correction.py) against a plain per-sequence reference
written here (Python loops over sequences and tokens, verl's definitions), on sequences packed
into rows and split over two CP ranks (two threads whose `cp_reduce` exchanges their partial
per-sequence statistics, as the CP group's all-reduce does); and the loss aggregation's weights
and normalisers against verl's `agg_loss` written plainly."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest
import torch

from megatron_rl.algorithms import aggregation, rollout_correction
from megatron_rl.config.algorithm import RolloutCorrectionConfig
from megatron_rl.data.packing import pack_into_grid
from megatron_rl.data.types import TrainingSample

RULE_SETS = [
    {"rollout_is": "token", "rollout_is_threshold": 1.3},
    {"rollout_is": "token", "rollout_is_threshold": "0.7_1.4"},
    {"rollout_is": "sequence", "rollout_is_threshold": 2.0},
    {"rollout_is": "sequence", "rollout_is_threshold": "0.5_2.0"},
    {"rollout_is": "geometric", "rollout_is_threshold": "0.9_1.1"},
    # Asymmetric k1 bounds, so that the direction of the ratio (pi_sampler / pi_old) matters.
    {"rollout_rs": "token_k1", "rollout_rs_threshold": "0.85_1.5"},
    {"rollout_rs": "token_k2,token_k3", "rollout_rs_threshold": 0.02},
    {"rollout_rs": "seq_sum_k1,seq_sum_k2,seq_sum_k3", "rollout_rs_threshold": "0.6_3.0,0.2,0.2"},
    {"rollout_rs": "seq_mean_k1,seq_mean_k3", "rollout_rs_threshold": "0.97_1.3,0.01"},
    {"rollout_rs": "seq_max_k2,seq_max_k3", "rollout_rs_threshold": "0.05,0.04"},
    {"rollout_is": "sequence", "rollout_is_threshold": 3.0, "rollout_rs": "seq_mean_k2", "rollout_rs_threshold": 0.01},
]


def random_sequences(seed: int, count: int = 9):
    """Per sequence: (log_ratio [L] float64, mask [L] bool) with log-ratios of either sign."""
    rng = np.random.default_rng(seed)
    sequences = []
    for _ in range(count):
        n = int(rng.integers(2, 30))
        mask = rng.random(n) < 0.7
        mask[0] = False
        log_ratio = np.where(mask, rng.normal(scale=0.25, size=n), 0.0)
        sequences.append((log_ratio, mask))
    return sequences


def reference(config: RolloutCorrectionConfig, sequences):
    """Plain loops: per sequence, (weights [L], keep [L])."""
    lower, upper = config.importance_bounds()
    out = []
    for log_ratio, mask in sequences:
        actions = [t for t in range(len(mask)) if mask[t]]
        safe = {t: min(max(log_ratio[t], -20.0), 20.0) for t in actions}
        k = {"k1": {t: -safe[t] for t in actions}, "k2": {t: 0.5 * safe[t] ** 2 for t in actions},
             "k3": {t: math.exp(safe[t]) - 1 - safe[t] for t in actions}}  # fmt: skip
        weights = [1.0] * len(mask)
        if config.rollout_is is not None:
            for t in actions:
                if config.rollout_is == "token":
                    log_w = log_ratio[t]
                elif config.rollout_is == "sequence":
                    log_w = sum(log_ratio[u] for u in actions)
                else:
                    log_w = sum(log_ratio[u] for u in actions) / len(actions)
                raw = math.exp(min(max(log_w, -20.0), 20.0))
                if lower is None:
                    weights[t] = min(raw, upper)
                else:
                    weights[t] = raw if lower <= raw <= upper else 0.0
        keep = list(mask)
        for rule, lo, hi in config.rejection_rules():
            level, divergence = rule.rsplit("_", 1)
            for t in actions:
                values = [k[divergence][u] for u in actions]
                stat = {"token": k[divergence][t], "seq_sum": sum(values), "seq_mean": sum(values) / len(values),
                        "seq_max": max(values)}[level]  # fmt: skip
                ok = math.log(lo) <= stat <= math.log(hi) if divergence == "k1" else stat <= hi
                keep[t] = keep[t] and ok
        out.append((np.array(weights), np.array(keep)))
    return out


def packed_views(sequences, cp: int):
    """The sequences end to end in one row (padded to a multiple of cp), cut into cp slices."""
    lengths = [len(m) for _, m in sequences]
    total = -(-sum(lengths) // cp) * cp
    log_ratio = np.zeros(total)
    mask = np.zeros(total, dtype=bool)
    seq = np.full(total, len(sequences), dtype=np.int64)  # the padding tail is its own sequence
    starts = np.cumsum([0] + lengths)
    for i, (lr, m) in enumerate(sequences):
        log_ratio[starts[i] : starts[i + 1]], mask[starts[i] : starts[i + 1]] = lr, m
        seq[starts[i] : starts[i + 1]] = i
    num_sequences = len(sequences) + (1 if total > starts[-1] else 0)
    firsts = np.append(starts[:-1], starts[-1])[:num_sequences]
    views = []
    for r in range(cp):
        lo, hi = r * total // cp, (r + 1) * total // cp
        views.append(rollout_correction.TokenView(
            log_ratio=torch.as_tensor(log_ratio[lo:hi]), mask=torch.as_tensor(mask[lo:hi]),
            sequence_of_token=torch.as_tensor(seq[lo:hi]), num_sequences=num_sequences,
            owned=torch.as_tensor((firsts >= lo) & (firsts < hi)),
        ))  # fmt: skip
    return views, starts, total


class ThreadedCp:
    """cp_reduce for `size` threads: each contributes its tensor, all get the reduction."""

    def __init__(self, size: int):
        self.size, self.parts, self.barrier = size, {}, threading.Barrier(size)

    def reduce(self, rank: int):
        def cp_reduce(tensor: torch.Tensor, op: str) -> torch.Tensor:
            self.parts[rank] = tensor.clone()
            self.barrier.wait()
            stacked = torch.stack([self.parts[r] for r in range(self.size)])
            result = stacked.sum(0) if op == "sum" else stacked.max(0).values
            self.barrier.wait()
            return result

        return cp_reduce


def run_cp(config, views):
    cp, results = ThreadedCp(len(views)), [None] * len(views)

    def rank(r):
        results[r] = rollout_correction.apply(config, [views[r]], cp.reduce(r))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(views))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


@pytest.mark.parametrize("rules", RULE_SETS)
@pytest.mark.parametrize("cp", [1, 2])
def test_weights_and_rejections_equal_the_plain_reference(rules, cp):
    config = RolloutCorrectionConfig(**rules)
    for seed in range(3):
        sequences = random_sequences(seed)
        expected = reference(config, sequences)
        views, starts, total = packed_views(sequences, cp)
        results = run_cp(config, views)
        weights = np.concatenate([
            (c[0].weights.double().numpy() if c[0].weights is not None else np.where(v.mask.numpy(), 1.0, 0.0))
            for (c, _), v in zip(results, views)])  # fmt: skip
        keep = np.concatenate([c[0].keep.numpy() for c, _ in results])
        for i, (w, k) in enumerate(expected):
            part = slice(starts[i], starts[i + 1])
            mask = sequences[i][1]
            np.testing.assert_allclose(weights[part][mask], w[mask], rtol=2e-7, err_msg=f"{rules} seq {i}")
            np.testing.assert_array_equal(keep[part], k, err_msg=f"{rules} seq {i}")
        # The rules must act somewhere and not everywhere (else the test proves nothing).
        all_w = np.concatenate([w[m] for (w, _), (_, m) in zip(expected, sequences)])
        all_k = np.concatenate([k[m] for (_, k), (_, m) in zip(expected, sequences)])
        if config.rollout_is and seed == 0:
            lower, upper = config.importance_bounds()
            assert (all_w == upper).any() if lower is None else (all_w == 0).any() and (all_w > 0).any(), rules
        if config.rollout_rs and seed == 0:
            assert 0 < all_k.sum() < len(all_k), rules


def reduced_summary(config, views) -> dict:
    """The CP ranks' metrics reduced as the trainer does (sums; maxima of *_max, minima of *_min)
    and summarised."""
    totals: dict[str, float] = {}
    for _, metrics in run_cp(config, views):
        for key, value in metrics.items():
            value = float(value)
            if key.endswith("_max"):
                totals[key] = max(totals.get(key, -math.inf), value)
            elif key.endswith("_min"):
                totals[key] = min(totals.get(key, math.inf), value)
            else:
                totals[key] = totals.get(key, 0.0) + value
    return rollout_correction.summarise(totals)


@pytest.mark.parametrize("cp", [1, 2])
def test_metrics_equal_the_plain_reference(cp):
    config = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=1.3, rollout_rs="seq_max_k2",
                                     rollout_rs_threshold=0.08)  # fmt: skip
    sequences = random_sequences(4)
    expected = reference(config, sequences)
    views, _, _ = packed_views(sequences, cp)
    summary = reduced_summary(config, views)
    lr = np.concatenate([r[m] for r, m in sequences])
    weights = np.concatenate([w[m] for (w, _), (_, m) in zip(expected, sequences)])
    keep = np.concatenate([k[m] for (_, k), (_, m) in zip(expected, sequences)])
    with_actions = [(r, m) for r, m in sequences if m.any()]
    assert summary["mismatch_kl_k1"] == pytest.approx(np.mean(-lr))
    assert summary["mismatch_kl"] == pytest.approx(np.mean(np.expm1(lr) - lr))
    assert summary["mismatch_chi2_token"] == pytest.approx(np.mean(np.exp(2 * lr)) - 1)
    assert summary["mismatch_chi2_seq"] == pytest.approx(np.mean([np.exp(2 * r[m].sum()) for r, m in with_actions]) - 1)
    assert summary["rollout_is_mean"] == pytest.approx(weights.mean())
    assert summary["rollout_is_max"] == pytest.approx(weights.max()) and summary["rollout_is_min"] == pytest.approx(weights.min())
    assert summary["rollout_is_flagged_fraction"] == pytest.approx(np.mean(np.exp(lr) > 1.3))
    assert 0 < np.mean(~keep) < 1
    assert summary["rollout_rs_masked_fraction"] == pytest.approx(np.mean(~keep))
    rejected_sequences = [bool((m & ~k).any()) for (_, k), (_, m) in zip(expected, sequences) if m.any()]
    assert summary["rollout_rs_seq_masked_fraction"] == pytest.approx(np.mean(rejected_sequences))


@pytest.mark.parametrize("level", ["sequence", "geometric"])
@pytest.mark.parametrize("cp", [1, 2])
def test_sequence_level_max_and_min_are_the_raw_sequence_ratios_as_verl_reports_them(level, cp):
    """verl's compute_is_metrics at sequence level: rollout_is_max = exp(min(max log w, 20)) and
    rollout_is_min = exp(min log w) of the raw sequence ratios, before truncation (`geometric`
    read the same way with the mean log-ratio); rollout_is_mean stays the applied weights' mean
    over action tokens."""
    threshold = 1.2 if level == "sequence" else 1.01  # a geometric mean stays closer to 1
    config = RolloutCorrectionConfig(rollout_is=level, rollout_is_threshold=threshold)
    sequences = random_sequences(6)
    expected_weights = reference(config, sequences)
    logs = [(r[m].sum() if level == "sequence" else r[m].mean()) for r, m in sequences if m.any()]
    views, _, _ = packed_views(sequences, cp)
    summary = reduced_summary(config, views)
    assert summary["rollout_is_max"] == pytest.approx(math.exp(min(max(logs), 20.0)), rel=1e-9)
    assert summary["rollout_is_min"] == pytest.approx(math.exp(min(logs)), rel=1e-9)
    assert summary["rollout_is_max"] > threshold  # above the truncation: the applied weights never are
    applied = np.concatenate([w[m] for (w, _), (_, m) in zip(expected_weights, sequences)])
    assert applied.max() <= threshold and summary["rollout_is_mean"] == pytest.approx(applied.mean())


def test_a_cp_rank_without_action_tokens_reports_the_identities_of_max_and_min():
    """Token level, the first CP rank's slice holds no action token: its weights' max is -inf and
    min +inf, so the reduced extremes are the other rank's alone."""
    config = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=1.3)
    busy = random_sequences(8, count=3)
    quiet_length = sum(len(m) for _, m in busy) + 2  # longer than the busy ones: the first slice is quiet
    views, _, _ = packed_views([(np.zeros(quiet_length), np.zeros(quiet_length, dtype=bool))] + busy, 2)
    assert not views[0].mask.any() and views[1].mask.any()
    metrics = [m for _, m in run_cp(config, views)]
    assert float(metrics[0]["rollout_is_weight_max"]) == -math.inf
    assert float(metrics[0]["rollout_is_weight_min"]) == math.inf
    summary = reduced_summary(config, views)
    assert summary["rollout_is_max"] == pytest.approx(float(metrics[1]["rollout_is_weight_max"]))
    assert summary["rollout_is_min"] == pytest.approx(float(metrics[1]["rollout_is_weight_min"]))


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_a_step_without_action_tokens_reports_no_weight_extremes(level):
    """No sequence of the step has an action token: the extremes stay -inf and +inf (the sequence
    level reads the CP-reduced sequence ratios, so every rank sees that) and the summary leaves
    the rollout_is_* metrics out rather than reporting them."""
    config = RolloutCorrectionConfig(rollout_is=level, rollout_is_threshold=1.3)
    views, _, _ = packed_views([(np.zeros(6), np.zeros(6, dtype=bool)), (np.zeros(5), np.zeros(5, dtype=bool))], 2)
    for _, metrics in run_cp(config, views):
        assert float(metrics["rollout_is_weight_max"]) == -math.inf
        assert float(metrics["rollout_is_weight_min"]) == math.inf
    totals = {key: float(value) for key, value in run_cp(config, views)[0][1].items()}
    assert not any(key.startswith("rollout_is_") for key in rollout_correction.summarise(totals))


def test_bad_settings_are_refused_naming_the_key():
    with pytest.raises(ValueError, match="rollout_is_threshold.*lower bound 2.0 is above"):
        RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold="2.0_1.0")
    with pytest.raises(ValueError, match="unknown rule"):
        RolloutCorrectionConfig(rollout_rs="seq_max_k1", rollout_rs_threshold=1.0)
    with pytest.raises(ValueError, match="needs rollout_rs_threshold"):
        RolloutCorrectionConfig(rollout_rs="token_k2")
    with pytest.raises(ValueError, match="only \\*_k1 rules take"):
        RolloutCorrectionConfig(rollout_rs="token_k2", rollout_rs_threshold="0.1_0.2")
    with pytest.raises(ValueError, match="2 thresholds for 3 rules"):
        RolloutCorrectionConfig(rollout_rs="token_k2,token_k3,seq_max_k2", rollout_rs_threshold="0.1,0.2")
    with pytest.raises(ValueError, match="set rollout_is, rollout_rs or both"):
        RolloutCorrectionConfig()
    # verl's reading of a single k1 bound U: [1 / U, U].
    assert RolloutCorrectionConfig(rollout_rs="token_k1", rollout_rs_threshold=2.0).rejection_rules() == [
        ("token_k1", 0.5, 2.0)
    ]


def verl_agg_loss(losses, masks, mode, scale):
    """verl's agg_loss (one process, DP 1) written with loops over sequences."""
    if mode == "token-mean":
        return sum(loss[m].sum() for loss, m in zip(losses, masks)) / sum(m.sum() for m in masks)
    valid = [(loss, m) for loss, m in zip(losses, masks) if m.any()]
    if mode == "seq-mean-token-mean":
        return sum(loss[m].sum() / m.sum() for loss, m in valid) / len(valid)
    total = sum(loss[m].sum() for loss, m in valid) / len(valid)
    return total / scale if mode == "seq-mean-token-sum-norm" else total


@pytest.mark.parametrize("mode", aggregation.MODES)
def test_aggregation_weights_and_normalisers_give_verls_loss(mode):
    rng = np.random.default_rng(3)
    masks = [rng.random(int(rng.integers(1, 20))) < 0.6 for _ in range(10)]
    masks[2][:] = False  # a sequence without action tokens counts nowhere
    losses = [rng.normal(size=len(m)) for m in masks]
    expected = verl_agg_loss(losses, masks, mode, 16)
    # Packed in two rows; each row's sequences, counted on the row that owns them.
    rows = [list(range(0, 6)), list(range(6, 10))]
    numerator, denominator = 0.0, 0
    for row in rows:
        mask = torch.as_tensor(np.concatenate([masks[i] for i in row]))
        loss = torch.as_tensor(np.concatenate([losses[i] for i in row]))
        seq = torch.as_tensor(np.concatenate([[j] * len(masks[i]) for j, i in enumerate(row)]))
        tokens = torch.as_tensor([float(masks[i].sum()) for i in row])
        w = aggregation.token_weights(mode, mask, seq, tokens)
        numerator += float(torch.where(mask, loss * (1.0 if w is None else w.double()), 0.0).sum())
        denominator += aggregation.normaliser(mode, mask, int((tokens > 0).sum()), 16)
    assert numerator / denominator == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("mode", ["seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_seq_mean_modes_count_only_the_sequences_rejection_keeps(mode):
    """A sequence whose every action token rollout rejection dropped leaves the seq-mean
    normaliser (as a rejected token leaves token-mean's): the loss equals verl's agg_loss on the
    masks left after rejection, not verl's trainer's division by every sequence of the
    mini-batch (docs/algorithms/index.md, Differences from verl)."""
    config = RolloutCorrectionConfig(rollout_rs="seq_max_k2", rollout_rs_threshold=0.05)
    sequences = random_sequences(5, count=12)
    views, starts, _ = packed_views(sequences, 1)
    ((corrections, _),) = run_cp(config, views)
    keep = corrections[0].keep
    kept = [keep[starts[i] : starts[i + 1]].numpy() for i in range(len(sequences))]
    rejected = sum(m.any() and not k.any() for (_, m), k in zip(sequences, kept))
    assert 0 < rejected < sum(m.any() for _, m in sequences)  # some sequences rejected whole, not all
    losses = [np.random.default_rng(i).normal(size=len(m)) for i, (_, m) in enumerate(sequences)]
    view = views[0]
    tokens = torch.zeros(view.num_sequences, dtype=torch.float64).index_add_(0, view.sequence_of_token, keep.double())
    w = aggregation.token_weights(mode, keep, view.sequence_of_token, tokens)
    loss = torch.as_tensor(np.concatenate(losses + [np.zeros(len(keep) - starts[-1])]))
    numerator = float(torch.where(keep, loss * (1.0 if w is None else w.double()), 0.0).sum())
    ours = numerator / aggregation.normaliser(mode, keep, int((view.owned & (tokens > 0)).sum()), 16)
    assert ours == pytest.approx(verl_agg_loss(losses, kept, mode, 16), rel=1e-6)  # float32 weights
    every_sequence = numerator / (len(sequences) * (16 if mode.endswith("norm") else 1))  # verl's trainer
    assert every_sequence != pytest.approx(ours, rel=1e-3)


def test_correction_is_per_token_on_samples_that_span_versions():
    """Partial rollouts: a sample's tokens come from several policy versions, each with its own
    sampler log-probabilities. Through packing, token-level TIS / IcePop weights, token rejection
    and the mismatch metrics use each token's own sampler log-probability: they equal the plain
    reference on the per-token log-ratios, and only the tokens of the stale version are corrected."""
    rng = np.random.default_rng(5)
    samples, old = [], []
    for i in range(6):
        n, boundary = int(rng.integers(12, 30)), int(rng.integers(4, 10))
        mask = np.arange(n) >= 3
        pi_old = -rng.random(n) * 2  # the trainer's pi_old: the newest version's
        versions = np.where(np.arange(n) < boundary, 4, 5)  # tokens before the boundary sampled by version 4
        sampler = np.where(versions == 4, pi_old + rng.normal(0.4, 0.2, n), pi_old + rng.normal(0, 1e-3, n))
        samples.append(TrainingSample(token_ids=rng.integers(1, 100, n), loss_mask=mask,
                                      inference_logprobs=np.where(mask, sampler, 0.0), reward=1.0, group_id=i,
                                      policy_version=4, token_versions=versions))  # fmt: skip
        old.append(pi_old)
    micro = pack_into_grid(samples, 256, 1)[0][0]
    index = micro.sample_index
    position = np.concatenate([np.arange(len(s)) for s in (samples[i] for i in dict.fromkeys(index[index >= 0]))])
    pi_old = np.zeros(micro.num_tokens)
    pi_old[: len(position)] = [old[i][p] for i, p in zip(index[index >= 0], position)]
    log_ratio = np.where(micro.loss_mask, pi_old - micro.inference_logprobs.astype(np.float64), 0.0)
    order = list(dict.fromkeys(index[index >= 0]))
    sequences = [(log_ratio[index == i], micro.loss_mask[index == i]) for i in order]
    stale = np.concatenate([samples[i].versions() == 4 for i in order])
    for rules in ({"rollout_is": "token", "rollout_is_threshold": "0.8_1.25"},
                  {"rollout_rs": "token_k1", "rollout_rs_threshold": "0.8_1.25"}):  # fmt: skip
        config = RolloutCorrectionConfig(**rules)
        views, _, _ = packed_views(sequences, 1)
        (corrections, metrics), = run_cp(config, views)
        expected = reference(config, sequences)
        weights = corrections[0].weights
        keep = corrections[0].keep.numpy()[: len(stale)]
        actions = np.concatenate([m for _, m in sequences])
        if weights is not None:
            applied = weights.double().numpy()[: len(stale)][actions]
            assert applied == pytest.approx(np.concatenate([w for w, _ in expected])[actions])
            corrected = np.zeros_like(actions)
            corrected[actions] = applied == 0.0  # IcePop: zeroed outside [0.8, 1.25]
        else:
            assert keep.tolist() == np.concatenate([k for _, k in expected]).tolist()
            corrected = ~keep
        assert corrected[actions & stale].mean() > 0.5 and not corrected[actions & ~stale].any()
        assert float(metrics["mismatch_k1_sum"]) == pytest.approx(-sum(lr[m].sum() for lr, m in sequences))
