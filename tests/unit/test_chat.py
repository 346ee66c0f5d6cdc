"""Real chat models in the rollout: Qwen's real BPE (151,643 ranks, Qwen3's added tokens at their
real ids: tests/support/qwen_tokenizer.py) with our ChatML template with tools and thinking.

Prompt ids are exactly the template's render (tools, system prompt, template keywords); a
multi-turn tool rollout is prompt + completion + the template's tool message + completion, masks
1 only on sampled tokens, and its final sequence equals the render of the whole conversation; the
grader and the parser see the answer without the reasoning; a malformed call, an unknown tool and
bad arguments are tool errors the model sees and the metrics count; a template that rewrites
earlier text is detected and the sampled tokens stay; the parsers (hermes, qwen3_coder, plug-ins)
and the tool registry refuse what they cannot read, naming it."""

from __future__ import annotations

import asyncio
import json

import pytest

from megatron_rl.config import ConfigError, load_config, parse_config
from megatron_rl.config.plugins import PluginError
from megatron_rl.envs import (
    Tool,
    ToolCall,
    ToolEnvironment,
    ToolResult,
    Turn,
    make_environment,
    make_tool_parser,
    make_tools,
)
from megatron_rl.envs.tool_parsers import TOOL_PARSERS, HermesParser, ToolParser
from megatron_rl.inference.rollout import SamplingParams
from megatron_rl.orchestrator.chat import ChatTemplateError, PromptEncoder
from megatron_rl.orchestrator.evaluation import Evaluator
from megatron_rl.orchestrator.rollouts import run_member
from megatron_rl.orchestrator.run import prompt_encoder
from tests.support.configs import base as base_config
from tests.support.orchestrator import FakeClient, FakeWeights
from tests.support.qwen_tokenizer import QWEN3_IDS, qwen_tokenizer


def base(**orchestrator) -> dict:
    config = base_config()
    config["orchestrator"].update(orchestrator.get("orchestrator", {}))
    return config


SYSTEM = {"role": "system", "content": "You are a careful calculator."}


class AddTool(Tool):
    """A plug-in tool for the tests: the sum of two numbers."""

    name, description = "add", "Add two numbers."
    parameters = {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                  "required": ["a", "b"], "additionalProperties": False}  # fmt: skip

    def run(self, arguments):
        return ToolResult(str(arguments["a"] + arguments["b"]))


class FailingTool(Tool):
    name, description = "explode", "Always fails."

    def run(self, arguments):
        raise RuntimeError("boom")


class Sums(ToolEnvironment):
    """Rows "What is a + b?" with a system prompt; the add tool; reward 1 for the right number."""

    def __init__(self, dataset=None, seed=0, tools=("tests.unit.test_chat:AddTool",), tool_parser="hermes",
                 max_turns=3):  # fmt: skip
        super().__init__(list(tools), tool_parser, max_turns)
        self.seen: list[list[str]] = []

    def row(self, index):
        return {"index": index, "a": 20 + index, "b": 22, "answer": str(42 + index)}

    def prompt(self, row):
        return [SYSTEM, {"role": "user", "content": f"What is {row['a']} + {row['b']}?"}]

    def grade(self, row, answer):
        return Turn(reward=float(row["answer"] in answer), passed=row["answer"] in answer)

    async def astep(self, row, completions):
        self.seen.append(list(completions))
        return await super().astep(row, completions)


@pytest.fixture(scope="module")
def qwen():
    return qwen_tokenizer()


def completion(tokenizer, text: str, eos: bool = True) -> list[int]:
    """The ids a model would sample for `text` (its canonical tokens) and <|im_end|>."""
    return tokenizer.encode(text, add_special_tokens=False) + ([QWEN3_IDS["<|im_end|>"]] if eos else [])


def call(name: str, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def roll(env, encoder, script, max_tokens=256, budget=1024):
    client = FakeClient(FakeWeights(), script=script)
    sampling = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=max_tokens, seed=0)
    member = asyncio.run(run_member(env, env.row(0), client, encoder, sampling, 0, 0, budget))
    return member, client


def test_the_real_vocabulary_and_added_tokens(qwen):
    assert qwen.encode("Hello world", add_special_tokens=False) == [9707, 1879]
    for text in ["def f(x):\n\treturn x  # tabs\n", "数学题：二加三等于几？", "The answer is \\boxed{5}."]:
        assert qwen.decode(qwen.encode(text, add_special_tokens=False)) == text
    assert {token: qwen.convert_tokens_to_ids(token) for token in QWEN3_IDS} == QWEN3_IDS
    assert qwen.eos_token_id == 151645 and qwen.pad_token_id == 151643
    ids = completion(qwen, "<think>\nhmm\n</think>\n\n" + call("add", a=1, b=2))
    assert ids.count(QWEN3_IDS["<tool_call>"]) == 1 and ids.count(QWEN3_IDS["<think>"]) == 1
    # decoding keeps the added tokens that are not special, drops the special ones
    assert PromptEncoder(qwen).decode(ids) == "<think>\nhmm\n</think>\n\n" + call("add", a=1, b=2)


def test_prompt_ids_are_the_templates_render_with_tools_system_and_keywords(qwen):
    env = Sums()
    for kwargs in ({}, {"enable_thinking": False}):
        encoder = PromptEncoder(qwen, template_kwargs=kwargs)
        messages = env.prompt(env.row(0))
        ids = encoder.prompt(messages, env.tool_schemas())
        assert ids == list(qwen.apply_chat_template(messages, tools=env.tool_schemas(), add_generation_prompt=True,
                                                    tokenize=True, return_dict=False, **kwargs))  # fmt: skip
        text = qwen.decode(ids)
        assert '"name": "add"' in text and text.count("<|im_start|>system") == 1 and SYSTEM["content"] in text
        assert text.endswith("<think>\n\n</think>\n\n") == (kwargs == {"enable_thinking": False})
    # a string prompt is one user message
    assert PromptEncoder(qwen).prompt("hi") == list(
        qwen.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True,
                                 return_dict=False))  # fmt: skip


def test_a_tool_rollout_is_prompt_completion_tool_message_completion_and_equals_the_render(qwen):
    env, encoder = Sums(), PromptEncoder(qwen)
    first = "<think>\nI should add them.\n</think>\n\n" + call("add", a=20, b=22)
    second = "<think>\nThe tool said 42.\n</think>\n\nThe answer is 42."
    script = [completion(qwen, first), completion(qwen, second)]
    member, client = roll(env, encoder, script)
    trajectory = member.trajectory
    assert member.reward == 1.0 and member.turns == 2 and member.tool_calls == 1 and member.tool_errors == 0
    # the grader and the parser saw the answers without the reasoning
    assert env.seen == [[call("add", a=20, b=22)], [call("add", a=20, b=22), "The answer is 42."]]
    # tokens: prompt + sampled + the template's tool message (+ the "\n" closing <|im_end|>) + sampled
    messages = env.prompt(env.row(0))
    prompt = encoder.prompt(messages, env.tool_schemas())
    tool_message = qwen.encode("\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n"
                               "<|im_start|>assistant\n", add_special_tokens=False)  # fmt: skip
    assert trajectory.token_ids == prompt + script[0] + tool_message + script[1]
    assert client.calls[1]["prompt"] == prompt + script[0] + tool_message
    mask = [0] * len(prompt) + [1] * len(script[0]) + [0] * len(tool_message) + [1] * len(script[1])
    assert trajectory.loss_mask == mask
    # the whole conversation's render (a pure extension: this template never rewrites a turn)
    conversation = messages + [{"role": "assistant", "content": first}, {"role": "tool", "name": "add", "content": "42"},
                               {"role": "assistant", "content": second}]  # fmt: skip
    render = qwen.apply_chat_template(
        conversation, tools=env.tool_schemas(), tokenize=True, return_dict=False
    )
    assert trajectory.token_ids + qwen.encode("\n") == list(render)
    assert member.template_rewrites == 0


def test_malformed_calls_unknown_tools_bad_arguments_and_failing_tools_are_counted_tool_errors(qwen):
    env = Sums(tools=("tests.unit.test_chat:AddTool", "tests.unit.test_chat:FailingTool"), max_turns=4)
    turns = [
        "<tool_call>\n{not json}\n</tool_call>",  # malformed
        call("multiply", a=2, b=3) + "\n" + call("add", a="two", b=3),  # unknown tool, a wrong type
        call("explode") + "\n" + call("add", a=20, b=22),  # a failing tool, then a good call
        "42",
    ]
    member, client = roll(env, PromptEncoder(qwen), [completion(qwen, t) for t in turns])
    assert member.reward == 1.0 and member.turns == 4
    assert member.tool_calls == 5 and member.tool_errors == 4 and member.tool_malformed == 1
    seen = qwen.decode(client.calls[3]["prompt"])
    assert "Error: malformed tool call: tool call 1: not JSON" in seen
    assert "Error: unknown tool 'multiply' (tools: ['add', 'explode'])" in seen
    assert "Error: add: argument 'a' must be number, got str" in seen
    assert (
        "Error: explode failed: RuntimeError: boom" in seen
        and "<tool_response>\n42\n</tool_response>" in seen
    )
    # an unterminated call at the end of the budget of turns ends the rollout with reward 0
    member, _ = roll(
        Sums(max_turns=1), PromptEncoder(qwen), [completion(qwen, '<tool_call>\n{"name": "add"')]
    )
    assert member.episode_done and member.reward == 0.0 and member.tool_calls == 1 and member.tool_errors == 1
    assert member.tool_malformed == 1


def test_a_completion_cut_by_a_stop_string_gets_the_whole_closing_of_its_turn(qwen):
    env, encoder = Sums(), PromptEncoder(qwen)
    script = [completion(qwen, call("add", a=20, b=22), eos=False), completion(qwen, "42")]
    member, _ = roll(env, encoder, script)
    start, end = member.trajectory.observation_spans[0]
    observation = member.trajectory.token_ids[start:end]
    assert observation[0] == QWEN3_IDS["<|im_end|>"] and qwen.decode(observation).startswith(
        "<|im_end|>\n<|im_start|>user"
    )


REWRITING = (  # drops the reasoning of every assistant turn but the last, as Qwen3's own template does
    "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' }}"
    "{%- if m['role'] == 'assistant' and not loop.last %}{{- m['content'].split('</think>')[-1].lstrip() }}"
    "{%- else %}{{- m['content'] }}{%- endif %}{{- '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def test_a_template_that_rewrites_earlier_turns_is_detected_and_the_sampled_tokens_stay(qwen):
    env = Sums(tools=("tests.unit.test_chat:AddTool",))
    encoder = PromptEncoder(qwen, template=REWRITING)
    first = "<think>\nadd\n</think>\n\n" + call("add", a=20, b=22)
    script = [completion(qwen, first), completion(qwen, "42")]
    member, _ = roll(env, encoder, script)
    assert member.template_rewrites == 1 and member.reward == 1.0
    prompt = encoder.prompt(env.prompt(env.row(0)), env.tool_schemas())
    ids = member.trajectory.token_ids
    assert ids[: len(prompt) + len(script[0])] == prompt + script[0] and ids[-len(script[1]) :] == script[1]
    # the tool message is the template's, rendered after a reference conversation
    assert qwen.decode(ids[len(prompt) + len(script[0]) : -len(script[1])]) == (
        "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    )
    # a template that rewrites even the reference conversation cannot extend a rollout
    hopeless = "{{- messages | length }}{%- for m in messages %}{{- m['content'] }}{%- endfor %}"
    with pytest.raises(ChatTemplateError, match="rewrites earlier text"):
        PromptEncoder(qwen, template=hopeless).extend(
            [], completion(qwen, "x"), [{"role": "tool", "content": "1"}]
        )


def test_reasoning_markers_decide_what_the_grader_sees(qwen):
    encoder = PromptEncoder(qwen)
    assert encoder.answer("<think>\nlong\n</think>\n\nThe answer is 5.") == "The answer is 5."
    assert encoder.answer("<think>\nstill thinking") == ""  # unfinished: no answer
    assert encoder.answer("no reasoning, 5") == "no reasoning, 5"
    assert encoder.answer("reasoning opened by the template</think> 5") == "5"
    assert PromptEncoder(qwen, reasoning_markers=None).answer("<think>a</think>b") == "<think>a</think>b"
    custom = PromptEncoder(qwen, reasoning_markers=("[R]", "[/R]"))
    assert custom.answer("[R]x[/R] y") == "y"


def test_the_environment_is_checked_against_the_tokenizer_and_template(qwen):
    from transformers import PreTrainedTokenizerFast

    env = Sums()
    PromptEncoder(qwen).check_environment(env)
    with pytest.raises(ChatTemplateError, match="declares tools, which only a chat template renders"):
        PromptEncoder(qwen, use_chat_template=False).check_environment(env)
    # Named a special token (transformers 5 lists it in all_special_tokens) but not special in the
    # backend: decoding keeps it, so the run can read its calls and is not refused.
    named = PreTrainedTokenizerFast(tokenizer_object=qwen.backend_tokenizer, eos_token="<|im_end|>",
                                    additional_special_tokens=["<tool_call>"])  # fmt: skip
    named.chat_template = qwen.chat_template
    assert "<tool_call>" in named.all_special_tokens
    PromptEncoder(named).check_environment(env)
    with pytest.raises(ChatTemplateError, match="set by the rollout itself"):
        PromptEncoder(qwen, template_kwargs={"tools": []})


@pytest.fixture(scope="module")
def special_in_tokenizer_json(qwen):
    """token -> Qwen's tokenizer with `token` marked special in its tokenizer.json (the backend),
    not named among the special tokens: transformers 5 leaves it out of `all_special_tokens`,
    and decoding drops it. Each built once (about a second: the whole vocabulary is copied)."""
    from tokenizers import AddedToken, Tokenizer
    from transformers import PreTrainedTokenizerFast

    built = {}

    def tokenizer(token: str):
        if token not in built:
            backend = Tokenizer.from_str(qwen.backend_tokenizer.to_str())
            backend.add_special_tokens([AddedToken(token, special=True, normalized=False)])
            built[token] = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>")
            built[token].chat_template = qwen.chat_template
        return built[token]

    return tokenizer


@pytest.mark.parametrize("parser", sorted(TOOL_PARSERS))
def test_a_tag_that_decoding_drops_is_refused_for_every_parser(qwen, special_in_tokenizer_json, parser):
    """The check asks the tokenizer (encode, decode, compare), not its list of special tokens: a
    tag marked special only in tokenizer.json is refused by name, for each built-in parser, each
    of its tags, and for the reasoning markers; Qwen's own tokenizer keeps every tag."""
    env = Sums(tool_parser=parser)
    PromptEncoder(qwen).check_environment(env)
    for tag in make_tool_parser(parser).tags:
        tokenizer = special_in_tokenizer_json(tag)
        assert tag not in tokenizer.all_special_tokens  # what the old check looked at
        assert tag not in tokenizer.decode(tokenizer.encode(tag), skip_special_tokens=True)
        with pytest.raises(ChatTemplateError) as refused:
            PromptEncoder(tokenizer).check_environment(env, "orchestrator.eval (held-out).environment")
        message = str(refused.value)
        assert message.startswith(
            f"orchestrator.eval (held-out).environment: tool parser {parser!r} needs {tag!r}, but tokenizer "
        ), message
        assert f"decodes it as '' (ids [{QWEN3_IDS[tag]}]): {tag!r} is a special token there" in message
    thinking = special_in_tokenizer_json("</think>")
    with pytest.raises(
        ChatTemplateError, match="orchestrator.reasoning_markers needs '</think>', but tokenizer"
    ):
        PromptEncoder(thinking).check_environment(env)
    PromptEncoder(thinking, reasoning_markers=None).check_environment(env)  # no marker needed: accepted


def test_hermes_parser():
    parser = make_tool_parser("hermes")
    text = 'Let me compute.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n' \
           '<tool_call>{"name": "f", "arguments": "{\\"x\\": [1]}"}</tool_call>'  # fmt: skip
    parsed = parser.parse(text)
    assert parsed.calls == [ToolCall("add", {"a": 1, "b": 2}), ToolCall("f", {"x": [1]})]
    assert parsed.errors == [] and parsed.content == "Let me compute."
    assert parser.parse("no call here").attempted == 0
    cases = {
        "<tool_call>{bad}</tool_call>": "tool call 1: not JSON",
        "<tool_call>[1, 2]</tool_call>": "a JSON object with name and arguments, got list",
        '<tool_call>{"arguments": {}}</tool_call>': "no function name",
        '<tool_call>{"name": "f", "arguments": 3}</tool_call>': "arguments must be a JSON object, got int",
        '<tool_call>{"name": "f", "arguments": "{oops"}</tool_call>': "arguments are a string that is not JSON",
        '<tool_call>{"name": "f"': "<tool_call> is never closed by </tool_call>",
        "the end</tool_call>": "</tool_call> without an opening <tool_call>",
    }
    for text, message in cases.items():
        parsed = parser.parse(text)
        assert parsed.calls == [] and len(parsed.errors) == 1 and message in parsed.errors[0], (text, parsed)
    # a malformed call does not hide the good ones around it
    parsed = parser.parse(call("a", x=1) + "<tool_call>nope</tool_call>" + call("b"))
    assert [c.name for c in parsed.calls] == ["a", "b"] and len(parsed.errors) == 1


def test_qwen3_coder_parser():
    parser = make_tool_parser("qwen3_coder")
    text = ("I'll run it.\n<tool_call>\n<function=python>\n<parameter=code>\nprint(1 + 2)\n</parameter>\n"
            "<parameter=timeout>\n5\n</parameter>\n<parameter=flags>\n[\"a\"]\n</parameter>\n</function>\n</tool_call>")  # fmt: skip
    parsed = parser.parse(text)
    assert parsed.calls == [ToolCall("python", {"code": "print(1 + 2)", "timeout": 5, "flags": ["a"]})]
    assert parsed.content == "I'll run it."
    for body, message in {
        "<tool_call>{}</tool_call>": "no <function=NAME>",
        "<tool_call><function=f>stray<parameter=x>1</parameter></function></tool_call>": "not a <parameter=...> block",
        "<tool_call><function=f><parameter=x>1</parameter><parameter=x>2</parameter></function></tool_call>": "given twice",
    }.items():  # fmt: skip
        assert message in parser.parse(body).errors[0]


class Bracketed(ToolParser):
    """A plug-in parser: [[name]] calls without arguments."""

    name, tags = "bracketed", ("[[", "]]")

    def parse(self, text):
        from megatron_rl.envs.tool_parsers import ParsedCompletion

        names = [part.split("]]")[0] for part in text.split("[[")[1:]]
        return ParsedCompletion(text.split("[[")[0].strip(), [ToolCall(n, {}) for n in names])


def test_parser_and_tool_registries_take_plug_ins_and_name_what_they_refuse():
    assert isinstance(make_tool_parser("tests.unit.test_chat:Bracketed"), Bracketed)
    assert isinstance(make_tool_parser("hermes"), HermesParser)
    with pytest.raises(
        ValueError, match=r"unknown tool parser 'mistral' \(known: \['hermes', 'qwen3_coder'\]"
    ):
        make_tool_parser("mistral")
    with pytest.raises(PluginError, match="returned a AddTool, not a megatron_rl.envs.ToolParser"):
        make_tool_parser("tests.unit.test_chat:AddTool")
    assert [t.name for t in make_tools({"tests.unit.test_chat:AddTool": {}})] == ["add"]
    with pytest.raises(ValueError, match="unknown tool 'calculator'"):
        make_tools(["calculator"])
    with pytest.raises(ValueError, match="two tools share a name"):
        make_tools(["tests.unit.test_chat:AddTool", "tests.unit.test_chat:AddTool"])
    with pytest.raises(ValueError, match=r"tools.tests.unit.test_chat:AddTool: .*unexpected keyword"):
        make_tools({"tests.unit.test_chat:AddTool": {"colour": "red"}})
    tool = AddTool()
    assert tool.check({"a": 1}) == "missing required argument(s) ['b'] (parameters: ['a', 'b'])"
    assert tool.check({"a": 1, "b": 2, "c": 3}) == "unknown argument(s) ['c'] (parameters: ['a', 'b'])"
    assert tool.check({"a": True, "b": 2}) == "argument 'a' must be number, got bool"
    assert tool({"a": 1.5, "b": 2}).content == "3.5"
    assert tool.schema()["function"]["parameters"]["required"] == ["a", "b"]


def test_math_with_messages_and_a_tool_from_environment_args(tmp_path, qwen):
    dataset = tmp_path / "math.jsonl"
    dataset.write_text(json.dumps({"prompt": [SYSTEM, {"role": "user", "content": "What is 20 + 22?"}],
                                   "reward_model": {"ground_truth": "42"}}) + "\n")  # fmt: skip
    env = make_environment("math", str(dataset), args={"tools": ["tests.unit.test_chat:AddTool"]})
    assert env.max_turns == 4 and env.tool_schemas()[0]["function"]["name"] == "add"
    script = [completion(qwen, call("add", a=20, b=22)), completion(qwen, "<think>ok</think>\\boxed{42}")]
    member, _ = roll(env, PromptEncoder(qwen), script)
    assert member.reward == 1.0 and member.tool_calls == 1 and member.turns == 2
    # without tools: one turn, graded, and tags in the answer are only text
    plain = make_environment("math", str(dataset))
    assert plain.max_turns == 1 and plain.tool_schemas() is None
    member, _ = roll(plain, PromptEncoder(qwen), [completion(qwen, call("add", a=1, b=2) + " 42")])
    assert member.turns == 1 and member.tool_calls == 0 and member.reward == 1.0


def test_eval_sets_render_with_their_own_template_keywords_and_report_mean_at_k(tmp_path, qwen):
    dataset = tmp_path / "math.jsonl"
    dataset.write_text(
        "".join(json.dumps({"prompt": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n" for i in range(3))
    )
    config = parse_config(base(orchestrator={"eval": [
        {"name": "think", "environment": "math", "dataset": str(dataset), "num_examples": 3, "samples_per_example": 2},
        {"name": "nothink", "environment": "math", "dataset": str(dataset), "num_examples": 3, "samples_per_example": 2,
         "chat_template_kwargs": {"enable_thinking": False}},
    ]}))  # fmt: skip

    class Answers(FakeClient):  # the right answer for the first sample of each prompt only
        async def complete(self, prompt_ids, sampling, session_id, **kwargs):
            self.calls.append({"prompt": list(prompt_ids), "session": session_id})
            question = qwen.decode(prompt_ids).rsplit("What is ", 1)[1].split(" +")[0]
            right = session_id.endswith("branch0")
            from megatron_rl.inference.rollout import Completion

            text = str(int(question) + 1) if right else "7 is wrong"
            return Completion(completion(qwen, text), [0.0] * 2, "stop", 0, "fake")

    client = Answers(FakeWeights())
    evaluator = Evaluator(config.orchestrator.eval, client, PromptEncoder(qwen), 16, 0)
    results = asyncio.run(evaluator.run(0))
    for name in ("think", "nothink"):
        assert results[f"eval/{name}/pass@2"] == 1.0 and results[f"eval/{name}/mean@2"] == 0.5
    prompts = [qwen.decode(c["prompt"]) for c in client.calls]
    assert sum(p.endswith("<think>\n\n</think>\n\n") for p in prompts) == 6  # the nothink set's six


def test_chat_config_keys_are_checked(tmp_path, qwen):
    with pytest.raises(ConfigError, match="are set by the rollout itself"):
        parse_config(base(orchestrator={"chat_template_kwargs": {"add_generation_prompt": False}}))
    with pytest.raises(ConfigError, match=r"eval \(e\).chat_template_kwargs: \['tokenize'\]"):
        parse_config(base(orchestrator={"eval": [{"name": "e", "chat_template_kwargs": {"tokenize": True}}]}))
    with pytest.raises(ConfigError, match="reasoning_markers: two different non-empty strings"):
        parse_config(base(orchestrator={"reasoning_markers": ["<t>", "<t>"]}))
    assert parse_config(base(orchestrator={"reasoning_markers": None})).orchestrator.reasoning_markers is None
    with pytest.raises(ConfigError, match="orchestrator.chat_template: no template file .*missing.jinja"):
        parse_config(base(orchestrator={"chat_template": "missing.jinja"}))
    template = tmp_path / "chat.jinja"
    template.write_text(REWRITING)
    config = base(
        orchestrator={"chat_template": "chat.jinja", "chat_template_kwargs": {"enable_thinking": False}}
    )
    (tmp_path / "run.yaml").write_text(json.dumps(config))
    resolved = load_config(tmp_path / "run.yaml")  # relative to the config file
    assert resolved.orchestrator.chat_template == str(template)
    encoder = prompt_encoder(resolved.orchestrator, qwen)
    assert encoder.template == REWRITING and encoder.template_kwargs == {"enable_thinking": False}


def test_parsers_write_the_calls_they_read():
    calls = [
        ToolCall("python", {"code": "print(6 * 7)\nx = 'a'"}),
        ToolCall("f", {"n": 3, "xs": [1, 2], "ok": True}),
    ]
    for name in ("hermes", "qwen3_coder"):
        parser = make_tool_parser(name)
        for c in calls:
            assert parser.parse(parser.format(c)).calls == [c], name


def test_an_arithmetic_demonstration_is_laid_out_exactly_as_its_rollout(qwen):
    """The warm start's tokens and mask for a demonstration equal those of a rollout whose
    completions are the demonstration's own turns: the same prompt, template, tool message."""
    from megatron_rl.demo.warm_start import demonstration_tokens

    env = make_environment("arithmetic", None, seed=3, args={"tools": ["tests.unit.test_chat:AddTool"],
                                                             "system": "Use the tool."})  # fmt: skip
    with pytest.raises(ValueError, match="demonstrations call the python tool"):
        env.demonstration(env.row(0))
    env = make_environment("arithmetic", None, seed=3, args={"system": "Use the tool."})
    row = env.row(0)
    assert row["code"].startswith("print(") and str(eval(row["code"][6:-1])) == row["answer"]
    encoder, eos = PromptEncoder(qwen), qwen.eos_token_id
    ids, mask = demonstration_tokens(env, encoder, row, eos)
    turns = [segment for segment, action in env.demonstration(row) if action]
    script = [qwen.encode(text, add_special_tokens=False) + [eos] for text in turns]
    member, _ = roll(env, encoder, script)
    assert member.reward == 1.0 and member.tool_calls == 1 and member.tool_errors == 0
    assert member.trajectory.token_ids == ids and member.trajectory.loss_mask == mask
    assert env.grade(row, f"it is {row['answer']}").passed and not env.grade(row, "no idea").passed
    with pytest.raises(ValueError, match="generates its rows"):
        make_environment("arithmetic", "rows.jsonl")
    with pytest.raises(ValueError, match=r"ops: a string of \+ - \*"):
        make_environment("arithmetic", None, args={"ops": "/"})


def test_the_tiny_tool_tokenizer_keeps_qwens_tags_and_renders_tools():
    """models/tiny.py's `bpe-tools`: the tags are single added tokens that decoding keeps, the
    template renders the tools, and the rollout checks pass for the arithmetic environment."""
    from megatron_rl.models.tiny import TOOL_TAGS, build_tool_tokenizer

    tokenizer = build_tool_tokenizer(512, seed=0)
    assert len(tokenizer) == 512 and not set(TOOL_TAGS) & set(tokenizer.all_special_tokens)
    for tag in TOOL_TAGS:
        assert len(tokenizer.encode(tag, add_special_tokens=False)) == 1
    env = make_environment("arithmetic", None, seed=0)
    encoder = PromptEncoder(tokenizer)
    encoder.check_environment(env)
    text = env.demonstration(env.row(0))[0][0]
    assert encoder.decode(tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]) == text
    prompt = tokenizer.decode(encoder.prompt(env.prompt(env.row(0)), env.tool_schemas()))
    assert '"name": "python"' in prompt and prompt.endswith("<|im_start|>assistant\n")


def test_a_marker_the_tokenizer_cannot_write_is_no_reasoning_to_hide_but_a_tag_is_refused():
    """The demo's character vocabulary has no `<` or `>`: the default reasoning markers cannot be
    written (the model can never open a reasoning), so they are not refused; a tool parser's tag
    that cannot be written is (no call could ever be made), naming the missing characters. With
    the tool characters the markers are writable and decoding keeps them."""
    from megatron_rl.models.tiny import build_char_tokenizer

    chars = build_char_tokenizer(128)
    PromptEncoder(chars).check_environment(make_environment("procedural", dataset="count", seed=0))  # the demo
    with pytest.raises(ChatTemplateError) as refused:
        PromptEncoder(chars).check_environment(Sums(tool_parser="hermes"))
    message = str(refused.value)
    assert message.startswith("orchestrator.environment: tool parser 'hermes' needs '<tool_call>', but tokenizer ")
    assert "cannot write it: '<>_' are outside its vocabulary" in message and "never write a tool call" in message
    with_tools = PromptEncoder(build_char_tokenizer(128, tool_characters=True))
    assert with_tools.unwritable("</think>") is None and with_tools.decoding_drops("</think>") is None
