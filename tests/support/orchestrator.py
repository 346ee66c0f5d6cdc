"""In-process fakes for driving the orchestrator's loop in tests: a rollout client, a policy
that publishes a new version some time after each grid, a critic that counts score calls and a
ValueScorer over a plain function. They record the order of events so tests can check the data
flow."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable

import numpy as np

from megatron_rl.config import parse_config
from megatron_rl.data.types import ScoreResult, route_dtype
from megatron_rl.envs import make_environment
from megatron_rl.inference.rollout import Completion
from megatron_rl.orchestrator.loop import Orchestrator, Timeouts
from megatron_rl.orchestrator.state import OrchestratorState
from tests.support.shipped import ShippedSamples


class InProcessScorer:
    """A ValueScorer (megatron_rl.algorithms.ValueScorer) over a plain function; `calls` records
    every batch it scored."""

    def __init__(self, score_fn: Callable[[list[list[int]]], ScoreResult]):
        self.score_fn = score_fn
        self.calls: list[list[list[int]]] = []

    async def score(self, batched_token_ids: list[list[int]]) -> ScoreResult:
        self.calls.append(batched_token_ids)
        return self.score_fn(batched_token_ids)


class FakeClient:
    """Completions of random tokens (seeded by session and turn); `fail` maps (group, branch)
    to an exception raised for that member's first request, or (group, branch, turn) for its
    request of that turn (a failure mid-rollout); `script` gives fixed completions per turn;
    `slow` maps a group to seconds each of its requests takes besides `delay_s` (a long tail);
    `interrupted`: completions sent under a version v > 0 come back as a partial rollout whose
    first half was sampled by v - 1 (as if resumed after an update), stamped per token."""

    def __init__(self, weights, vocab: int = 500, eos: int | None = None, delay_s: float = 0.0,
                 fail=None, script: list[list[int]] | None = None, moe_layers: int = 2, topk: int = 2,
                 slow: dict[int, float] | None = None, interrupted: bool = False):  # fmt: skip
        self.weights, self.vocab, self.eos, self.delay_s = weights, vocab, eos, delay_s
        self.interrupted = interrupted
        self.slow = slow or {}
        self.fail = fail or {}
        self.script = script
        self.moe_layers, self.topk = moe_layers, topk  # the routes' shape, with sampling.routed_experts
        self.calls: list[dict] = []

    async def complete(self, prompt_ids, sampling, session_id, max_tokens=None, seed=None, stop=None, routes_start=0):
        version = self.weights.version()
        turn = sum(1 for c in self.calls if c["session"] == session_id)
        self.calls.append({"session": session_id, "prompt": list(prompt_ids), "version": version,
                           "routes_start": routes_start})  # fmt: skip
        group, branch = (int(x.removeprefix("group").removeprefix("branch")) for x in session_id.split("-"))
        for key in ((group, branch), (group, branch, turn)):
            if key in self.fail:
                raise self.fail[key]
        rng = random.Random(f"{session_id}:{turn}")
        await asyncio.sleep(self.delay_s * rng.random() + self.slow.get(group, 0.0))
        limit = max_tokens or sampling.max_tokens
        if self.script is not None:
            tokens = list(self.script[turn])[:limit]
        else:
            tokens = [rng.randrange(1, self.vocab) for _ in range(rng.randint(1, limit))]
        finish = "stop" if len(tokens) < limit else "length"
        logprobs = [-rng.random() * 3 for _ in tokens]
        routes = None
        if sampling.routed_experts:  # random distinct experts for every token from the start but the last
            rows = len(prompt_ids) + len(tokens) - 1 - routes_start
            choice = np.argsort(np.random.default_rng(rng.randrange(2**32)).random((rows, self.moe_layers,
                                                                                    sampling.routed_experts)), -1)  # fmt: skip
            routes = choice[..., : self.topk].astype(route_dtype(sampling.routed_experts))
        if self.interrupted and version > 0 and len(tokens) > 1:
            half = len(tokens) // 2
            return Completion(tokens, logprobs, finish, policy_version=version - 1, worker="fake", routes=routes,
                              token_versions=[version - 1] * half + [version] * (len(tokens) - half), interruptions=1,
                              reprefilled_tokens=len(prompt_ids) + half)  # fmt: skip
        return Completion(tokens, logprobs, finish, policy_version=version, worker="fake", routes=routes)


class FakeWeights:
    def __init__(self, version: int = 0):
        self.current = version

    def version(self) -> int:
        return self.current

    async def wait_for(self, version: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self.current < version:
            if time.monotonic() > deadline:
                raise TimeoutError(f"policy version {version} not live within {timeout_s}s")
            await asyncio.sleep(0.005)


class FakePolicy:
    """Receives policy grids; 'trains' for `train_s`, then publishes version step + 1."""

    def __init__(self, weights: FakeWeights, events: list, train_s: float = 0.0):
        self.weights, self.events, self.train_s = weights, events, train_s
        self.grids: dict[int, list] = {}
        self.version_at_ship: dict[int, int] = {}
        self._tasks = []

    async def send(self, step: int, grid) -> None:
        self.events.append(("policy_grid", step))
        self.grids[step] = grid
        self.version_at_ship[step] = self.weights.current

        async def train():
            await asyncio.sleep(self.train_s)
            self.weights.current = max(self.weights.current, step + 1)

        self._tasks.append(asyncio.ensure_future(train()))


class FakeCritic:
    """A counting in-process scorer (values from a seeded generator) and a critic that trains a
    step the moment its grid arrives."""

    def __init__(self, events: list, seed: int = 0):
        self.events = events
        generator = np.random.default_rng(seed)

        def score(batched):
            return ScoreResult(
                values=[generator.normal(size=len(t)).astype(np.float32) for t in batched],
                bootstrap_values=[float(generator.normal()) for _ in batched],
            )

        self.scorer = InProcessScorer(score)
        self.grids: dict[int, list] = {}
        self.trained = -1

    async def send(self, step: int, grid) -> None:
        self.events.append(("critic_grid", step))
        self.grids[step] = grid
        self.trained = step

    async def wait_trained(self, step: int, timeout_s: float) -> dict:
        assert self.trained >= step, f"critic asked for step {step} before its grid"
        self.events.append(("critic_trained", step))
        return {"trained_step": step}


def orchestrator_config(algorithm: str = "sao", checkpoint_dir: str = "checkpoints", algorithm_options=None,
                        distillation=None, **orchestrator):  # fmt: skip
    """A resolved config for driving the orchestrator in-process (policy DP 2, critic DP 2);
    `algorithm_options`: keys of the algorithm section besides its type; `distillation`: that
    section."""

    arch = {"family": "qwen3", "hidden_size": 64, "num_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 512}  # fmt: skip
    data = {
        "model": {"architecture": arch, "seq_len": 256},
        "algorithm": {"type": algorithm, **(algorithm_options or {})},
        "orchestrator": {
            "batch_size": 4,
            "group_size": 2,
            "max_prompt_tokens": 64,
            "max_completion_tokens": 24,
            "num_steps": 4,
            **orchestrator,
        },  # fmt: skip
        "deployment": {
            "device": "cpu",
            "nodes": 1,
            "gpus_per_node": 8,
            "inference_gpus": 1,
            "policy_gpus": 2,
        },
        "checkpoint": {"dir": checkpoint_dir},
    }
    if distillation is not None:
        data["distillation"] = distillation
    if algorithm != "grpo":
        data["value"] = {"model": {"architecture": arch, "seq_len": 256}}
        data["deployment"]["num_value_gpus_per_train_node"] = 2
    return parse_config(data)


def per_token_gae(reward, values, mask, bootstrap, bootstrapped, gamma, lam):
    """The reference for skip-observation GAE: a plain loop over the action tokens only (prompt
    and observations skipped), the reward on the last one, `bootstrap` after it when
    `bootstrapped`."""
    actions = [t for t in range(len(mask)) if mask[t]]
    advantages = np.zeros(len(mask))
    next_value, running = (bootstrap if bootstrapped else 0.0), 0.0
    for k in reversed(range(len(actions))):
        t = actions[k]
        delta = (reward if k == len(actions) - 1 else 0.0) + gamma * next_value - values[t]
        running = delta + gamma * lam * running
        advantages[t] = running
        next_value = values[t]
    return advantages


def build_orchestrator(resolved, encoder, client_kwargs=None, train_s=0.0, state=None, env="procedural", dataset=None,
                       teacher=None, environment=None):  # fmt: skip
    """The real Orchestrator over the fakes: (orchestrator with `.shipped`, events, client,
    critic or None, policy, the step records); `teacher` for distillation; `environment` an
    Environment in place of `env`'s."""
    events, weights = [], FakeWeights()
    client = FakeClient(weights, **(client_kwargs or {}))
    critic = FakeCritic(events) if resolved.value is not None else None
    policy = FakePolicy(weights, events, train_s)
    records = []
    orchestrator = ShippedSamples().attach(Orchestrator(
        resolved, make_environment(env, dataset, resolved.orchestrator.seed) if environment is None else environment,
        encoder, client, weights, critic,
        policy.send, state or OrchestratorState(None), records.append, Timeouts(batch_s=60, critic_s=60, weights_s=60),
        teacher=teacher,
    ))  # fmt: skip
    return orchestrator, events, client, critic, policy, records
