"""Rollouts of one group: each member runs its environment's turns through the rollout client.

The prompt text gets the tokenizer's chat template once (`PromptEncoder`); each completion
extends the exact token sequence (`TokenTrajectory`), its text (decoded from those ids) goes to
the environment, and an observation is tokenised once and appended with loss mask 0 (with
`orchestrator.train_on_observations`, an ablation, mask 1 and the sampler's log-probabilities of
its tokens from the next turn's `prompt_logprobs`; a last observation with no turn after it stays
masked). The whole
rollout has `max_completion_tokens` of budget across turns (completions and observations).
A member that raises is `failed` (its error kept), one cancelled is `cancelled`: a group always
completes, with whatever members finished.
"""

from __future__ import annotations

import asyncio
import zlib
from dataclasses import dataclass, field

from megatron_rl.envs import Environment
from megatron_rl.inference.rollout import SamplingParams, TokenTrajectory


class PromptEncoder:
    """Our tokenizer's side of the rollout: prompt text -> ids (chat template applied once),
    observation text -> ids, completion ids -> text."""

    def __init__(self, tokenizer, use_chat_template: bool = True):
        self.tokenizer = tokenizer
        self.use_chat_template = use_chat_template and bool(getattr(tokenizer, "chat_template", None))

    def prompt(self, prompt: str | list[dict]) -> list[int]:
        """The prompt's ids: a string is the user message; a list of messages (a system prompt,
        few-shot turns) is rendered as it is, with the generation prompt after it."""
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if self.use_chat_template:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        if not isinstance(prompt, str):
            raise ValueError("a prompt of messages needs a chat template; this tokenizer has none")
        return list(self.tokenizer.encode(prompt, add_special_tokens=False))

    def observation(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


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
    observation_tokens: int = 0  # appended by the environment (loss mask 0)
    budget_exhausted: bool = False  # cut by the rollout's token budget before the episode ended

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
    trajectory = TokenTrajectory(prompt_ids=encoder.prompt(env.prompt(row)))
    prompt_len, texts = len(trajectory.prompt_ids), []
    session = f"group{group_id}-branch{branch}"
    turn_result, tool_calls, tool_errors, observation_tokens = None, 0, 0, 0
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
        texts.append(encoder.decode(completion.token_ids))
        turn_result = env.step(row, texts)
        tool_calls, tool_errors = tool_calls + turn_result.tool_calls, tool_errors + turn_result.tool_errors
        if turn_result.done or completion.finish_reason == "length":
            break
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
        episode_done=done, turns=len(texts), tool_calls=tool_calls, tool_errors=tool_errors,
        observation_tokens=observation_tokens,
        budget_exhausted=not done and len(trajectory.token_ids) - prompt_len >= budget,
    )  # fmt: skip


async def run_group(
    env: Environment, row: dict, group_id: int, group_size: int, client, encoder: PromptEncoder,
    sampling: SamplingParams, budget: int,
) -> Group:  # fmt: skip
    """Every member of one group; a failed or cancelled member never hangs the group."""
    tasks = [
        asyncio.ensure_future(run_member(env, row, client, encoder, sampling, group_id, b, budget))
        for b in range(group_size)
    ]
    results = await asyncio.gather(*tasks, return_exceptions=True)
    members = []
    for branch, result in enumerate(results):
        if isinstance(result, asyncio.CancelledError):
            members.append(Member(branch, "cancelled", error="cancelled"))
        elif isinstance(result, BaseException):
            members.append(Member(branch, "failed", error=f"{type(result).__name__}: {result}"))
        else:
            members.append(result)
    return Group(group_id, row, members)
