"""The environment interface (see megatron_rl.envs)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass


@dataclass
class Turn:
    reward: float = 0.0
    # What the environment appends before the next turn: text (tokenised as it is), or messages
    # (`{"role": "tool", "content": ...}`) the chat template renders (orchestrator/chat.py).
    observation: str | list[dict] | None = None
    done: bool = True
    passed: bool | None = None  # for environments with a pass/fail notion (pass rate, eval accuracy)
    tool_calls: int = 0  # tool calls in this turn's completion (per-step metric `tool_calls`)
    tool_errors: int = 0  # of which failed (metric `tool_errors`)
    tool_malformed: int = 0  # of the failed, those the parser could not read (metric `tool_malformed`)
    judge_score: float | None = None  # an LLM judge's verdict in [0, 1] (orchestrator.judge; envs/judge.py)
    # A hub environment's named signals: "reward/NAME" (a reward's unweighted score) and "metric/NAME"
    # (per-step metrics `env/reward/NAME_mean`, `env/metric/NAME_mean`; envs/hubs/).
    scores: dict[str, float] | None = None


class Environment(ABC):
    """One task family. `max_turns` > 1 makes it multi-turn; `stop` strings end a turn."""

    max_turns: int = 1
    stop: tuple[str, ...] = ()

    @abstractmethod
    def row(self, index: int) -> dict:
        """Dataset row `index` (deterministic)."""

    def __len__(self) -> int | None:  # None: endless (procedural)
        return None

    @abstractmethod
    def prompt(self, row: dict) -> str | list[dict]:
        """The prompt: the user message, or a list of messages (`{"role", "content"}`) the chat
        template renders as they are."""

    @abstractmethod
    def step(self, row: dict, completions: list[str]) -> Turn:
        """After turn len(completions): the reward when done, or an observation to continue.
        `completions` are the text of each turn's completion without its reasoning (the part up
        to `orchestrator.reasoning_markers`' end marker); the trained tokens are the sampled ones."""

    async def astep(self, row: dict, completions: list[str]) -> Turn:
        """`step` as the orchestrator calls it: an environment whose step waits on something slow
        (a tool, a sandbox) overrides it to run that off the event loop (envs/tools.py)."""
        return self.step(row, completions)

    def tool_schemas(self) -> list[dict] | None:
        """The tools the chat template renders in the prompt (OpenAI function schemas), or None."""
        return None

    async def aclose(self) -> None:
        """Releases what the environment holds open (a hub adapter's servers and sessions); the
        run calls it once, at its end, on the event loop that ran the rollouts."""
        return None

    def demonstration(self, row: dict) -> list[tuple[str | list[dict], bool]]:
        """A correct rollout of `row` for a supervised warm start (`demo/warm_start.py`): its
        segments after the prompt in order, each (text, True) for the model's own turns or
        (text, False) for the environment's observations (or (messages, False): tool messages the
        chat template renders); the end-of-sequence token follows.

        Optional: only a warm start calls it, and an environment without correct rollouts to
        show (math from a JSONL of answers, most plug-ins) is trained by RL alone, so the
        default names the environment instead of guessing a demonstration."""
        raise NotImplementedError(f"{type(self).__name__} has no demonstrations for a supervised warm start")


@dataclass
class Reply:
    """One sampled turn as an environment that drives its own turns sees it (`ChatModel.chat`)."""

    text: str  # decoded from the sampled token ids, reasoning included
    content: str  # `text` without its reasoning (what `Environment.step` is given)
    prompt_ids: list[int]  # the whole token sequence before this turn (the request's prompt)
    token_ids: list[int]  # the sampled tokens
    logprobs: list[float]  # the sampler's log-probability of each sampled token
    finish_reason: str  # "stop" or "length" (the turn's limit or the rollout's token budget)


class ChatModel(ABC):
    """The policy as an environment that drives its own turns reaches it: `chat` takes the whole
    conversation so far (OpenAI-style messages, as an OpenAI client sends it every turn) and the
    tools, and samples the next assistant turn. The first call's messages are the prompt, rendered
    once with the chat template; every later call must repeat the conversation it was given, then
    the assistant turn it got back, then new messages (tool results, user turns): those are
    rendered after the exact sampled tokens and masked. Anything else is a `ConversationError`."""

    @abstractmethod
    async def chat(self, messages: list[dict], tools: list[dict] | None = None) -> Reply: ...

    @property
    @abstractmethod
    def remaining_tokens(self) -> int:
        """The rollout's token budget left (completions and observations): 0 ends the rollout."""


class ConversationError(ValueError):
    """A conversation handed to `ChatModel.chat` that does not extend the rollout so far."""


class DrivenEnvironment(Environment):
    """An environment that drives its own turns (the hub adapters, envs/hubs/): `run` converses
    with the policy through `model.chat(...)` and returns the rollout's `Turn` (reward, passed,
    tool counts; `done` False when it ended unfinished). The tokens trained on are the sampled
    ones; the environment's messages are rendered by our chat template between them (masked).

    `max_turns` bounds the number of `chat` calls (None: only the token budget bounds them)."""

    max_turns: int | None = None

    def prompt(self, row: dict) -> str | list[dict]:
        raise TypeError(f"{type(self).__name__} drives its own turns: the rollout calls run(), not prompt()")

    def step(self, row: dict, completions: list[str]) -> Turn:
        raise TypeError(f"{type(self).__name__} drives its own turns: the rollout calls run(), not step()")

    @abstractmethod
    async def run(self, row: dict, model: ChatModel) -> Turn:
        """One rollout of `row`: its turns through `model.chat`, its reward in the returned Turn."""
