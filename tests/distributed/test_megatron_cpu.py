"""megatron-core on CPU/gloo through megatron_rl.compat: parallel layouts equal their references.

Each test spawns fresh gloo ranks (megatron_rl.testing.spawn) and compares with a single-process
run on the same full weights.
"""

from __future__ import annotations

import pytest
import torch

from megatron_rl.testing.spawn import run_ranks
from tests.distributed import megatron_workers as w


@pytest.fixture(scope="module")
def dense_weights():
    return run_ranks(w.reference_weights, 1, w.DENSE, 7)[0]


@pytest.fixture(scope="module")
def moe_weights():
    return run_ranks(w.reference_weights, 1, w.MOE, 11)[0]


def test_tp2_logits_equal_tp1(dense_weights):
    reference = run_ranks(w.logits, 1, w.DENSE, dense_weights)[0]
    for rank_logits in run_ranks(w.logits, 2, w.DENSE, dense_weights, 2):
        assert rank_logits.shape == reference.shape == (2, 24, w.DENSE.vocab_size)
        torch.testing.assert_close(rank_logits, reference, atol=1e-5, rtol=0)


def test_ep2_moe_equals_ep1(moe_weights):
    reference = run_ranks(w.logits, 1, w.MOE, moe_weights)[0]
    for rank_logits in run_ranks(w.logits, 2, w.MOE, moe_weights, 1, 2):
        torch.testing.assert_close(rank_logits, reference, atol=1e-5, rtol=0)
    # The comparison is not vacuous: moving expert 3's weights onto expert 0 changes the output.
    swapped = dict(moe_weights)
    for key in [k for k in moe_weights if ".local_experts.0." in k]:
        swapped[key] = moe_weights[key.replace(".local_experts.0.", ".local_experts.3.")]
    changed = run_ranks(w.logits, 2, w.MOE, swapped, 1, 2)[0]
    assert (changed - reference).abs().max() > 1e-3


@pytest.mark.slow
def test_tp2_ep2_moe_equals_reference_with_sequence_parallel(moe_weights):
    """4 ranks: TP=2 x EP=2 (sequence parallel, uneven expert all-gather on gloo)."""
    reference = run_ranks(w.logits, 1, w.MOE, moe_weights)[0]
    for rank_logits in run_ranks(w.logits, 4, w.MOE, moe_weights, 2, 2):
        torch.testing.assert_close(rank_logits, reference, atol=1e-5, rtol=0)
    # Replicated weights (norms, router) get the TP=1 gradient after finalize_model_grads: the
    # sequence-parallel tag on torch norms makes their gradient sum over TP.
    ref_loss, ref_grads = run_ranks(w.train_loss_and_grads, 1, w.MOE, moe_weights)[0]
    for loss, grads in run_ranks(w.train_loss_and_grads, 4, w.MOE, moe_weights, 2, 2):
        torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=0)
        norm_names = [n for n in grads if "layernorm" in n]
        assert any("input_layernorm" in n for n in norm_names) and any("k_layernorm" in n for n in norm_names)
        for name in norm_names:
            torch.testing.assert_close(grads[name], ref_grads[name], atol=1e-5, rtol=1e-4, msg=name)


def test_pp2_loss_equals_pp1(dense_weights):
    ref_losses, ref_grad_sq = run_ranks(w.pipeline_losses, 1, w.DENSE, dense_weights, 1)[0]
    stages = run_ranks(w.pipeline_losses, 2, w.DENSE, dense_weights, 2)
    last_stage_losses = stages[1][0]
    assert len(last_stage_losses) == len(ref_losses) == 3
    torch.testing.assert_close(torch.stack(last_stage_losses), torch.stack(ref_losses), atol=1e-6, rtol=0)
    # Gradients: both stages together carry the PP=1 model's gradient norm.
    torch.testing.assert_close(stages[0][1] + stages[1][1], ref_grad_sq, atol=1e-5, rtol=1e-5)


def test_distributed_optimizer_step_equals_plain_adamw(dense_weights):
    lr, weight_decay, steps = 1e-2, 0.1, 2
    ranks = run_ranks(w.distributed_optimizer_step, 2, w.DENSE, dense_weights, lr, weight_decay, steps)
    reference = run_ranks(w.plain_adamw_steps, 1, w.DENSE, dense_weights, lr, weight_decay, 2, steps)[0]
    assert set(ranks[0]) == set(reference)
    moved = max((reference[k] - dense_weights[k]).abs().max() for k in reference)
    assert moved > 1e-3  # the step really changed the weights
    for params in ranks:
        for name, value in reference.items():
            torch.testing.assert_close(params[name], value, atol=2e-6, rtol=0, msg=name)


def test_dist_checkpoint_saved_at_tp2_loads_at_tp1(dense_weights, tmp_path):
    (tmp_path / "ckpt").mkdir()
    saved = run_ranks(w.save_checkpoint_then_logits, 2, w.DENSE, dense_weights, 2, str(tmp_path / "ckpt"))
    loaded = run_ranks(w.load_checkpoint_then_logits, 1, w.DENSE, 1, str(tmp_path / "ckpt"))[0]
    torch.testing.assert_close(loaded, saved[0], atol=1e-5, rtol=0)
    # The freshly initialised TP=1 model (different seed) is far from the checkpoint before loading.
    fresh = run_ranks(w.logits, 1, w.DENSE, run_ranks(w.reference_weights, 1, w.DENSE, 999)[0])[0]
    assert (fresh - loaded).abs().max() > 1e-2


def test_distributed_optimizer_checkpoint_resume_is_exact(dense_weights, tmp_path):
    """Save model + distributed-optimizer state after 2 steps (fully_reshardable format), load in
    fresh processes, train 2 more steps: same losses and weights as an uninterrupted run."""
    lr = 1e-2
    uninterrupted = run_ranks(w.optimizer_checkpoint, 2, w.DENSE, dense_weights, lr, str(tmp_path), "plain")
    run_ranks(w.optimizer_checkpoint, 2, w.DENSE, dense_weights, lr, str(tmp_path), "save")
    resumed = run_ranks(w.optimizer_checkpoint, 2, w.DENSE, dense_weights, lr, str(tmp_path), "load")
    for (losses, params), (ref_losses, ref_params) in zip(resumed, uninterrupted):
        assert torch.equal(torch.stack(losses), torch.stack(ref_losses))
        for name, value in ref_params.items():
            assert torch.equal(params[name], value), name
