"""Routes from the sampler's wire to the trainer's router: the rollout client asks a stand-in of
vLLM 0.32 with `--enable-return-routed-experts` (tests/support/routed_vllm.py: a tiny Qwen3-MoE
in transformers, speaking vLLM's completion format) for the routes of single- and multi-turn
rollouts, the trajectories join them (turn n + 1 from turn n's last sampled token), and the
trainer's own router, on the same tokens and weights, chooses exactly those experts for every
token, layer and k, prompt and completion (float32), while its log-probs are the sampler's; also
for requests interrupted (as a weight update in vLLM's pause mode abort ends them) and resumed by
the client with their tokens as the prompt: each part's routes continue where the last one's
ended."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import time

import httpx
import numpy as np
import pytest
from safetensors.torch import load_file

from megatron_rl.config import Architecture
from megatron_rl.conversion.hf_mapping import hf_to_megatron
from megatron_rl.data.types import TrainingSample
from megatron_rl.inference.rollout import RolloutClient, SamplingParams, TokenTrajectory
from tests.distributed.test_routing_replay import replayed_logprobs
from tests.support.hf_routes import RoutedSampler
from tests.support.routed_vllm import routed_vllm_command
from tests.support.spawn import run_ranks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def routed_server(tiny_models):
    port = _free_port()
    process = subprocess.Popen(routed_vllm_command("--port", port, "--model-dir", tiny_models["qwen3_moe"]),
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"the routed stand-in did not start: {process.stderr.read()[-2000:]}")
        time.sleep(0.3)
    yield url
    process.terminate()
    process.wait(timeout=30)


async def _rollouts(url: str, experts: int) -> list[TokenTrajectory]:
    """Three single-turn and three two-turn rollouts (an observation between the turns)."""
    trajectories = []
    async with RolloutClient(url, "policy") as client:
        for index in range(6):
            sampling = SamplingParams(max_tokens=6 + index, seed=index, routed_experts=experts)
            trajectory = TokenTrajectory(prompt_ids=list(range(3 + index, 10 + 2 * index)))
            turns = 1 if index < 3 else 2
            for turn in range(turns):
                completion = await client.complete(trajectory.token_ids, sampling, f"s{index}",
                                                   routes_start=trajectory.routed_tokens)  # fmt: skip
                trajectory.add_completion(completion)
                if turn + 1 < turns:
                    trajectory.add_observation([40 + index, 41, 42])
            trajectories.append(trajectory)
    return trajectories


def test_routes_from_the_wire_are_the_trainers_own_choice_single_and_multi_turn(routed_server, tiny_models):
    directory = tiny_models["qwen3_moe"]
    arch = Architecture.from_hf_config(json.loads((directory / "config.json").read_text()), str(directory))
    trajectories = asyncio.run(_rollouts(routed_server, arch.num_experts))
    reference = RoutedSampler(directory)
    samples = []
    for index, trajectory in enumerate(trajectories):
        routes = trajectory.routes()
        tokens = trajectory.token_ids
        assert routes.dtype == np.uint8 and routes.shape == (len(tokens) - 1, arch.num_layers, arch.num_experts_per_tok)
        np.testing.assert_array_equal(routes, reference.forward(tokens)[1][:-1])  # the joins lose no position
        samples.append(TrainingSample(token_ids=tokens, loss_mask=trajectory.loss_mask, reward=0.0, group_id=index,
                                      inference_logprobs=trajectory.logprobs, routes=routes))  # fmt: skip
    assert sum(len(t.observation_spans) for t in trajectories) == 3
    full = hf_to_megatron(load_file(directory / "model.safetensors"), arch)
    logprobs, stats, _ = run_ranks(replayed_logprobs, 1, arch, full, samples, "measure")[0]
    assert stats["router_agreement"] == 1.0 and stats["router_token_mismatch"] == 0.0
    assert stats["router_tokens"] == sum(len(s) - 1 for s in samples)
    for index, sample in enumerate(samples):
        for q in np.flatnonzero(sample.loss_mask):
            assert logprobs[(index, int(q))] == pytest.approx(float(sample.inference_logprobs[q]), abs=2e-5)


def test_routes_of_interrupted_and_resumed_requests_join_as_one_requests(routed_server, tiny_models):
    """Partial rollouts under routing replay: a single-turn request interrupted twice and a
    two-turn rollout interrupted inside its second turn; the joined routes are every position's,
    the trainer's own router's choice, and the log-probs the sampler's."""
    directory = tiny_models["qwen3_moe"]
    arch = Architecture.from_hf_config(json.loads((directory / "config.json").read_text()), str(directory))

    async def rollouts():
        trajectories = []
        async with RolloutClient(routed_server, "policy", version_wait_s=0.05) as client:
            for index, (turns, aborts) in enumerate([(1, [[2, 3]]), (2, [[], [1]])]):
                sampling = SamplingParams(max_tokens=9, seed=20 + index, routed_experts=arch.num_experts)
                trajectory = TokenTrajectory(prompt_ids=list(range(5 + index, 12 + index)))
                for turn in range(turns):
                    httpx.post(f"{routed_server}/abort_next", json={"after": aborts[turn]})
                    completion = await client.complete(trajectory.token_ids, sampling, f"i{index}",
                                                       routes_start=trajectory.routed_tokens)  # fmt: skip
                    assert completion.interruptions == len(aborts[turn]) and completion.finish_reason != "abort"
                    trajectory.add_completion(completion)
                    if turn + 1 < turns:
                        trajectory.add_observation([44, 45, 46])
                trajectories.append(trajectory)
        return trajectories

    reference = RoutedSampler(directory)
    samples = []
    for index, trajectory in enumerate(asyncio.run(rollouts())):
        tokens = trajectory.token_ids
        np.testing.assert_array_equal(trajectory.routes(), reference.forward(tokens)[1][:-1])
        samples.append(TrainingSample(token_ids=tokens, loss_mask=trajectory.loss_mask, reward=0.0, group_id=index,
                                      inference_logprobs=trajectory.logprobs, routes=trajectory.routes()))  # fmt: skip
    full = hf_to_megatron(load_file(directory / "model.safetensors"), arch)
    logprobs, stats, _ = run_ranks(replayed_logprobs, 1, arch, full, samples, "measure")[0]
    assert stats["router_agreement"] == 1.0
    for index, sample in enumerate(samples):
        for q in np.flatnonzero(sample.loss_mask):
            assert logprobs[(index, int(q))] == pytest.approx(float(sample.inference_logprobs[q]), abs=2e-5)
