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
from megatron_rl.envs.base import ChatModel, ConversationError, DrivenEnvironment, Reply
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
    scores: dict[str, float] | None = None  # a hub environment's named rewards and metrics (envs/base.py Turn)

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


class RolloutSession(ChatModel):
    """One rollout's token sequence and its sampling: the turns our own loop drives (`run_member`
    through `sample` and `observe`) and the turns an environment drives through `chat` (a
    `DrivenEnvironment`, envs/base.py: it hands over the whole conversation every turn, which must
    extend the one before, and gets the sampled `Reply`)."""

    def __init__(
        self, client, encoder: PromptEncoder, sampling: SamplingParams, group_id: int, branch: int,
        budget: int, stop: tuple[str, ...] = (), max_turns: int | None = None,
    ) -> None:  # fmt: skip
        self.client, self.encoder, self.sampling = client, encoder, sampling
        self.group_id, self.branch, self.budget, self.stop, self.max_turns = group_id, branch, budget, stop, max_turns
        self.trajectory: TokenTrajectory | None = None
        self.texts: list[str] = []  # each turn's completion without its reasoning
        self.observation_tokens = self.template_rewrites = self.interruptions = self.reprefilled_tokens = 0
        self._rendered: list[dict] = []  # the conversation as our template renders it (envs' messages, our turns)
        self._seen: list[dict] = []  # the conversation as the environment last handed it over
        self._tools: list[dict] | None = None
        self._last_ids: list[int] = []
        self.exhausted = False  # chat was called with the budget spent (an empty "length" reply)

    # --- the prompt and each turn ---------------------------------------------------------------
    def start(self, prompt: str | list[dict], tools: list[dict] | None = None) -> None:
        self.trajectory = TokenTrajectory(prompt_ids=self.encoder.prompt(prompt, tools))
        self._rendered, self._tools = self.encoder.messages(prompt), tools

    @property
    def prompt_len(self) -> int:
        return len(self.trajectory.prompt_ids)

    @property
    def remaining_tokens(self) -> int:
        return max(0, self.budget - (len(self.trajectory.token_ids) - self.prompt_len)) if self.trajectory else self.budget

    @property
    def turns(self) -> int:
        return len(self.texts)

    async def sample(self):
        """The next completion after the sequence so far (the budget must not be spent)."""
        trajectory, sampling, turn = self.trajectory, self.sampling, len(self.texts)
        completion = await self.client.complete(
            trajectory.token_ids, sampling, f"group{self.group_id}-branch{self.branch}",
            max_tokens=min(sampling.max_tokens, self.remaining_tokens),
            seed=None if sampling.seed is None else request_seed(sampling.seed, self.group_id, self.branch, turn),
            stop=list(self.stop) or None, routes_start=trajectory.routed_tokens,
        )  # fmt: skip
        if completion.prompt_logprobs is not None and trajectory.observation_spans:  # the ablation
            start, end = span = trajectory.observation_spans[-1]
            trajectory.observation_as_action(span, completion.prompt_logprobs[start:end])
        trajectory.add_completion(completion)
        self.interruptions += completion.interruptions
        self.reprefilled_tokens += completion.reprefilled_tokens
        self.texts.append(self.encoder.answer(self.encoder.decode(completion.token_ids)))
        self._last_ids = list(completion.token_ids)
        return completion

    def observe(self, observation: str | list[dict] | None) -> None:
        """Appends the environment's answer to the last turn (loss mask 0), cut to the budget:
        text tokenised as it is, or messages the template renders after the sampled tokens."""
        if isinstance(observation, list):
            ids, rewritten = self.encoder.extend(self._rendered, self._last_ids, observation, self._tools)
            self.template_rewrites += rewritten
        else:
            ids = self.encoder.observation(observation or "")
        ids = ids[: self.remaining_tokens]
        self.trajectory.add_observation(ids)
        self.observation_tokens += len(ids)

    # --- ChatModel: an environment that drives its own turns ------------------------------------
    async def chat(self, messages: list[dict], tools: list[dict] | None = None) -> Reply:
        messages = [dict(m) for m in messages]
        if self.trajectory is None:
            if not messages:
                raise ConversationError("the first chat call has no messages: nothing to prompt with")
            self.start(messages, tools)
        else:
            self._check_extension(messages, tools)
            self.observe(messages[len(self._seen) + 1 :])
        self._seen = messages
        if self.max_turns is not None and len(self.texts) >= self.max_turns:
            raise ConversationError(f"turn {len(self.texts) + 1} is past the environment's max_turns {self.max_turns}")
        prompt_ids = list(self.trajectory.token_ids)
        if self.remaining_tokens <= 0:  # the budget is spent: an empty turn that ends the rollout
            self.trajectory.finish_reason, self.exhausted = "length", True
            return Reply("", "", prompt_ids, [], [], "length")
        completion = await self.sample()
        text = self.encoder.decode(completion.token_ids)
        return Reply(text, self.texts[-1], prompt_ids, list(completion.token_ids), list(completion.logprobs),
                     completion.finish_reason)  # fmt: skip

    def _check_extension(self, messages: list[dict], tools: list[dict] | None) -> None:
        seen = len(self._seen)
        if tools != self._tools:
            raise ConversationError("the tools changed between turns: the prompt rendered the first call's tools")
        if messages[:seen] != self._seen:
            first = next(i for i, (a, b) in enumerate(zip(messages, self._seen, strict=False)) if a != b) \
                if len(messages) >= seen else len(messages)  # fmt: skip
            raise ConversationError(
                f"the conversation does not extend the rollout: message {first} differs from (or drops) what "
                "the earlier turns were rendered from, so the sampled tokens would not be what was trained"
            )
        if len(messages) <= seen or messages[seen].get("role") != "assistant":
            raise ConversationError(
                f"message {seen} should be the assistant turn just sampled, got "
                f"{messages[seen].get('role') if len(messages) > seen else 'nothing'}"
            )
        if any(m.get("role") == "assistant" for m in messages[seen + 1 :]):
            raise ConversationError("an assistant message the policy did not sample follows its turn")
        if len(messages) == seen + 1:
            raise ConversationError("no new message after the assistant turn: nothing to answer")


async def run_member(
    env: Environment, row: dict, client, encoder: PromptEncoder, sampling: SamplingParams,
    group_id: int, branch: int, budget: int,
) -> Member:  # fmt: skip
    session = RolloutSession(client, encoder, sampling, group_id, branch, budget, env.stop, env.max_turns)
    if isinstance(env, DrivenEnvironment):  # its Turn's tool counts are the rollout's
        turn_result = await env.run(row, session)
        if session.trajectory is None or not session.texts:
            raise ConversationError(f"{type(env).__name__}.run returned before sampling a turn")
        tools = (turn_result.tool_calls, turn_result.tool_errors, turn_result.tool_malformed)
    else:
        session.start(env.prompt(row), env.tool_schemas())
        turn_result, tools = None, (0, 0, 0)
        for _ in range(env.max_turns):
            if session.remaining_tokens <= 0:
                break
            completion = await session.sample()
            turn_result = await env.astep(row, session.texts)
            tools = tuple(a + b for a, b in zip(tools, (turn_result.tool_calls, turn_result.tool_errors,
                                                        turn_result.tool_malformed), strict=True))  # fmt: skip
            if turn_result.done or completion.finish_reason == "length":
                break
            session.observe(turn_result.observation)
    trajectory = session.trajectory
    done = turn_result is not None and turn_result.done
    return Member(
        branch_index=branch, status="finished", trajectory=trajectory,
        reward=turn_result.reward if done else 0.0,
        passed=turn_result.passed if turn_result is not None else None,
        truncated=trajectory.finish_reason == "length" or not done, episode_done=done, turns=session.turns,
        tool_calls=tools[0], tool_errors=tools[1], tool_malformed=tools[2],
        observation_tokens=session.observation_tokens, template_rewrites=session.template_rewrites,
        interruptions=session.interruptions, reprefilled_tokens=session.reprefilled_tokens,
        judge_score=turn_result.judge_score if turn_result is not None else None,
        scores=turn_result.scores if turn_result is not None else None,
        budget_exhausted=session.exhausted or (not done and session.remaining_tokens <= 0),
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
