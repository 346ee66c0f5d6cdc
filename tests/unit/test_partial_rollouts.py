"""Partial rollouts in the rollout client (megatron_rl/inference/rollout.py), against an
in-process stand-in server (httpx.MockTransport) whose weight updates interrupt requests as
vLLM's `pause?mode=abort` does (finish reason `abort`, the tokens sampled so far): the client
resumes each interrupted request with the tokens so far as its prompt, joins the parts token for
token, and stamps every token with the version that sampled it. Also: the trajectory's and the
training sample's per-token versions, the step's version metrics and the version-aware value
targets on samples that span versions."""

from __future__ import annotations

import asyncio
import json

import httpx
import numpy as np
import pytest
import torch

from megatron_rl.algorithms import advantages as adv
from megatron_rl.algorithms.base import CriticAlgorithm
from megatron_rl.config import AlgorithmConfig
from megatron_rl.data.types import TrainingSample
from megatron_rl.inference.rollout import RolloutClient, RolloutError, SamplingParams, TokenTrajectory
from megatron_rl.orchestrator.metrics import version_metrics
from tests.support.orchestrator import InProcessScorer, orchestrator_config
from tests.support.routed_vllm import encode_routes

LAYERS, EXPERTS, TOPK = 2, 8, 2


class UpdatingServer:
    """Samples token `100 + position` with log-probability `-(version + 1) / 10` (so a token
    tells which weights sampled it); `interrupt_after[i]` ends the i-th request after that many
    tokens with finish reason `abort` and installs the next version, during which
    `updating` is True. `dead` workers answer 503 once for each request sent to them."""

    def __init__(self, interrupt_after: dict[int, int], dead: tuple[str, ...] = (), routes: bool = False,
                 held: tuple[int, ...] = ()):  # fmt: skip
        """`held`: requests that reach the server as an update begins: vLLM's pause holds them
        and they are sampled by the next version after the resume (the client read the old one)."""
        self.interrupt_after, self.dead, self.routes, self.held = interrupt_after, set(dead), routes, set(held)
        self.version, self.updating, self.requests = 0, False, []

    def handle(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        assert not self.updating, "a request was sent while a weight update was in progress"
        worker = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        self.requests.append({**body, "worker": worker, "version": self.version})
        if worker in self.dead:
            self.dead.discard(worker)
            return httpx.Response(503, text=f"worker {worker}/v1/completions refused")
        prompt, limit = body["prompt"], body["max_tokens"]
        index = len(self.requests) - 1
        if index in self.held:
            self.version += 1  # the update ran while the request waited
        count = min(limit, self.interrupt_after.get(index, limit))
        tokens = [100 + len(prompt) + i for i in range(count)]
        finish = "abort" if index in self.interrupt_after and count < limit else "length"
        choice = {"token_ids": tokens, "logprobs": {"token_logprobs": [-(self.version + 1) / 10] * count},
                  "finish_reason": finish}  # fmt: skip
        if self.routes:  # experts chosen by (position, version): [prompt from start + tokens - 1]
            rows = len(prompt) - body["routed_experts_prompt_start"] + count - 1
            positions = np.arange(body["routed_experts_prompt_start"], body["routed_experts_prompt_start"] + rows)
            choice["routed_experts"] = encode_routes(
                np.stack([(positions + self.version) % EXPERTS, (positions + 1) % EXPERTS], -1)[:, None, :]
                .repeat(LAYERS, 1).astype(np.int32)
            )  # fmt: skip
        if finish == "abort":
            self.updating = True  # the update runs; the client must wait for it
            asyncio.get_event_loop().call_later(0.02, self._installed)
        return httpx.Response(200, json={"choices": [choice]})

    def _installed(self) -> None:
        self.version += 1
        self.updating = False


def client_for(server: UpdatingServer, workers=("http://w0:1", "http://w1:1")) -> RolloutClient:
    client = RolloutClient("http://w0:1", "policy", list(workers), version_source=lambda: server.version,
                           update_in_progress=lambda: server.updating, version_wait_s=1.0)  # fmt: skip
    client._http = httpx.AsyncClient(transport=httpx.MockTransport(server.handle))
    return client


def test_a_request_interrupted_twice_is_resumed_with_its_tokens_as_the_prompt():
    server = UpdatingServer({0: 5, 1: 4})
    client = client_for(server)
    prompt = [1, 2, 3]
    completion = asyncio.run(client.complete(prompt, SamplingParams(max_tokens=16, seed=7), "group0-branch0"))
    assert completion.token_ids == [100 + 3 + i for i in range(16)]  # one token sequence, position by position
    assert completion.token_versions == [0] * 5 + [1] * 4 + [2] * 7
    assert completion.logprobs == pytest.approx([-(v + 1) / 10 for v in completion.token_versions])
    assert (completion.finish_reason, completion.policy_version, completion.interruptions) == ("length", 0, 2)
    sent = server.requests
    assert [r["prompt"] for r in sent] == [prompt, prompt + completion.token_ids[:5], prompt + completion.token_ids[:9]]
    assert [r["max_tokens"] for r in sent] == [16, 11, 7] and [r["version"] for r in sent] == [0, 1, 2]
    assert len({r["seed"] for r in sent}) == 3  # each part samples from a stream of its own
    assert completion.reprefilled_tokens == (3 + 5) + (3 + 9) and client.interruptions == 2


def test_a_request_held_through_an_update_is_sent_again_under_interrupt_and_keeps_its_stamp_under_keep():
    """A request that reaches a paused server is held and sampled by the new weights after the
    resume: under `interrupting` the client sends it again (its stamp unsure), so every token's
    version is the one that sampled it; under keep its one version is a lower bound."""
    server = UpdatingServer({}, held=(0,))
    client = client_for(server)
    client.interrupting = lambda: True
    completion = asyncio.run(client.complete([1, 2, 3], SamplingParams(max_tokens=6, seed=7), "group0-branch0"))
    assert completion.versions() == [1] * 6 and completion.logprobs == pytest.approx([-0.2] * 6)
    assert len(server.requests) == 2 and client.resent == 1 and completion.interruptions == 0
    server = UpdatingServer({}, held=(0,))
    client = client_for(server)  # update_mode keep: not interrupting
    completion = asyncio.run(client.complete([1, 2, 3], SamplingParams(max_tokens=6, seed=7), "group0-branch0"))
    assert completion.policy_version == 0 and completion.logprobs == pytest.approx([-0.2] * 6)  # a lower bound
    assert len(server.requests) == 1 and client.resent == 0


def test_the_resumed_parts_routes_continue_where_the_last_part_ended():
    server = UpdatingServer({0: 4}, routes=True)
    client = client_for(server)
    sampling = SamplingParams(max_tokens=10, routed_experts=EXPERTS)
    completion = asyncio.run(client.complete([1, 2, 3, 4, 5], sampling, "group0-branch0", routes_start=2))
    assert [r["routed_experts_prompt_start"] for r in server.requests] == [2, 2 + (5 - 2 + 4 - 1)]
    routes = completion.routes
    assert len(routes) == 5 - 2 + 10 - 1  # every token from the start but the last, as one request's
    positions = np.arange(2, 2 + len(routes))
    version = np.where(positions < 5 + 4 - 1, 0, 1)  # the last token of part 1 was fed to the new weights
    assert routes[:, 0, 0].tolist() == ((positions + version) % EXPERTS).tolist()


def test_a_resumed_request_whose_server_died_is_retried_on_another():
    server = UpdatingServer({0: 3}, dead=("http://w0:1",))
    server.dead.clear()  # w0 answers the first part, then dies
    client = client_for(server)

    def handle(request):
        if len(server.requests) == 1:
            server.dead.add("http://w0:1")
        return UpdatingServer.handle(server, request)

    client._http = httpx.AsyncClient(transport=httpx.MockTransport(handle))
    completion = asyncio.run(client.complete([1, 2], SamplingParams(max_tokens=8), "group3-branch1"))
    assert [r["worker"] for r in server.requests] == ["http://w0:1", "http://w0:1", "http://w1:1"]
    assert completion.token_versions == [0] * 3 + [1] * 5 and client.retries == 1
    assert completion.worker == "http://w1:1"


def test_an_interruption_as_the_budget_ends_is_a_length_finish_and_interruptions_are_bounded():
    server = UpdatingServer({0: 6})
    completion = asyncio.run(client_for(server).complete([1], SamplingParams(max_tokens=6), "s"))
    assert completion.finish_reason == "length" and completion.interruptions == 0 and len(server.requests) == 1
    server = UpdatingServer({i: 1 for i in range(10)})
    client = client_for(server)
    client.max_interruptions = 3
    with pytest.raises(RolloutError, match="session 'group1-branch0' was interrupted 4 times"):
        asyncio.run(client.complete([1], SamplingParams(max_tokens=20), "group1-branch0"))


def test_multi_turn_trajectory_with_an_interruption_inside_a_turn():
    server = UpdatingServer({1: 2})  # the second turn's request is interrupted after 2 tokens
    client = client_for(server)
    trajectory = TokenTrajectory(prompt_ids=[1, 2, 3])

    async def rollout():
        trajectory.add_completion(await client.complete(trajectory.token_ids, SamplingParams(max_tokens=3), "s"))
        trajectory.add_observation([7, 8])
        trajectory.add_completion(await client.complete(trajectory.token_ids, SamplingParams(max_tokens=5), "s"))

    asyncio.run(rollout())
    versions = trajectory.versions()
    assert trajectory.loss_mask == [False] * 3 + [True] * 3 + [False] * 2 + [True] * 5
    assert versions.tolist() == [0] * 3 + [0] * 3 + [0] * 2 + [0] * 2 + [1] * 3  # off the actions: the oldest
    assert trajectory.policy_version == 0 and sorted(set(trajectory.policy_versions)) == [0, 1]
    assert trajectory.token_ids[10:] == [100 + 10 + i for i in range(3)]  # resumed at position 10, exactly


def sample_spanning(versions: list[int], step_mask: list[bool], reward: float = 1.0) -> TrainingSample:
    n = len(versions)
    return TrainingSample(token_ids=np.arange(n), loss_mask=np.asarray(step_mask), inference_logprobs=np.zeros(n),
                          reward=reward, policy_version=min(versions), token_versions=np.asarray(versions))  # fmt: skip


def test_version_metrics_report_spans_and_the_tokens_per_lag():
    samples = [sample_spanning([0, 0, 0, 1, 1, 3], [False, True, True, True, True, True]),
               sample_spanning([2, 2, 2], [False, True, True])]  # fmt: skip
    record = version_metrics(3, samples)
    assert record["version_span_max"] == 3 and record["version_span_mean"] == 1.5
    assert record["samples_spanning_versions"] == 1
    assert record["token_lag"] == pytest.approx({"0": 1 / 7, "1": 2 / 7, "2": 2 / 7, "3": 2 / 7}, abs=1e-6)
    with pytest.raises(ValueError, match="token_versions has 2 entries for 3 tokens"):
        TrainingSample(token_ids=[1, 2, 3], loss_mask=[1, 1, 1], inference_logprobs=[0, 0, 0], reward=0.0,
                       token_versions=[0, 1])  # fmt: skip


def test_the_critic_algorithm_cuts_the_value_targets_at_the_samples_version_boundaries():
    samples = [sample_spanning([0, 0, 0, 0, 1, 1, 2, 2], [False, True, True, True, True, True, True, True]),
               sample_spanning([1, 1, 1, 1], [False, True, True, True], reward=0.0)]  # fmt: skip
    values = [np.linspace(0.1, 0.8, 8, dtype=np.float32), np.full(4, 0.5, np.float32)]

    def score(batch):
        from megatron_rl.data.types import ScoreResult

        return ScoreResult(values=[v.tolist() for v in values[: len(batch)]], bootstrap_values=[0.0] * len(batch))

    def prepared(value_targets: str):
        config = AlgorithmConfig(type="ppo", value_targets=value_targets, value_lambda=1.0)
        group = [sample_spanning(s.token_versions.tolist(), s.loss_mask.tolist(), s.reward) for s in samples]
        asyncio.run(CriticAlgorithm(config, InProcessScorer(score)).prepare_batch([group], 2))
        return group

    plain, cut = prepared("gae"), prepared("version_bootstrap")
    mask = torch.from_numpy(samples[0].loss_mask)[None]
    expected, _ = adv.version_bootstrap_returns(
        torch.tensor([1.0]), torch.from_numpy(values[0].astype(np.float64))[None], mask, torch.zeros(1),
        torch.zeros(1, dtype=torch.bool), 1.0, 1.0, torch.tensor([[0, 0, 0, 0, 1, 1, 2, 2]]), 2,
    )  # fmt: skip
    assert cut[0].returns == pytest.approx(expected[0].numpy(), abs=1e-6)
    # at lambda 1 a cut target is the next value: V(t_4) at the 0 -> 1 boundary, V(t_6) at 1 -> 2
    assert cut[0].returns[3] == pytest.approx(values[0][4]) and cut[0].returns[5] == pytest.approx(values[0][6])
    assert plain[0].returns[1:] == pytest.approx([1.0] * 7)  # the plain return: R through the whole sample
    assert cut[1].returns == pytest.approx(plain[1].returns) and cut[0].advantages == pytest.approx(plain[0].advantages)


def test_value_targets_config():
    assert orchestrator_config("sao").algorithm.value_targets == "gae"
    resolved = orchestrator_config("sao")
    data = resolved.algorithm.model_dump()
    with pytest.raises(ValueError, match="algorithm.value_targets_max_lag .* 'version_bootstrap'"):
        AlgorithmConfig(**{**data, "value_targets_max_lag": 2})
    config = AlgorithmConfig(**{**data, "value_targets": "version_bootstrap", "value_targets_max_lag": 2})
    assert (config.value_targets, config.value_targets_max_lag) == ("version_bootstrap", 2)
