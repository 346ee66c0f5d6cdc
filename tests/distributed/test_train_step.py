"""One train_step at TP / CP / DP layouts equals a single-process step on the same samples
(loss, metrics, updated weights), for GRPO, PPO and SAO losses and the critic's value loss.
Layouts with DP > 1 pack the samples differently and include masked dummy micro-batches."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.testing.spawn import run_ranks
from tests.distributed import megatron_workers as w

ARCH = w.DENSE.model_copy(update=dict(num_layers=2))


@pytest.fixture(scope="module")
def weights():
    return run_ranks(w.reference_weights, 1, ARCH, 5)[0]


def compare(weights, layouts, algorithm="sao", critic=False, count=7):
    ref_metrics, ref_params, _ = run_ranks(
        w.one_training_step, 1, ARCH, weights, 1, 1, algorithm, count, critic
    )[0]
    moved = max(float((ref_params[k] - weights[k]).abs().max()) for k in weights if k in ref_params)
    assert moved > 1e-4
    saw_dummies = False
    for tp, cp, world in layouts:
        for metrics, params, dummies in run_ranks(
            w.one_training_step, world, ARCH, weights, tp, cp, algorithm, count, critic
        ):
            saw_dummies |= dummies > 0
            assert metrics["num_tokens"] == ref_metrics["num_tokens"]
            assert metrics["update_successful"] is True and ref_metrics["update_successful"] is True
            for key, value in ref_metrics.items():
                if key != "update_successful":
                    assert metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (tp, cp, world, key)
            for name, value in ref_params.items():
                torch.testing.assert_close(
                    params[name], value, atol=1e-5, rtol=0, msg=f"{name} tp={tp} cp={cp}"
                )
    return saw_dummies


@pytest.mark.parametrize("algorithm", ["grpo", "ppo", "sao"])
def test_policy_step_dp2_and_tp2_equal_one_process(weights, algorithm):
    compare(weights, [(1, 1, 2), (2, 1, 2)], algorithm, count=5)


def test_a_rank_with_only_a_dummy_micro_batch_changes_nothing(weights):
    # One sample over DP=2: rank 1 trains on a masked dummy and must contribute exactly zero.
    assert compare(weights, [(1, 1, 2)], "sao", count=1)


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["grpo", "ppo", "sao"])
def test_policy_step_tp2_cp2_and_cp2_dp2_equal_one_process(weights, algorithm):
    compare(weights, [(2, 2, 4), (1, 2, 4)], algorithm)


def test_critic_step_dp2_and_cp2_equal_one_process(weights):
    compare(weights, [(1, 1, 2), (1, 2, 2)], critic=True, count=5)


def test_kl_to_reference_policy(weights):
    ((plain, plain_params),) = run_ranks(w.kl_training_steps, 1, ARCH, weights, 1, 1, 0.0)
    ((kl, kl_params),) = run_ranks(w.kl_training_steps, 1, ARCH, weights, 1, 1, 0.5)
    # Step 0: policy = reference, so KL and its gradient are exactly zero.
    assert kl[0]["kl_ref_sum"] == 0.0 and kl[0]["loss"] == plain[0]["loss"]
    # Step 1: same weights as without KL; the loss adds 0.5 * mean KL over action tokens.
    assert kl[1]["kl_ref_sum"] > 0
    expected = plain[1]["loss"] + 0.5 * kl[1]["kl_ref_sum"] / kl[1]["num_tokens"]
    assert kl[1]["loss"] == pytest.approx(expected, rel=1e-6, abs=1e-9)
    assert any(not torch.equal(kl_params[n], plain_params[n]) for n in plain_params)  # KL pulls back
    for tp, cp, world in [(1, 1, 2), (2, 1, 2), (1, 2, 2)]:
        for records, params in run_ranks(w.kl_training_steps, world, ARCH, weights, tp, cp, 0.5):
            for got, ref in zip(records, kl):
                for key, value in ref.items():
                    assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-7), (tp, cp, key)
            for name, value in kl_params.items():
                torch.testing.assert_close(
                    params[name], value, atol=1e-5, rtol=0, msg=f"{name} tp={tp} cp={cp}"
                )


def test_a_non_finite_loss_on_one_rank_skips_the_step_on_every_rank(weights):
    """NaN loss on DP rank 1 only: no rank writes NaN into its weights, every rank reports the
    skipped step, and the next clean step trains normally."""
    for first, second, before, after_poison, after_clean in run_ranks(
        w.poisoned_then_clean_steps, 2, ARCH, weights, 1
    ):
        assert first["update_successful"] is False and first["skipped_steps"] == 1
        assert first["grad_norm"] is None
        for name, value in before.items():
            assert torch.equal(after_poison[name], value), name
        assert second["update_successful"] is True and second["skipped_steps"] == 1
        assert all(torch.isfinite(v).all() for v in after_clean.values())
        assert max(float((after_clean[k] - before[k]).abs().max()) for k in before) > 1e-5


@pytest.fixture(scope="module")
def without_recompute(weights):
    return run_ranks(w.recompute_step, 1, ARCH, weights, {})[0]


@pytest.mark.parametrize(
    "fields",
    [
        {"recompute_granularity": "selective"},
        {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
        {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 1},
    ],
)
def test_recomputation_changes_nothing_but_memory(weights, without_recompute, fields):
    """model.recompute: a training step with activation recomputation gives the loss, metrics and
    updated weights of the step without it (megatron's recompute, on CPU)."""
    reference = without_recompute
    for metrics, params in run_ranks(w.recompute_step, 1, ARCH, weights, fields):
        for key, value in reference[0].items():
            if isinstance(value, float):
                assert metrics[key] == pytest.approx(value, rel=1e-6, abs=1e-7), key
        for name, value in reference[1].items():
            torch.testing.assert_close(params[name], value, atol=1e-6, rtol=0, msg=name)
