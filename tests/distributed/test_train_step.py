"""One train_step at TP / CP / DP layouts equals a single-process step on the same samples
(loss, metrics, updated weights), for GRPO, PPO and SAO losses and the critic's value loss.
Layouts with DP > 1 pack the samples differently and include masked dummy micro-batches."""

from __future__ import annotations

import pytest
import torch

from megatron_rl import parallel
from megatron_rl.models.builder import build_gpt_model
from megatron_rl.models.sharding import full_parameters, load_full_state_dict
from tests.support.ranks import DENSE, reference_weights
from tests.support.samples import training_samples
from tests.support.spawn import run_ranks

ARCH = DENSE.model_copy(update=dict(num_layers=2))


@pytest.fixture(scope="module")
def weights():
    return run_ranks(reference_weights, 1, ARCH, 5)[0]


def compare(weights, layouts, algorithm="sao", critic=False, count=7):
    ref_metrics, ref_params, _ = run_ranks(
        one_training_step, 1, ARCH, weights, 1, 1, algorithm, count, critic
    )[0]
    moved = max(float((ref_params[k] - weights[k]).abs().max()) for k in weights if k in ref_params)
    assert moved > 1e-4
    saw_dummies = False
    for tp, cp, world in layouts:
        for metrics, params, dummies in run_ranks(
            one_training_step, world, ARCH, weights, tp, cp, algorithm, count, critic
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
    ((plain, plain_params),) = run_ranks(kl_training_steps, 1, ARCH, weights, 1, 1, 0.0)
    ((kl, kl_params),) = run_ranks(kl_training_steps, 1, ARCH, weights, 1, 1, 0.5)
    # Step 0: policy = reference, so KL and its gradient are exactly zero.
    assert kl[0]["kl_ref_sum"] == 0.0 and kl[0]["loss"] == plain[0]["loss"]
    # Step 1: same weights as without KL; the loss adds 0.5 * mean KL over action tokens.
    assert kl[1]["kl_ref_sum"] > 0
    expected = plain[1]["loss"] + 0.5 * kl[1]["kl_ref_sum"] / kl[1]["num_tokens"]
    assert kl[1]["loss"] == pytest.approx(expected, rel=1e-6, abs=1e-9)
    assert any(not torch.equal(kl_params[n], plain_params[n]) for n in plain_params)  # KL pulls back
    for tp, cp, world in [(1, 1, 2), (2, 1, 2), (1, 2, 2)]:
        for records, params in run_ranks(kl_training_steps, world, ARCH, weights, tp, cp, 0.5):
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
        poisoned_then_clean_steps, 2, ARCH, weights, 1
    ):
        assert first["update_successful"] is False and first["skipped_steps"] == 1
        assert first["grad_norm"] is None
        for name, value in before.items():
            assert torch.equal(after_poison[name], value), name
        assert second["update_successful"] is True and second["skipped_steps"] == 1
        assert all(torch.isfinite(v).all() for v in after_clean.values())
        assert max(float((after_clean[k] - before[k]).abs().max()) for k in before) > 1e-5


def test_the_finite_check_makes_no_tensor_of_the_gradients_size():
    """all_finite's gradient check: NaN and inf anywhere are found, and the check allocates a few
    bytes, not a bool mask of the buffer (measured: isfinite(g).all() makes one of 1 B per
    element)."""
    from megatron_rl.trainer.step import gradients_finite
    from tests.support.memory import AllocationTracker

    grads = [torch.randn(1 << 20), None, torch.randn(1000)]
    with AllocationTracker() as tracker:
        assert gradients_finite(grads)
    assert tracker.peak < 1024
    with AllocationTracker() as mask:
        bool(torch.isfinite(grads[0]).all())
    assert mask.peak >= 1 << 20  # the tracker sees a mask when there is one
    for bad in (float("nan"), float("inf"), float("-inf")):
        grads[2][123] = bad
        assert not gradients_finite(grads)
        grads[2][123] = 0.0


@pytest.fixture(scope="module")
def without_recompute(weights):
    return run_ranks(recompute_step, 1, ARCH, weights, {})[0]


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
    for metrics, params in run_ranks(recompute_step, 1, ARCH, weights, fields):
        for key, value in reference[0].items():
            if isinstance(value, float):
                assert metrics[key] == pytest.approx(value, rel=1e-6, abs=1e-7), key
        for name, value in reference[1].items():
            torch.testing.assert_close(params[name], value, atol=1e-6, rtol=0, msg=name)


# Rank functions: module-level, so that the spawned ranks can import them.


def one_training_step(rank, world_size, arch, full, tp, cp, algorithm_type, count=7, critic=False):
    """Packs `count` samples for this layout, runs one train_step; returns (metrics, params)."""
    from megatron.core import parallel_state

    from megatron_rl.config import AlgorithmConfig, OptimizerConfig
    from megatron_rl.critic.loss import value_loss_func
    from megatron_rl.data.packing import pack_into_grid
    from megatron_rl.models.sharding import gather_full_parameters
    from megatron_rl.models.value_model import build_value_model
    from megatron_rl.policy.loss import policy_loss_func
    from megatron_rl.trainer.optimizer import build_trainable
    from megatron_rl.trainer.step import train_step

    parallel.initialize_model_parallel(tp=tp, cp=cp)
    if critic:
        model = build_value_model(arch, tp=tp, cp=cp, head_init_std=0.1)
    else:
        model = build_gpt_model(arch, tp=tp, cp=cp)
    reference = full_parameters(model) if critic else {}
    load_full_state_dict(model, {**reference, **full})
    # Adam's first step is lr * g / (|g| + eps): output-layer rows of unseen tokens have |g| near
    # 1e-9, where summation-order noise (CP splits the sum differently) would be scaled up to a
    # visible fraction of lr with the default eps 1e-8. Metrics and larger gradients agree to ~1e-7.
    optimizer_config = OptimizerConfig(lr=1e-3, weight_decay=0.01, grad_clip=1.0, adam_eps=1e-6)
    trainable = build_trainable(model, optimizer_config, total_steps=10)
    dp = parallel_state.get_data_parallel_world_size()
    grid = pack_into_grid(training_samples(count, arch.vocab_size), 64, dp, cp)
    if critic:
        loss_func = value_loss_func(value_clip=0.5)
    else:
        loss_func = policy_loss_func(AlgorithmConfig(type=algorithm_type))
    metrics = train_step(trainable, grid[parallel_state.get_data_parallel_rank()], loss_func)
    dummies = sum(mb.is_dummy for row in grid for mb in row)
    return metrics, gather_full_parameters(model), dummies

def kl_training_steps(rank, world_size, arch, full, tp, cp, kl_coef, steps=2):
    """SAO steps with KL to a frozen reference (the initial weights); per-step metrics and the
    final full parameters."""
    from megatron.core import parallel_state

    from megatron_rl.config import AlgorithmConfig, OptimizerConfig
    from megatron_rl.data.packing import pack_into_grid
    from megatron_rl.models.sharding import gather_full_parameters
    from megatron_rl.policy.loss import policy_loss_func
    from megatron_rl.trainer.optimizer import build_trainable
    from tests.support.training import train_step_with_reference

    parallel.initialize_model_parallel(tp=tp, cp=cp)
    model = build_gpt_model(arch, tp=tp, cp=cp)
    load_full_state_dict(model, full)
    reference = build_gpt_model(arch, tp=tp, cp=cp)
    load_full_state_dict(reference, full)
    reference.requires_grad_(False)
    trainable = build_trainable(model, OptimizerConfig(lr=1e-3, grad_clip=1.0, adam_eps=1e-6), total_steps=10)
    dp = parallel_state.get_data_parallel_world_size()
    loss_func = policy_loss_func(AlgorithmConfig(type="sao", kl_coef=kl_coef))
    records = []
    for step in range(steps):
        grid = pack_into_grid(training_samples(6, arch.vocab_size, seed=step), 64, dp, cp)
        metrics = train_step_with_reference(
            trainable,
            grid[parallel_state.get_data_parallel_rank()],
            loss_func,
            reference if kl_coef > 0 else None,
        )
        records.append(
            {k: metrics[k] for k in ("loss", "num_tokens", "grad_norm")}
            | {"kl_ref_sum": metrics.get("kl_ref_sum", 0.0)}
        )
    return records, gather_full_parameters(model)

def poisoned_then_clean_steps(rank, world_size, arch, full, poison_rank):
    """A step whose loss is NaN on `poison_rank` only, then a clean step. Returns (metrics of
    both, parameters before, after the poisoned step, after the clean step)."""
    from megatron.core import parallel_state

    from megatron_rl.config import AlgorithmConfig, OptimizerConfig
    from megatron_rl.data.packing import pack_into_grid
    from megatron_rl.models.sharding import gather_full_parameters
    from megatron_rl.policy.loss import policy_loss_func
    from megatron_rl.trainer.optimizer import build_trainable
    from megatron_rl.trainer.step import RoleLoss, train_step

    parallel.initialize_model_parallel(tp=1, cp=1)
    model = build_gpt_model(arch, tp=1, cp=1)
    load_full_state_dict(model, full)
    trainable = build_trainable(model, OptimizerConfig(lr=1e-3, grad_clip=1.0), total_steps=10)
    dp = parallel_state.get_data_parallel_world_size()
    grid = pack_into_grid(training_samples(6, arch.vocab_size), 64, dp, 1)
    clean = policy_loss_func(AlgorithmConfig(type="sao"))

    def poisoned_loss(output, batch):
        loss, metrics = clean(output, batch)
        return (loss * float("nan") if rank == poison_rank else loss), metrics

    poisoned = RoleLoss(clean.batch, poisoned_loss)

    before = gather_full_parameters(model)
    rows = grid[parallel_state.get_data_parallel_rank()]
    first = train_step(trainable, rows, poisoned)
    after_poison = gather_full_parameters(model)
    second = train_step(trainable, rows, clean)
    return first, second, before, after_poison, gather_full_parameters(model)

def recompute_step(rank, world_size, arch, full, recompute_fields, tp=1):
    """One SAO train_step on a model built with `recompute_fields` (TransformerConfig recompute
    settings); returns (metrics, full parameters after the step)."""
    from megatron.core import parallel_state

    from megatron_rl.config import AlgorithmConfig, OptimizerConfig
    from megatron_rl.data.packing import pack_into_grid
    from megatron_rl.models.sharding import gather_full_parameters
    from megatron_rl.policy.loss import policy_loss_func
    from megatron_rl.trainer.optimizer import build_trainable
    from megatron_rl.trainer.step import train_step

    parallel.initialize_model_parallel(tp=tp)
    model = build_gpt_model(arch, tp=tp, **recompute_fields)
    load_full_state_dict(model, full)
    trainable = build_trainable(model, OptimizerConfig(lr=1e-3, grad_clip=1.0, adam_eps=1e-6), total_steps=10)
    grid = pack_into_grid(training_samples(6, arch.vocab_size, seed=3), 64, parallel_state.get_data_parallel_world_size())
    metrics = train_step(trainable, grid[parallel_state.get_data_parallel_rank()], policy_loss_func(AlgorithmConfig(type="sao")))
    return metrics, gather_full_parameters(model)
