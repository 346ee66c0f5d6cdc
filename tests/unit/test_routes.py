"""Routing replay's routes from the sample to the policy trainer's grid item: the sample's checks,
packing (padding routes, the critic's grid without them), the grid codec, and the config rule."""

from __future__ import annotations

import asyncio
import base64
import json
from dataclasses import replace

import numpy as np
import pytest
from transformers import AutoTokenizer

from megatron_rl.config import ConfigError, parse_config
from megatron_rl.data.packing import PackingError, pack_into_grid, pack_minibatches
from megatron_rl.data.types import TrainingSample, padding_routes, route_dtype
from megatron_rl.envs import make_environment
from megatron_rl.inference.rollout import (
    Completion,
    RolloutClient,
    RolloutError,
    SamplingParams,
    TokenTrajectory,
)
from megatron_rl.orchestrator.rollouts import PromptEncoder
from megatron_rl.orchestrator.state import OrchestratorState
from megatron_rl.transport import TransportError, decode_grid_item, encode_grid_item
from tests.support.configs import ARCH, base
from tests.support.routed_vllm import encode_routes
from tests.support.samples import training_samples

LAYERS, TOPK, EXPERTS = 3, 2, 8


def routed_samples(count: int = 10, seed: int = 0) -> list[TrainingSample]:
    """Training samples with random routes for every token but the last (as vLLM returns them)."""
    rng = np.random.default_rng(seed)
    samples = training_samples(count, 100, seed=seed)
    for sample in samples:
        choices = np.argsort(rng.random((len(sample) - 1, LAYERS, EXPERTS)), axis=-1)[..., :TOPK]
        sample.routes = choices.astype(np.uint8)
    return samples


def test_route_dtype_is_the_smallest_that_holds_the_experts():
    assert route_dtype(128) == np.uint8 and route_dtype(256) == np.uint8
    assert route_dtype(257) == np.uint16 and route_dtype(65536) == np.uint16
    with pytest.raises(ValueError, match="70000 experts do not fit"):
        route_dtype(70000)
    assert padding_routes(2, 3, 4).tolist() == [[[0, 1, 2, 3]] * 3] * 2


@pytest.mark.parametrize(
    "routes,problem",
    [
        (np.zeros((6, 3, 2), np.uint8), "routes of shape \\(6, 3, 2\\)"),  # more rows than tokens
        (np.zeros((4, 2), np.uint8), "routes of shape \\(4, 2\\)"),
        (np.zeros((4, 3, 2), np.int64), "routes of shape \\(4, 3, 2\\) and dtype int64"),
    ],
)
def test_a_sample_refuses_routes_it_cannot_hold(routes, problem):
    with pytest.raises(ValueError, match=f"TrainingSample\\(group 4, branch 1\\): {problem}"):
        TrainingSample(token_ids=np.arange(5), loss_mask=np.ones(5, bool), inference_logprobs=np.zeros(5),
                       reward=0.0, group_id=4, branch_index=1, routes=routes)  # fmt: skip


def test_the_policy_grid_carries_each_samples_routes_and_padding_routes_elsewhere():
    samples = routed_samples()
    grid = pack_into_grid(samples, 64, 2, 2, sequence_parallel_size=2, routes=True)
    seen = set()
    for mb in (mb for row in grid for mb in row):
        if mb.is_dummy:
            assert mb.routes is None and mb.routed is None
            continue
        assert mb.routes.shape == (mb.num_tokens, LAYERS, TOPK) and mb.routes.dtype == np.uint8
        for start, end in zip(mb.cu_seqlens[:-1], mb.cu_seqlens[1:]):
            sample = samples[int(mb.sample_index[start])]
            seen.add(int(mb.sample_index[start]))
            np.testing.assert_array_equal(mb.routes[start : end - 1], sample.routes)
            assert mb.routed[start : end - 1].all() and not mb.routed[end - 1]
        unrouted = ~mb.routed
        np.testing.assert_array_equal(mb.routes[unrouted], padding_routes(int(unrouted.sum()), LAYERS, TOPK))
    assert seen == set(range(len(samples)))
    # The critic's grid (and a policy grid without replay) never carries routes.
    assert all(mb.routes is None and mb.routed is None for row in pack_into_grid(samples, 64, 2) for mb in row)
    minibatched = pack_minibatches(samples, 3, (0, 1), 64, 1, routes=True)
    assert {mb.minibatch for mb in minibatched[0]} == {0, 1, 2}
    assert all(mb.routes is not None for mb in minibatched[0] if not mb.is_dummy)


def test_packing_refuses_a_sample_without_routes_or_of_another_shape():
    samples = routed_samples(4)
    samples[2].routes = None
    with pytest.raises(PackingError, match="sample 2 \\(group 2, branch 0\\) has no routes"):
        pack_into_grid(samples, 256, 1, routes=True)
    samples = routed_samples(4)
    samples[1].routes = samples[1].routes[:, :2]
    with pytest.raises(PackingError, match="routes of different layers, top-k or dtype"):
        pack_into_grid(samples, 256, 1, routes=True)


def test_routes_cross_the_grid_codec_byte_exact_and_bad_routes_are_refused():
    row = pack_into_grid(routed_samples(), 64, 1, routes=True)[0]
    decoded = decode_grid_item([bytes(f) for f in encode_grid_item(3, 0, row)], "test", 3, 0, num_experts=EXPERTS)
    for got, sent in zip(decoded, row):
        assert got.routes.tobytes() == sent.routes.tobytes() and got.routes.shape == sent.routes.shape
        assert got.routed.tobytes() == sent.routed.tobytes()
    wide = [replace(mb, routes=mb.routes.astype(np.uint16)) for mb in row]
    assert decode_grid_item([bytes(f) for f in encode_grid_item(3, 0, wide)], "test", 3, 0)[0].routes.dtype == np.uint16

    def refused(edit, message, num_experts=EXPERTS):
        edited = [replace(mb, **edit(mb)) for mb in row]
        with pytest.raises(TransportError, match=message):
            decode_grid_item([bytes(f) for f in encode_grid_item(3, 0, edited)], "test", 3, 0, num_experts=num_experts)

    refused(lambda mb: {"routed": None}, "arrays missing \\['routed'\\]")
    refused(lambda mb: {"routes": mb.routes.astype(np.int64)}, "array routes: unexpected dtype 'int64'")
    refused(lambda mb: {"routes": mb.routes[:, 0].copy()}, "array routes: impossible shape")
    refused(lambda mb: {"routes": mb.routes[:-1].copy()}, "array routes: .* entries, input_ids has")
    refused(lambda mb: {"routes": np.full_like(mb.routes, 1)}, "array routes: token 0 repeats an expert")
    # a dense layer's routes are all 0 (vLLM's capture of DeepSeek-V3's and GLM-4.5's first layers): accepted
    dense_first = [replace(mb, routes=mb.routes.copy()) for mb in row]
    for mb in dense_first:
        mb.routes[:, 0] = 0
    decoded = decode_grid_item([bytes(f) for f in encode_grid_item(3, 0, dense_first)], "test", 3, 0, num_experts=EXPERTS)
    assert all(not got.routes[:, 0].any() for got in decoded)
    dense_first[0].routes[0, 1, :] = 2  # but one repeated expert in a routed layer is not
    with pytest.raises(TransportError, match="array routes: token 0 repeats an expert"):
        decode_grid_item([bytes(f) for f in encode_grid_item(3, 0, dense_first)], "test", 3, 0, num_experts=EXPERTS)
    refused(lambda mb: {"routes": mb.routes}, "array routes: expert 7 of a model with 4 experts", num_experts=4)


def test_routing_replay_needs_a_mixture_of_experts_policy():
    data = base("grpo")
    data["algorithm"]["routing_replay"] = "replay"
    with pytest.raises(ConfigError) as info:
        parse_config(data, source="test.yaml")
    assert "algorithm.routing_replay: 'replay' needs a mixture-of-experts policy; this one is dense" in str(info.value)
    moe = {**ARCH, "family": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    for mode in ("measure", "replay"):
        data = base("grpo")
        data["model"]["architecture"] = moe
        data["algorithm"]["routing_replay"] = mode
        assert parse_config(data).algorithm.routing_replay == mode
    data["inference"]["backend"] = "vllm-cpu"
    with pytest.raises(ConfigError, match="algorithm.routing_replay: 'replay' needs vLLM to return routed experts, "
                                          "which inference.backend 'vllm-cpu' cannot"):  # fmt: skip
        parse_config(data)
    data["algorithm"]["routing_replay"] = "sometimes"
    with pytest.raises(ConfigError, match="algorithm.routing_replay"):
        parse_config(data)


def _reply(routed_experts, tokens=(5, 6, 7)) -> bytes:
    choice = {"token_ids": list(tokens), "logprobs": {"token_logprobs": [-1.0] * len(tokens)}, "finish_reason": "stop",
              "routed_experts": routed_experts}  # fmt: skip
    return json.dumps({"choices": [choice]}).encode()


def test_the_rollout_client_asks_for_routes_and_refuses_replies_that_cannot_be_them():
    client = RolloutClient("http://router:1", "policy")
    sampling = SamplingParams(max_tokens=3, routed_experts=EXPERTS)
    body = client._body([1, 2, 3, 4], sampling, None, None, None, routes_start=2)
    assert body["routed_experts_prompt_start"] == 2
    assert "routed_experts_prompt_start" not in client._body([1, 2], SamplingParams(), None, None, None)
    # 4 prompt tokens from position 2, 3 sampled: routes of 2 + 3 - 1 = 4 tokens.
    good = np.argsort(np.random.default_rng(0).random((4, LAYERS, EXPERTS)), -1)[..., :TOPK].astype(np.int32)
    completion = client._parse(_reply(encode_routes(good)), 0, "w", routes=(2, EXPERTS))
    assert completion.routes.dtype == np.uint8 and completion.routes.tolist() == good.tolist()

    def refused(payload, message):
        with pytest.raises(RolloutError, match=message):
            client._parse(payload, 0, "http://w:1", routes=(2, EXPERTS))

    refused(_reply(None), "http://w:1: the reply has no routed_experts .*--enable-return-routed-experts")
    refused(_reply("not base64!"), "routed_experts is not a base64 .npy array")
    refused(_reply(base64.b64encode(b"plain bytes").decode()), "routed_experts is not a base64 .npy array")
    refused(_reply(encode_routes(good[:3])), "routed_experts of shape \\(3, 3, 2\\) .* expected integer experts of 4 tokens")
    refused(_reply(encode_routes(good.astype(np.float32))), "dtype float32")
    refused(_reply(encode_routes(good + EXPERTS)), "names experts .*; the policy has 8")
    asyncio.run(client.close())


def test_a_trajectory_joins_its_turns_routes():
    trajectory = TokenTrajectory(prompt_ids=[1, 2, 3])
    first = np.zeros((3 + 2 - 1, LAYERS, TOPK), np.uint8)
    trajectory.add_completion(Completion([4, 5], [-1.0, -1.0], "stop", 0, "w", routes=first))
    assert trajectory.routed_tokens == 4 and trajectory.routes().shape == (4, LAYERS, TOPK)
    trajectory.add_observation([6, 7])
    # The next request starts its routes at position 4 (the first turn's last sampled token).
    second = np.ones((len(trajectory.token_ids) + 3 - 1 - 4, LAYERS, TOPK), np.uint8)
    trajectory.add_completion(Completion([8, 9, 10], [-1.0] * 3, "stop", 0, "w", routes=second))
    assert len(trajectory.routes()) == len(trajectory.token_ids) - 1
    assert trajectory.routes()[:4].max() == 0 and trajectory.routes()[4:].min() == 1
    assert TokenTrajectory(prompt_ids=[1]).routes() is None


def test_the_orchestrator_sends_routes_to_the_policy_only(tiny_models):
    """One SAO step of the orchestrator (fake rollouts and critic) for a MoE policy under
    `measure`: every request asks for routes, the policy grid carries every sample's routes (all
    its tokens but the last), the critic's grid none."""
    import megatron_rl.orchestrator.loop as loop_module
    from tests.support.orchestrator import (
        FakeClient,
        FakeCritic,
        FakePolicy,
        FakeWeights,
        orchestrator_config,
    )

    resolved = orchestrator_config("sao", num_steps=1)
    data = resolved.model_dump(exclude={"layout"}, exclude_none=True)
    data["model"]["architecture"].update(family="qwen3_moe", num_experts=EXPERTS, num_experts_per_tok=TOPK,
                                         moe_intermediate_size=32)  # fmt: skip
    data["algorithm"]["routing_replay"] = "measure"
    resolved = parse_config(data)
    events, weights = [], FakeWeights()
    critic, policy, client = FakeCritic(events), FakePolicy(weights, events), FakeClient(weights, moe_layers=2, topk=TOPK)
    orchestrator = loop_module.Orchestrator(
        resolved, make_environment("procedural", None, 0), PromptEncoder(AutoTokenizer.from_pretrained(str(tiny_models["qwen3"]))),
        client, weights, critic, policy.send, OrchestratorState(None), lambda record: None,
        loop_module.Timeouts(batch_s=60, critic_s=60, weights_s=60),
    )  # fmt: skip
    assert asyncio.run(orchestrator.run()) == 1
    assert client.calls and all(call["routes_start"] == 0 for call in client.calls)  # single-turn
    policy_rows = [mb for rank in policy.grids[0] for mb in rank if not mb.is_dummy]
    critic_rows = [mb for rank in critic.grids[0] for mb in rank if not mb.is_dummy]
    assert all(mb.routes is None and mb.routed is None for mb in critic_rows)
    assert all(mb.routes.shape == (mb.num_tokens, 2, TOPK) for mb in policy_rows)
    sequences = sum(len(mb.cu_seqlens) - 1 for mb in policy_rows)
    assert sum(int(mb.routed.sum()) for mb in policy_rows) == sum(int(mb.cu_seqlens[-1]) for mb in policy_rows) - sequences
