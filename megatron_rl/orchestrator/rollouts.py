"""Rollouts of one group: each member runs its environment's turns through the rollout client.

The prompt gets the tokenizer's chat template once, with the environment's tools
(`PromptEncoder`, orchestrator/chat.py); each completion extends the exact token sequence
(`TokenTrajectory`), its text (decoded from those ids, reasoning removed) goes to the
environment, and an observation is appended with loss mask 0: text tokenised once, or tool
messages as the template renders them after the sampled tokens (with
`orchestrator.train_on_observations`, an ablation, mask 1 and the sampler's log-probabilities of
its tokens from the next turn's `prompt_logprobs`; a last observation with no turn after it stays
masked). The whole
rollout has `max_completion_tokens` of budget across turns (completions and observations).
A member that raises is `failed` (its error kept: an LLM judge's unreadable verdict among them),
one cancelled is `cancelled`: a group always completes, with whatever members finished; a judge
that cannot be reached fails the group (and so the step).
"""

from __future__ import annotations

import asyncio
import zlib
from dataclasses import dataclass, field

from megatron_rl.envs import Environment
from megatron_rl.envs.judge import JudgeUnavailable
from megatron_rl.inference.rollout import SamplingParams, TokenTrajectory
from megatron_rl.orchestrator.chat import PromptEncoder


@dataclass
class Member:
    branch_index: int
    status: str  # "finished", "failed" or "cancelled"
    trajectory: TokenTrajectory | None = None
    reward: float = 0.0
    passed: bool | None = None
    truncated: bool = False  # ended without EOS (the length limit or the token budget)
    episode_done: bool = False  # the environment ended the episode (its reward is final)
    error: str | None = None
    turns: int = 0  # completions in the rollout
    tool_calls: int = 0
    tool_errors: int = 0
    tool_malformed: int = 0  # of the errors, calls the parser could not read
    observation_tokens: int = 0  # appended by the environment (loss mask 0)
    template_rewrites: int = 0  # tool messages rendered after a reference conversation (orchestrator/chat.py)
    budget_exhausted: bool = False  # cut by the rollout's token budget before the episode ended
    interruptions: int = 0  # completions' parts ended by a weight update and resumed
    judge_score: float | None = None  # an LLM judge's verdict (orchestrator.judge)
    reprefilled_tokens: int = 0  # tokens the resumed parts sent again as their prompt

    @property
    def num_completion_tokens(self) -> int:
        return sum(self.trajectory.loss_mask) if self.trajectory else 0


@dataclass
class Group:
    group_id: int
    row: dict
    members: list[Member] = field(default_factory=list)

    @property
    def policy_version(self) -> int:
        """The oldest policy version behind any finished member's tokens."""
        versions = [m.trajectory.policy_version for m in self.members if m.status == "finished"]
        return min(versions) if versions else -1


def request_seed(base_seed: int, group_id: int, branch: int, turn: int) -> int:
    return zlib.crc32(f"{base_seed}:{group_id}:{branch}:{turn}".encode()) & 0x7FFFFFFF


async def run_member(
    env: Environment, row: dict, client, encoder: PromptEncoder, sampling: SamplingParams,
    group_id: int, branch: int, budget: int,
) -> Member:  # fmt: skip
    prompt, tools = env.prompt(row), env.tool_schemas()
    trajectory = TokenTrajectory(prompt_ids=encoder.prompt(prompt, tools))
    conversation = encoder.messages(prompt)  # the messages so far, for rendering tool messages
    prompt_len, texts = len(trajectory.prompt_ids), []
    session = f"group{group_id}-branch{branch}"
    turn_result, tool_calls, tool_errors, malformed, observation_tokens, rewrites = None, 0, 0, 0, 0, 0
    interruptions = reprefilled = 0
    for turn in range(env.max_turns):
        remaining = budget - (len(trajectory.token_ids) - prompt_len)
        if remaining <= 0:
            break
        completion = await client.complete(
            trajectory.token_ids, sampling, session, max_tokens=min(sampling.max_tokens, remaining),
            seed=None if sampling.seed is None else request_seed(sampling.seed, group_id, branch, turn),
            stop=list(env.stop) or None, routes_start=trajectory.routed_tokens,
        )  # fmt: skip
        if completion.prompt_logprobs is not None and trajectory.observation_spans:  # the ablation
            start, end = span = trajectory.observation_spans[-1]
            trajectory.observation_as_action(span, completion.prompt_logprobs[start:end])
        trajectory.add_completion(completion)
        interruptions, reprefilled = interruptions + completion.interruptions, reprefilled + completion.reprefilled_tokens
        texts.append(encoder.answer(encoder.decode(completion.token_ids)))
        turn_result = await env.astep(row, texts)
        tool_calls, tool_errors = tool_calls + turn_result.tool_calls, tool_errors + turn_result.tool_errors
        malformed += turn_result.tool_malformed
        if turn_result.done or completion.finish_reason == "length":
            break
        if isinstance(turn_result.observation, list):  # messages: the template renders them
            observation, rewritten = encoder.extend(conversation, completion.token_ids, turn_result.observation, tools)
            rewrites += rewritten
        else:
            observation = encoder.observation(turn_result.observation or "")
        observation = observation[: max(0, budget - (len(trajectory.token_ids) - prompt_len))]
        trajectory.add_observation(observation)
        observation_tokens += len(observation)
    done = turn_result is not None and turn_result.done
    truncated = trajectory.finish_reason == "length" or not done
    return Member(
        branch_index=branch, status="finished", trajectory=trajectory,
        reward=turn_result.reward if done else 0.0,
        passed=turn_result.passed if turn_result is not None else None, truncated=truncated,
        episode_done=done, turns=len(texts), tool_calls=tool_calls, tool_errors=tool_errors, tool_malformed=malformed,
        observation_tokens=observation_tokens, template_rewrites=rewrites, interruptions=interruptions,
        reprefilled_tokens=reprefilled, judge_score=turn_result.judge_score if turn_result is not None else None,
        budget_exhausted=not done and len(trajectory.token_ids) - prompt_len >= budget,
    )  # fmt: skip


async def run_group(
    env: Environment, row: dict, group_id: int, group_size: int, client, encoder: PromptEncoder,
    sampling: SamplingParams, budget: int,
) -> Group:  # fmt: skip
    """Every member of one group; a failed or cancelled member never hangs the group. A judge
    that cannot be reached (after its retries) fails the group, so the step fails naming it."""
    tasks = [
        asyncio.ensure_future(run_member(env, row, client, encoder, sampling, group_id, b, budget))
        for b in range(group_size)
    ]
    results = await asyncio.gather(*tasks, return_exceptions=True)
    for result in results:
        if isinstance(result, JudgeUnavailable):
            raise result
    members = []
    for branch, result in enumerate(results):
        if isinstance(result, asyncio.CancelledError):
            members.append(Member(branch, "cancelled", error="cancelled"))
        elif isinstance(result, BaseException):
            members.append(Member(branch, "failed", error=f"{type(result).__name__}: {result}"))
        else:
            members.append(result)
    return Group(group_id, row, members)
