"""MoE at TP = 2 runs sequence parallel: the orchestrator pads both grids for it (every packed row
a multiple of cp x tp) and a critic at TP = 2 trains on the orchestrator's critic grid with the
loss and value-head gradient of one process (before: rows of odd length, and megatron's
sequence-parallel scatter asserted)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoTokenizer

from megatron_rl import parallel
from megatron_rl.config import parse_config
from megatron_rl.envs import make_environment
from megatron_rl.orchestrator.loop import Orchestrator, Timeouts
from megatron_rl.orchestrator.rollouts import PromptEncoder
from megatron_rl.orchestrator.state import OrchestratorState
from tests.support.orchestrator import (
    FakeClient,
    FakeCritic,
    FakePolicy,
    FakeWeights,
    orchestrator_config,
)
from tests.support.ranks import DENSE, reference_weights
from tests.support.shipped import ShippedSamples
from tests.support.spawn import run_ranks

MOE = DENSE.model_copy(update=dict(num_layers=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                   vocab_size=512))  # fmt: skip


def orchestrated_grids(tiny_models):
    """One PPO step of the orchestrator (fake rollouts and critic) for a MoE policy and critic at
    TP = 2 with two policy mini-batches; returns (critic grid, policy grid, shipped samples)."""
    arch = MOE.model_dump(exclude_none=True)
    resolved = orchestrator_config("ppo", group_size=2, num_steps=1, max_completion_tokens=23)
    data = resolved.model_dump(exclude={"layout"}, exclude_none=True)
    data["model"] = {"architecture": arch, "seq_len": 256, "tp": 2}
    data["value"]["model"] = {"architecture": arch, "seq_len": 256, "tp": 2}
    data["algorithm"]["policy_minibatches"] = 2
    data["deployment"].update(policy_gpus=2, num_value_gpus_per_train_node=2)
    resolved = parse_config(data)
    assert resolved.layout.policy.sp == 2 and resolved.layout.critic.sp == 2
    events, weights = [], FakeWeights()
    critic, policy = FakeCritic(events), FakePolicy(weights, events, 0.0)
    encoder = PromptEncoder(AutoTokenizer.from_pretrained(str(tiny_models["qwen3"])))
    orchestrator = ShippedSamples().attach(Orchestrator(
        resolved, make_environment("procedural", None, 0), encoder, FakeClient(weights), weights, critic,
        policy.send, OrchestratorState(None), lambda record: None, Timeouts(batch_s=60, critic_s=60, weights_s=60),
    ))  # fmt: skip
    assert asyncio.run(orchestrator.run()) == 1
    return critic.grids[0], policy.grids[0], [s for _, s in orchestrator.shipped.items]


def test_both_grids_pad_for_sequence_parallel_and_the_critic_trains_at_tp2(tiny_models):
    critic_grid, policy_grid, samples = orchestrated_grids(tiny_models)
    rows = [mb for grid in (critic_grid, policy_grid) for rank in grid for mb in rank]
    assert all(mb.num_tokens % 2 == 0 for mb in rows)
    assert any(s.num_action_tokens and len(s) % 2 for s in samples)  # odd samples: padding was needed
    assert {mb.minibatch for rank in policy_grid for mb in rank} == {0, 1}
    full = run_ranks(reference_weights, 1, MOE, 7)[0]
    ((single, single_grads),) = run_ranks(critic_step, 1, full, None, samples, 1)
    for tp2, grads in run_ranks(critic_step, 2, full, critic_grid[0], samples, 2):
        assert tp2["loss"] == pytest.approx(single["loss"], rel=1e-5)
        assert tp2["num_tokens"] == single["num_tokens"]
        for name, grad in single_grads.items():  # the head's gradient: not multiplied by tp
            torch.testing.assert_close(grads[name], grad, atol=1e-6, rtol=1e-4, msg=name)


# Rank functions: module-level, so that the spawned ranks can import them.


def critic_step(rank, world_size, full, micro_batches, samples, tp):
    """One value-loss forward/backward (no optimizer step) of a MoE critic at `tp` on
    `micro_batches` (None: the samples packed for one process); (metrics, value-head grads)."""
    from megatron_rl.critic.loss import critic_batch, value_loss_func
    from megatron_rl.data.packing import pack_into_grid
    from megatron_rl.models.sharding import full_parameters, load_full_state_dict
    from megatron_rl.models.value_model import build_value_model

    parallel.initialize_model_parallel(tp=tp)
    model = build_value_model(MOE, tp=tp, head_init_std=0.5, head_init_seed=3)
    load_full_state_dict(model, {**full_parameters(model), **{k: v for k, v in full.items() if "output_layer" not in k}})
    micro_batches = micro_batches if micro_batches is not None else pack_into_grid(samples, 256, 1)[0]
    loss_func, total, tokens = value_loss_func(), 0.0, 0
    for mb in micro_batches:
        batch = critic_batch(mb)
        values = model(batch.input_ids, batch.position_ids, attention_mask=None,
                       packed_seq_params=_packed(batch))  # fmt: skip
        loss_sum, _ = loss_func(values, batch)
        loss_sum.backward()
        total += float(loss_sum)
        tokens += int(batch.loss_mask.sum())
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if "value_head" in name}
    return {"loss": total / tokens, "num_tokens": tokens}, grads


def _packed(batch):
    from megatron_rl.models.attention import packed_seq_params

    return packed_seq_params(batch.cu_seqlens, batch.total_tokens)
