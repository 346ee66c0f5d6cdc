"""The chat side of a rollout: our tokenizer and its chat template around the exact token ids.

- **Prompt.** `prompt(prompt, tools)` is exactly `apply_chat_template(messages, tools=tools,
  add_generation_prompt=True, **chat_template_kwargs)`; a string prompt is one user message. The
  template is the tokenizer's own or a file (`orchestrator.chat_template`).
- **Completion.** `decode(ids)` keeps the added tokens that are not special (`<think>`,
  `<tool_call>`, as in Qwen3's tokenizer) and drops the special ones (`<|im_end|>`);
  `answer(text)` removes the reasoning (everything up to the last end marker of
  `orchestrator.reasoning_markers`; an unfinished reasoning leaves no answer): the grader and the
  tool parser see the answer. The trained tokens are the sampled ones; nothing is re-rendered.
- **Tool messages.** `extend(conversation, completion_ids, messages, tools)` gives the tokens
  that follow the sampled ones: what the template closes the assistant's turn with that the
  model did not sample (Qwen's "\\n" after `<|im_end|>`, or all of `<|im_end|>\\n` after a stop
  string), then the template's render of the new messages and the next generation prompt:
  render(conversation + messages) minus render(conversation), when the first extends the second.
  A template that rewrites earlier text when a message follows (Qwen3's drops the empty
  `<think></think>` it rendered for the last assistant turn) is detected; the messages are then
  rendered after a minimal reference conversation instead, and the rollout counts a
  `template_rewrites`. The sampled tokens stay as they were in either case.
"""

from __future__ import annotations

from megatron_rl.config.orchestrator import template_kwargs_error
from megatron_rl.envs import Environment

_CONTENT = "\u27e6megatron-rl content\u27e7"  # a stand-in whose render locates the turn's closing text
_REFERENCE = [
    {"role": "user", "content": "\u27e6reference\u27e7"},
    {"role": "assistant", "content": _CONTENT},
]


class ChatTemplateError(ValueError):
    """A template or tokenizer that cannot do what the rollout needs, with what to change."""


def _overlap(text: str, closing: str) -> int:
    """The longest n with text ending in closing[:n]: what the model already sampled of it."""
    for n in range(min(len(text), len(closing)), 0, -1):
        if text.endswith(closing[:n]):
            return n
    return 0


class PromptEncoder:
    """Our tokenizer's side of the rollout (see the module's docstring)."""

    def __init__(self, tokenizer, use_chat_template: bool = True, template: str | None = None,
                 template_kwargs: dict | None = None,
                 reasoning_markers: tuple[str, str] | None = ("<think>", "</think>")):  # fmt: skip
        self.tokenizer = tokenizer
        self.template = template if template is not None else getattr(tokenizer, "chat_template", None)
        self.use_chat_template = use_chat_template and bool(self.template)
        self.template_kwargs = dict(template_kwargs or {})
        problem = template_kwargs_error(self.template_kwargs, "chat_template_kwargs")
        if problem:
            raise ChatTemplateError(problem)
        self.reasoning_markers = tuple(reasoning_markers) if reasoning_markers else None

    def with_template_kwargs(self, template_kwargs: dict | None) -> PromptEncoder:
        """The same encoder with other template keywords (an eval set's); None: these."""
        if template_kwargs is None:
            return self
        return PromptEncoder(self.tokenizer, self.use_chat_template, self.template, template_kwargs,
                             self.reasoning_markers)  # fmt: skip

    # --- checks before a run ---------------------------------------------------------------
    def check_environment(self, env: Environment, key: str = "orchestrator.environment") -> None:
        """Refuses what would silently go wrong in the rollouts: tools without a template to
        render them, parser tags the tokenizer cannot write (no tool call could ever be made), and
        parser tags or reasoning markers that decoding would drop. A reasoning marker the tokenizer
        cannot write (a character vocabulary without `<`) is no reasoning to hide: not refused."""
        if env.tool_schemas() and not self.use_chat_template:
            raise ChatTemplateError(
                f"{key}: the environment declares tools, which only a chat template renders; "
                "orchestrator.chat_template is off or the tokenizer has no template"
            )
        parser = getattr(env, "parser", None)
        for tag in getattr(parser, "tags", ()):
            unknown = self.unwritable(tag)
            if unknown:
                raise ChatTemplateError(
                    f"{key}: tool parser {parser.name!r} needs {tag!r}, but {unknown}: the model could "
                    "never write a tool call"
                )
        needed = [(tag, f"tool parser {parser.name!r}") for tag in getattr(parser, "tags", ())]
        markers = [m for m in self.reasoning_markers or () if not self.unwritable(m)]
        needed += [(marker, "orchestrator.reasoning_markers") for marker in markers]
        for tag, who in needed:
            problem = self.decoding_drops(tag)
            if problem:
                raise ChatTemplateError(
                    f"{key}: {who} needs {tag!r}, but {problem}, so it would never be seen. Make it an added "
                    "token that is not special (as Qwen3's tokenizer has <tool_call> and <think>)"
                )

    def unwritable(self, text: str) -> str | None:
        """Why this tokenizer cannot write `text` (its encoding holds the unknown token: characters
        outside the vocabulary), or None when it can."""
        unk = getattr(self.tokenizer, "unk_token_id", None)
        ids = self.encode(text)
        if unk is None or unk not in ids:
            return None
        name = getattr(self.tokenizer, "name_or_path", "") or type(self.tokenizer).__name__
        missing = sorted({c for c in text if unk in self.encode(c)})
        return (
            f"tokenizer {name!r} cannot write it: {''.join(missing)!r} "
            f"{'is' if len(missing) == 1 else 'are'} outside its vocabulary (ids {ids})"
        )

    def decoding_drops(self, text: str) -> str | None:
        """What happens to `text` on its way through the rollout (encoded, then decoded as the
        sampled ids are), when it does not come back whole; None when it does. Asked of the
        tokenizer itself: a token marked special in tokenizer.json is dropped by decoding whether
        or not `all_special_tokens` lists it (transformers 5 lists only the named ones)."""
        ids = self.encode(text)
        decoded = self.decode(ids)
        if text in decoded:
            return None
        name = getattr(self.tokenizer, "name_or_path", "") or type(self.tokenizer).__name__
        added = getattr(self.tokenizer, "added_tokens_decoder", {}) or {}
        special = [added[i].content for i in ids if i in added and getattr(added[i], "special", False)]
        why = (
            f": {special[0]!r} is a special token there, and decoding drops special tokens" if special else ""
        )
        return f"tokenizer {name!r} decodes it as {decoded!r} (ids {ids}){why}"

    # --- prompt ------------------------------------------------------------------------------
    @staticmethod
    def messages(prompt: str | list[dict]) -> list[dict]:
        return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]

    def render(self, messages: list[dict], tools: list[dict] | None = None, generation: bool = False) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=generation, tokenize=False, chat_template=self.template,
            **self.template_kwargs,
        )  # fmt: skip

    def prompt(self, prompt: str | list[dict], tools: list[dict] | None = None) -> list[int]:
        """The prompt's ids: a string is the user message; a list of messages (a system prompt,
        few-shot turns) is rendered as it is, with the generation prompt after it."""
        if self.use_chat_template:
            ids = self.tokenizer.apply_chat_template(
                self.messages(prompt), tools=tools, add_generation_prompt=True, tokenize=True,
                chat_template=self.template, **self.template_kwargs,
            )  # fmt: skip
            return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        if not isinstance(prompt, str):
            raise ChatTemplateError("a prompt of messages needs a chat template; this tokenizer has none")
        if tools:
            raise ChatTemplateError("tools need a chat template to render them; this tokenizer has none")
        return self.encode(prompt)

    # --- completion ----------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def answer(self, text: str) -> str:
        """`text` without its reasoning: what follows the last end marker; nothing when the
        reasoning never ended; all of it when there is no marker."""
        if not self.reasoning_markers:
            return text
        start, end = self.reasoning_markers
        if end in text:
            return text.rsplit(end, 1)[1].strip()
        return "" if start in text else text

    # --- observations ------------------------------------------------------------------------
    def observation(self, text: str) -> list[int]:
        """A text observation: its tokens as they are (no template around them)."""
        return self.encode(text)

    def extend(self, conversation: list[dict], completion_ids: list[int], messages: list[dict],
               tools: list[dict] | None = None) -> tuple[list[int], bool]:  # fmt: skip
        """The tokens after the sampled `completion_ids` (the last assistant turn; `conversation`
        is everything before it) that render `messages` and the next generation prompt, and
        whether the template rewrote earlier text (module docstring). `conversation` gets the
        assistant turn and `messages` appended, ready for the next turn."""
        if not self.use_chat_template:
            raise ChatTemplateError(
                "the environment answered with messages, which only a chat template renders"
            )
        before_turn = list(conversation)
        history = [*before_turn, {"role": "assistant", "content": self.decode(completion_ids)}]
        before = self.render(history, tools)
        after = self.render(history + messages, tools, generation=True)
        rewritten = not after.startswith(before)
        if rewritten:
            before = self.render(_REFERENCE, tools)
            after = self.render(_REFERENCE + messages, tools, generation=True)
            if not after.startswith(before):
                raise ChatTemplateError(
                    f"the chat template rewrites earlier text when a {messages[0].get('role')!r} message follows, "
                    "even after a minimal conversation: a rollout cannot be extended token by token with it"
                )
        closing = self.closing(before_turn, tools)
        sampled = self.tokenizer.decode(completion_ids, skip_special_tokens=False)
        conversation[:] = history + messages
        return self.encode(closing[_overlap(sampled, closing) :] + after[len(before) :]), rewritten

    def closing(self, conversation: list[dict], tools: list[dict] | None = None) -> str:
        """The text the template puts after an assistant turn's content (ChatML: "<|im_end|>\\n")."""
        text = self.render([*conversation, {"role": "assistant", "content": _CONTENT}], tools)
        if _CONTENT not in text:
            raise ChatTemplateError(
                "the chat template does not render an assistant message's content as it is"
            )
        return text.rsplit(_CONTENT, 1)[1]
