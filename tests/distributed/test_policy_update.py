"""The policy's RL step (policy/update.py): mini-batch epochs, recomputed old log-probs, rollout
correction, loss aggregation and the sampling temperature, on real Megatron models over gloo.

- N mini-batches x E epochs make N x E optimizer steps; with `recompute` the first update's ratio
  is exactly 1 even when the sampler's log-probs are perturbed, the perturbation shows in the
  mismatch metrics, later updates move the ratio and the clip acts;
- every option, together, gives the same metrics and weights at DP = 2, CP = 2, TP = 2 and
  PP = 2 as in one process (sequences split over CP ranks, mini-batches packed per layout),
  distillation's kl_penalty and top_k_kl among them (the teacher's log-probabilities and top-k
  rows split with the sequences, the top-k KL over the vocabulary split over TP; both terms
  compared at the test's T = 0.8, which a run's config refuses: the layouts' arithmetic is what
  is compared);
- distillation's top_k_kl adds coef x the mean top-k forward KL, equal to a plain loop over the
  action tokens on the model's full log-softmax, and moves the weights elsewhere than the same
  step without it;
- N = E = 1 with `sampler` is train_step exactly;
- log-probs are of softmax(logits / T): samples whose sampler log-probs are the policy's own at
  T = 0.7 give ratio 1 at T = 0.7 and not at T = 1;
- a grid cut into other mini-batches than `algorithm.policy_minibatches` is an error naming both
  numbers before anything of the step runs (a step with fewer samples than N, cut one per
  sample, trains).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_rl import parallel
from tests.support.ranks import DENSE, reference_weights
from tests.support.samples import training_samples
from tests.support.spawn import run_ranks
from tests.support.top_k import add_teacher_top_k

ARCH = DENSE.model_copy(update=dict(num_layers=2))
SEQ_LEN = 64

EVERYTHING = dict(
    type="ppo",
    policy_minibatches=2,
    policy_epochs=2,
    old_logprobs="recompute",
    loss_aggregation="seq-mean-token-mean",
    entropy_coef=0.01,
    rollout_correction={
        "rollout_is": "sequence",
        "rollout_is_threshold": 1.5,
        "rollout_is_batch_normalize": True,
        "rollout_rs": "token_k1,seq_max_k2",
        "rollout_rs_threshold": "0.6_1.6,0.3",
    },
)


TEACHER_COEF = 0.5  # distillation kl_penalty in the layout comparison
TOP_K_COEF, TOP_K = 0.3, 8  # distillation top_k_kl in the layout comparison: its coef, the teacher's k


@pytest.fixture(scope="module")
def weights():
    return run_ranks(reference_weights, 1, ARCH, 5)[0]


def test_n_times_e_updates_ratio_one_first_then_moving_and_the_clip_acts(weights):
    algorithm = dict(type="ppo", policy_minibatches=4, policy_epochs=2, old_logprobs="recompute")
    ((record, _, perturbation),) = run_ranks(policy_step, 1, ARCH, weights, 1, 1, algorithm, 0.5, 1.0, 3e-2)
    assert record["optimizer_steps"] == 8 and record["scheduler_steps"] == 8  # the LR schedule counts updates
    # pi_old is the policy itself before the first update: its ratio is 1 exactly, token by token.
    assert record["ratio_mean_first"] == 1.0 and record["clip_fraction_first"] == 0.0
    assert abs(record["ratio_mean_last"] - 1.0) > 1e-3 and record["clip_fraction_last"] > 0
    # The sampler's log-probs were the policy's plus a known perturbation e: k1 = mean(e).
    assert record["mismatch_kl_k1"] == pytest.approx(perturbation["k1"], rel=1e-5, abs=1e-7)
    assert record["mismatch_kl"] == pytest.approx(perturbation["k3"], rel=1e-5, abs=1e-7)
    assert record["mismatch_kl"] > 1e-2


def test_sampler_ratio_is_against_the_sampler_and_a_single_update_is_train_step(weights):
    ((record, params, _),) = run_ranks(policy_step, 1, ARCH, weights, 1, 1, {"type": "sao"}, 0.0, 1.0)
    ((reference, reference_params),) = run_ranks(plain_train_step, 1, ARCH, weights)
    assert record["optimizer_steps"] == 1
    for key in ("loss", "num_tokens", "grad_norm"):
        assert record[key] == reference[key], key
    assert record["ratio_mean"] == reference["ratio_sum"] / reference["num_tokens"]
    assert record["mismatch_kl"] == reference["approx_kl_sum"] / reference["num_tokens"]
    for name, value in reference_params.items():
        assert torch.equal(params[name], value), name


def test_log_probs_are_of_the_sampling_temperature(weights):
    # Sampler log-probs are the policy's own at T = 0.7: the ratio is 1 at 0.7, off at 1.0.
    ((tempered, _, _),) = run_ranks(policy_step, 1, ARCH, weights, 1, 1, {"type": "ppo"}, 0.0, 0.7, 1e-3, 0.7)
    ((untempered, _, _),) = run_ranks(policy_step, 1, ARCH, weights, 1, 1, {"type": "ppo"}, 0.0, 1.0, 1e-3, 0.7)
    assert tempered["ratio_mean_first"] == pytest.approx(1.0, abs=1e-6)
    assert tempered["mismatch_kl"] < 1e-10
    assert abs(untempered["ratio_mean_first"] - 1.0) > 1e-3 and untempered["mismatch_kl"] > 1e-4


def test_the_entropy_bonus_lowers_the_loss_by_coef_times_the_entropy(weights):
    plain = {"type": "ppo", "old_logprobs": "recompute"}
    ((without, _, _),) = run_ranks(policy_step, 1, ARCH, weights, 1, 1, plain, 0.1, 1.0)
    ((with_bonus, _, _),) = run_ranks(policy_step, 1, ARCH, weights, 1, 1, {**plain, "entropy_coef": 0.1}, 0.1, 1.0)
    assert with_bonus["entropy"] == without["entropy"] > 1.0
    assert with_bonus["loss"] == pytest.approx(without["loss"] - 0.1 * without["entropy"], rel=1e-6)
    assert with_bonus["grad_norm"] != without["grad_norm"]  # the entropy's gradient reaches the model


def test_distillation_kl_penalty_adds_coef_times_the_teachers_kl_to_the_loss(weights):
    """distillation.mode kl_penalty: the teacher's log-probabilities travel in the policy's grid
    (through the codec) and the loss gains coef x the per-token k3 estimate against them, equal
    to a plain mean over the action tokens; its gradient reaches the model."""
    ((without, with_teacher, expected),) = run_ranks(teacher_step, 1, ARCH, weights, 0.5)
    assert with_teacher["teacher_kl"] == pytest.approx(expected, rel=1e-5) and expected > 1e-3
    assert with_teacher["loss"] == pytest.approx(without["loss"] + 0.5 * expected, rel=1e-5)
    assert with_teacher["grad_norm"] != without["grad_norm"]


def test_distillation_top_k_kl_adds_coef_times_the_top_k_kl_and_moves_the_weights(weights):
    """distillation.mode top_k_kl: the teacher's top k travel in the policy's grid (through the
    codec) and the loss gains coef x the mean over action tokens of sum_j p_T(j) (log p_T(j) -
    log pi(j)), equal to a plain loop on the model's full log-softmax; the weights after the step
    differ from those of the same step without the term."""
    ((without, with_top_k, expected, moved),) = run_ranks(teacher_top_k_step, 1, ARCH, weights, 0.5)
    assert with_top_k["teacher_top_k_kl"] == pytest.approx(expected["kl"], rel=1e-5) and expected["kl"] > 0.1
    assert with_top_k["teacher_top_k_mass"] == pytest.approx(expected["mass"], rel=1e-6) and 0.2 < expected["mass"] < 1
    assert with_top_k["loss"] == pytest.approx(without["loss"] + 0.5 * expected["kl"], rel=1e-5)
    assert "teacher_top_k_kl" not in without and with_top_k["grad_norm"] != without["grad_norm"]
    assert moved > 1e-6


@pytest.fixture(scope="module")
def everything_one_process(weights):
    return run_ranks(policy_step, 1, ARCH, weights, 1, 1, EVERYTHING, 0.3, 0.8, 1e-3, None, 1, TEACHER_COEF,
                     TOP_K_COEF)[0]  # fmt: skip


@pytest.mark.parametrize("tp, cp, pp, world", [(1, 1, 1, 2), (1, 2, 1, 2), (2, 1, 1, 2), (1, 1, 2, 2)])
def test_every_option_at_dp2_cp2_tp2_pp2_equals_one_process(weights, everything_one_process, tp, cp, pp, world):
    reference, reference_params, _ = everything_one_process
    assert reference["optimizer_steps"] == 4
    assert 0 < reference["rollout_rs_masked_fraction"] < 1 and reference["rollout_is_flagged_fraction"] > 0
    assert abs(reference["rollout_is_batch_norm_factor"] - 1.0) > 1e-3 and reference["teacher_kl"] > 1e-3
    assert reference["teacher_top_k_kl"] > 0.1 and 0 < reference["teacher_top_k_mass"] < 1
    seen = set()
    for record, params, _ in run_ranks(policy_step, world, ARCH, weights, tp, cp, EVERYTHING, 0.3, 0.8, 1e-3, None, pp,
                                       TEACHER_COEF, TOP_K_COEF):  # fmt: skip
        for key, value in reference.items():
            if isinstance(value, float) and key != "lr":
                assert record[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (tp, cp, pp, key)
        for name, value in params.items():  # a pipeline stage holds its own layers
            torch.testing.assert_close(value, reference_params[name], atol=2e-5, rtol=0, msg=f"{name} {tp=} {cp=} {pp=}")
        seen |= set(params)
    assert seen == set(reference_params)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_loss_aggregation_at_cp2_equals_a_plain_per_sequence_reference(weights, mode):
    """With `recompute` the single update's ratio is 1, so the PPO loss is -(1/D) sum_t w_t A_t:
    written here per sequence with verl's meaning, against the trainer at CP = 2, where packed
    rows (and sequences) are split over the two CP ranks."""
    algorithm = {"type": "ppo", "old_logprobs": "recompute", "loss_aggregation": mode}
    ((record, _, _), _) = run_ranks(policy_step, 2, ARCH, weights, 1, 2, algorithm, 0.1, 1.0)
    samples = training_samples(12, ARCH.vocab_size, seed=11)
    per_sequence = [(s.advantages[s.loss_mask].astype(np.float64)) for s in samples if s.loss_mask.any()]
    if mode == "token-mean":
        expected = -np.concatenate(per_sequence).sum() / sum(len(a) for a in per_sequence)
    elif mode == "seq-mean-token-mean":
        expected = -np.mean([a.mean() for a in per_sequence])
    else:
        expected = -np.mean([a.sum() for a in per_sequence]) / (16 if mode.endswith("norm") else 1)
    assert record["ratio_mean_first"] == 1.0
    assert record["loss"] == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("loss", ["gspo", "cispo"])
def test_sequence_and_weight_losses_at_dp2_and_cp2_equal_one_process(weights, loss):
    """GSPO's sequence ratio spans whole sequences that CP splits over two ranks (Sequences.sum
    reduces over the CP group); CISPO keeps every token's gradient. Four updates each, so the
    ratios move and the clip acts."""
    algorithm = {"type": "grpo", "policy_loss": loss, "policy_minibatches": 2, "policy_epochs": 2,
                 "old_logprobs": "recompute"}  # fmt: skip
    ((reference, reference_params, _),) = run_ranks(policy_step, 1, ARCH, weights, 1, 1, algorithm, 0.0, 1.0, 3e-3)
    assert reference["optimizer_steps"] == 4 and reference["clip_fraction_last"] > 0
    for cp in (1, 2):  # DP = 2, then CP = 2
        for record, params, _ in run_ranks(policy_step, 2, ARCH, weights, 1, cp, algorithm, 0.0, 1.0, 3e-3):
            for key in ("loss", "ratio_mean_last", "clip_fraction_last", "approx_kl", "grad_norm"):
                assert record[key] == pytest.approx(reference[key], rel=1e-5, abs=1e-6), (loss, cp, key)
            for name, value in params.items():
                torch.testing.assert_close(value, reference_params[name], atol=2e-5, rtol=0, msg=f"{loss} {cp=} {name}")


def test_a_grid_cut_into_other_mini_batches_is_refused_before_any_update(weights):
    ((outcomes, changed),) = run_ranks(mismatched_minibatches, 1, ARCH, weights)
    more, fewer, few_samples = outcomes
    assert "algorithm.policy_minibatches is 2" in more and "cut into 3 mini-batches" in more
    assert "algorithm.policy_minibatches is 4" in fewer and "cut into 3 mini-batches from 12 samples" in fewer
    assert changed == {"after the refused steps": False, "after the step of 2 samples": True}
    assert few_samples == 2  # min(4, 2) mini-batches, one optimizer step each


# Rank functions: module-level, so that the spawned ranks can import them.


def _samples_with_policy_logprobs(model, temperature, perturbation_scale, seed=11, count=12):
    """Samples whose sampler log-probs are the model's own at `temperature`, plus a seeded
    perturbation on action tokens; and the perturbation's k1 / k3 means."""
    from megatron_rl.data.packing import pack_into_grid, unpack
    from megatron_rl.models.logprobs import megatron_vocab_parallel_logprobs
    from megatron_rl.policy.loss import policy_batch
    from megatron_rl.trainer.forward import forward_only

    samples = training_samples(count, ARCH.vocab_size, seed=seed)
    grid = pack_into_grid(samples, SEQ_LEN, 1, 1)  # every rank computes the same on one row
    batches = [policy_batch(mb) for mb in grid[0]]
    outputs = forward_only(
        model, batches, lambda logits, batch: megatron_vocab_parallel_logprobs(logits[0], batch.targets, temperature)[0]
    )
    per_sample = unpack([grid[0]], [[np.concatenate([[0.0], o.numpy()[:-1]]) for o in outputs]], len(samples))
    rng = np.random.default_rng(seed)
    noise = []
    for sample, logprobs in zip(samples, per_sample):
        e = np.where(sample.loss_mask, rng.normal(scale=perturbation_scale, size=len(sample)), 0.0)
        sample.inference_logprobs = np.where(sample.loss_mask, logprobs + e, 0.0).astype(np.float32)
        noise.append(e[sample.loss_mask])
    e = np.concatenate(noise)
    return samples, {"k1": float(e.mean()), "k3": float((np.expm1(-e) + e).mean())}


def policy_step(rank, world_size, arch, full, tp, cp, algorithm, perturbation_scale, temperature, lr=1e-3,
                sampler_temperature=None, pp=1, teacher_coef=0.0, top_k_coef=0.0):  # fmt: skip
    """One policy RL step (policy_update) on samples whose sampler log-probs are the policy's own
    at `sampler_temperature` (default `temperature`) plus a perturbation (and, with `teacher_coef`,
    teacher log-probabilities: the sampler's minus a seeded delta, and distillation's kl_penalty;
    with `top_k_coef`, a random teacher's top TOP_K and distillation's top_k_kl); returns (record,
    full parameters after the step, the perturbation's k1 / k3)."""
    from megatron.core import parallel_state

    from megatron_rl.config import AlgorithmConfig, OptimizerConfig
    from megatron_rl.data.packing import pack_minibatches
    from megatron_rl.models.builder import build_gpt_model
    from megatron_rl.models.sharding import gather_full_parameters, load_full_state_dict
    from megatron_rl.policy.update import UpdateSettings, policy_update
    from megatron_rl.trainer.optimizer import build_trainable

    parallel.initialize_model_parallel(tp=1, cp=1)
    probe = build_gpt_model(arch)
    load_full_state_dict(probe, full)
    samples, perturbation = _samples_with_policy_logprobs(probe, sampler_temperature or temperature, perturbation_scale)
    del probe
    if teacher_coef > 0:
        rng = np.random.default_rng(7)
        for sample in samples:
            delta = rng.normal(scale=0.3, size=len(sample))
            sample.teacher_logprobs = np.where(sample.loss_mask, sample.inference_logprobs - delta, 0.0).astype(np.float32)
    if top_k_coef > 0:
        add_teacher_top_k(samples, arch.vocab_size, TOP_K, seed=13)
    parallel.initialize_model_parallel(tp=tp, cp=cp, pp=pp)
    model = build_gpt_model(arch, tp=tp, cp=cp, pp=pp)
    load_full_state_dict(model, full)
    # adam_eps as in test_train_step: summation-order noise on near-zero gradients stays small.
    trainable = build_trainable(model, OptimizerConfig(lr=lr, grad_clip=1.0, adam_eps=1e-6), total_steps=20)
    config = AlgorithmConfig(**algorithm)
    dp = parallel_state.get_data_parallel_world_size()
    grid = pack_minibatches(samples, config.policy_minibatches, (1, 0), SEQ_LEN, dp, cp, teacher=teacher_coef > 0,
                            teacher_top_k=top_k_coef > 0)  # fmt: skip
    settings = UpdateSettings(config, temperature, loss_scale_factor=16, teacher_coef=teacher_coef,
                              teacher_top_k_coef=top_k_coef)  # fmt: skip
    record = policy_update(trainable, grid[parallel_state.get_data_parallel_rank()], settings)
    record["scheduler_steps"] = trainable.scheduler.num_steps
    return record, gather_full_parameters(model), perturbation


def teacher_step(rank, world_size, arch, full, coef):
    """One policy step, from the same weights, without and with distillation's kl_penalty (`coef`),
    on samples that carry teacher log-probabilities (the sampler's, the policy's own, minus a
    seeded delta on action tokens), packed into the policy's grid and sent through the codec.
    Returns (record without, record with, the plain k3 mean exp(-d) + d - 1 over action tokens,
    d = log pi - log pi_teacher)."""
    from megatron_rl.config import AlgorithmConfig, OptimizerConfig
    from megatron_rl.data.packing import pack_into_grid
    from megatron_rl.models.builder import build_gpt_model
    from megatron_rl.models.sharding import load_full_state_dict
    from megatron_rl.policy.update import UpdateSettings, policy_update
    from megatron_rl.trainer.optimizer import build_trainable
    from megatron_rl.transport import decode_grid_item, encode_grid_item

    parallel.initialize_model_parallel(tp=1, cp=1)
    model = build_gpt_model(arch)
    load_full_state_dict(model, full)
    samples, _ = _samples_with_policy_logprobs(model, 1.0, 0.0)
    del model
    rng = np.random.default_rng(5)
    gaps = []
    for sample in samples:
        delta = rng.normal(scale=0.3, size=len(sample))
        sample.teacher_logprobs = np.where(sample.loss_mask, sample.inference_logprobs - delta, 0.0).astype(np.float32)
        gaps.append((sample.inference_logprobs - sample.teacher_logprobs).astype(np.float64)[sample.loss_mask])
    d = np.concatenate(gaps)
    expected = float(np.mean(np.exp(-d) + d - 1.0))
    records = []
    for teacher_coef in (0.0, coef):
        row = pack_into_grid(samples, SEQ_LEN, 1, 1, teacher=teacher_coef > 0)[0]
        assert all((mb.teacher_logprobs is not None) == (teacher_coef > 0) for mb in row if not mb.is_dummy)
        row = decode_grid_item([bytes(f) for f in encode_grid_item(0, 0, row)], "test", 0, 0)
        model = build_gpt_model(arch)
        load_full_state_dict(model, full)
        trainable = build_trainable(model, OptimizerConfig(lr=1e-3, grad_clip=1.0, adam_eps=1e-6), total_steps=20)
        settings = UpdateSettings(AlgorithmConfig(type="ppo"), 1.0, loss_scale_factor=16, teacher_coef=teacher_coef)
        records.append(policy_update(trainable, row, settings))
    return records[0], records[1], expected


def teacher_top_k_step(rank, world_size, arch, full, coef):
    """One policy step, from the same weights, without and with distillation's top_k_kl (`coef`),
    on samples that carry a random teacher's top TOP_K, packed into the policy's grid and sent
    through the codec. Returns (record without, record with, the plain means over action tokens
    of KL_t and m_t on the model's full log-softmax before the step, the largest difference
    between the weights after the two steps)."""
    from megatron_rl.config import AlgorithmConfig, OptimizerConfig
    from megatron_rl.data.packing import pack_into_grid, unpack
    from megatron_rl.models.builder import build_gpt_model
    from megatron_rl.models.sharding import gather_full_parameters, load_full_state_dict
    from megatron_rl.policy.loss import policy_batch
    from megatron_rl.policy.update import UpdateSettings, policy_update
    from megatron_rl.trainer.forward import forward_only
    from megatron_rl.trainer.optimizer import build_trainable
    from megatron_rl.transport import decode_grid_item, encode_grid_item

    parallel.initialize_model_parallel(tp=1, cp=1)
    model = build_gpt_model(arch)
    load_full_state_dict(model, full)
    samples, _ = _samples_with_policy_logprobs(model, 1.0, 0.0)
    add_teacher_top_k(samples, arch.vocab_size, TOP_K, seed=17)
    grid = pack_into_grid(samples, SEQ_LEN, 1, 1)
    outputs = forward_only(model, [policy_batch(mb) for mb in grid[0]],
                           lambda logits, batch: torch.log_softmax(logits[0].double(), dim=-1))  # fmt: skip
    log_q = unpack(grid, [[o.detach().numpy() for o in outputs]], len(samples))  # [T, V]: position t predicts t + 1
    kl, mass = [], []
    for sample, student in zip(samples, log_q):
        for t in np.flatnonzero(sample.loss_mask):
            total, m = 0.0, 0.0
            for j in range(TOP_K):
                lp = float(sample.teacher_top_logprobs[t, j])
                total += np.exp(lp) * (lp - student[t - 1, sample.teacher_top_ids[t, j]])
                m += np.exp(lp)
            kl.append(total)
            mass.append(m)
    del model
    records, params = [], []
    for top_k_coef in (0.0, coef):
        row = pack_into_grid(samples, SEQ_LEN, 1, 1, teacher_top_k=top_k_coef > 0)[0]
        row = decode_grid_item([bytes(f) for f in encode_grid_item(0, 0, row)], "test", 0, 0, arch.vocab_size)
        model = build_gpt_model(arch)
        load_full_state_dict(model, full)
        trainable = build_trainable(model, OptimizerConfig(lr=1e-3, grad_clip=1.0, adam_eps=1e-6), total_steps=20)
        settings = UpdateSettings(AlgorithmConfig(type="ppo"), 1.0, loss_scale_factor=16, teacher_top_k_coef=top_k_coef)
        records.append(policy_update(trainable, row, settings))
        params.append(gather_full_parameters(model))
    moved = max(float((params[1][k] - params[0][k]).abs().max()) for k in params[0])
    return records[0], records[1], {"kl": float(np.mean(kl)), "mass": float(np.mean(mass))}, moved


def plain_train_step(rank, world_size, arch, full):
    """train_step (no mini-batches) on the samples `policy_step` builds with no perturbation."""
    from megatron_rl.config import AlgorithmConfig, OptimizerConfig
    from megatron_rl.data.packing import pack_into_grid
    from megatron_rl.models.builder import build_gpt_model
    from megatron_rl.models.sharding import gather_full_parameters, load_full_state_dict
    from megatron_rl.policy.loss import policy_loss_func
    from megatron_rl.trainer.optimizer import build_trainable
    from megatron_rl.trainer.step import train_step

    parallel.initialize_model_parallel()
    model = build_gpt_model(arch)
    load_full_state_dict(model, full)
    samples, _ = _samples_with_policy_logprobs(model, 1.0, 0.0)
    trainable = build_trainable(model, OptimizerConfig(lr=1e-3, grad_clip=1.0, adam_eps=1e-6), total_steps=20)
    grid = pack_into_grid(samples, SEQ_LEN, 1, 1)
    metrics = train_step(trainable, grid[0], policy_loss_func(AlgorithmConfig(type="sao")))
    return metrics, gather_full_parameters(model)


def mismatched_minibatches(rank, world_size, arch, full):
    """policy_update on grids cut into 3 mini-batches with policy_minibatches 2 (more) and 4
    (fewer, 12 samples), then on 2 samples cut into 2 with policy_minibatches 4 (legitimate:
    min(N, samples)). Returns (the two errors and the optimizer steps of the legitimate step,
    whether the weights changed after the refused steps and after the legitimate one)."""
    from megatron_rl.config import AlgorithmConfig, OptimizerConfig
    from megatron_rl.data.packing import pack_minibatches
    from megatron_rl.models.builder import build_gpt_model
    from megatron_rl.models.sharding import gather_full_parameters, load_full_state_dict
    from megatron_rl.policy.update import UpdateSettings, policy_update
    from megatron_rl.trainer.optimizer import build_trainable

    parallel.initialize_model_parallel()
    model = build_gpt_model(arch)
    load_full_state_dict(model, full)
    trainable = build_trainable(model, OptimizerConfig(lr=1e-3, grad_clip=1.0), total_steps=20)
    before = gather_full_parameters(model)
    samples = training_samples(12, arch.vocab_size, seed=11)
    errors = []
    for configured in (2, 4):
        settings = UpdateSettings(AlgorithmConfig(type="sao", policy_minibatches=configured), 1.0)
        try:
            policy_update(trainable, pack_minibatches(samples, 3, (1, 0), SEQ_LEN, 1)[0], settings)
        except ValueError as error:
            errors.append(str(error))
    refused = gather_full_parameters(model)
    changed = {"after the refused steps": any(not torch.equal(refused[k], before[k]) for k in before)}
    assert trainable.scheduler.num_steps == 0
    settings = UpdateSettings(AlgorithmConfig(type="sao", policy_minibatches=4), 1.0)
    record = policy_update(trainable, pack_minibatches(samples[:2], 4, (1, 0), SEQ_LEN, 1)[0], settings)
    after = gather_full_parameters(model)
    changed["after the step of 2 samples"] = any(not torch.equal(after[k], before[k]) for k in before)
    return (*errors, record["optimizer_steps"]), changed
