"""The orchestrator's section: rollouts (the environment, sampling, groups and batches),
admission, dynamic sampling, overlong shaping, asynchrony and held-out evaluation."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, model_validator

from megatron_rl.config.base import Strict, secret_from_env
from megatron_rl.config.distillation import serve_unless_url
from megatron_rl.config.hubs import HubEnvironment
from megatron_rl.config.inference import ServeConfig

# Keywords the rollout passes the chat template itself: chat_template_kwargs may not set them.
RESERVED_TEMPLATE_KEYWORDS = frozenset(
    {"conversation", "messages", "tools", "add_generation_prompt", "tokenize", "chat_template",
     "continue_final_message", "return_dict", "return_tensors", "documents"}
)  # fmt: skip


def template_kwargs_error(kwargs: dict | None, key: str) -> str | None:
    reserved = sorted(RESERVED_TEMPLATE_KEYWORDS & set(kwargs or ()))
    return f"{key}: {reserved} are set by the rollout itself, not by the config" if reserved else None

# The built-in environments and their classes, by import path (config sits below envs; a test
# checks this against envs.ENVIRONMENTS).
BUILTIN_ENVIRONMENTS = {
    "procedural": "megatron_rl.envs.procedural:ProceduralTask",
    "math": "megatron_rl.envs.math:MathEnvironment",
    "calculator": "megatron_rl.envs.calculator:CalculatorEnvironment",
    "arithmetic": "megatron_rl.envs.arithmetic:ArithmeticEnvironment",
}


def _environment_name(value: str) -> str:
    """A built-in environment (procedural, math, calculator, arithmetic) or a plug-in 'package.module:name'."""
    if ":" not in value and value not in BUILTIN_ENVIRONMENTS:
        raise ValueError(
            f"unknown environment {value!r}; choose from {list(BUILTIN_ENVIRONMENTS)} or give a plug-in "
            "as 'package.module:name' (called with dataset=, seed=, returning an Environment)"
        )
    return value


# A built-in environment's name, or a plug-in's import path (envs.make_environment).
EnvironmentName = Annotated[str, AfterValidator(_environment_name)]


class AdmissionConfig(Strict):
    """Which completed groups become training samples."""

    reject_identical_rewards: bool = Field(default=False, description="Reject a group whose rewards are all equal (GRPO: it has no signal).")
    min_completion_tokens: int = Field(default=1, ge=0, description="Drop members with fewer completion tokens than this.")
    drop_truncated: bool = Field(default=False, description="Drop members that ended without EOS (cut at max_completion_tokens).")


class DynamicSamplingConfig(Strict):
    """DAPO's dynamic sampling with a bound: the dispatcher replaces rejected groups until
    `batch_size` are admitted, consuming at most `batch_size + max_extra_groups` groups of the
    ordered stream for one step (the extra ones: rejected by an admission rule or dropped as
    stale). At the bound, `on_limit` says what happens: "train" ships the groups admitted so far
    as a smaller batch (none yet: it ships the first one admitted, never an empty step); "wait"
    keeps going until the batch is full and records that the bound was passed; "stop" raises,
    naming the rejections by rule (verl's DAPO raises past `max_num_gen_batches`)."""

    max_extra_groups: int = Field(ge=0, description="Most groups beyond batch_size one step may consume (rejected or stale).")
    on_limit: Literal["train", "wait", "stop"] = Field(default="train", description="At the bound: train ships a smaller batch, wait keeps going (and records it), stop raises.")


class OverlongConfig(Strict):
    """DAPO's overlong shaping. "penalty": the soft overlong punishment added to the reward
    before advantages, 0 up to `max_completion_tokens - buffer_tokens` completion tokens, then
    falling linearly to `-penalty_factor` at `max_completion_tokens`. "mask": overlong filtering,
    a truncated sample stays in its group (its reward counts in the group's statistics) but
    carries no loss (its loss mask is all False)."""

    buffer_tokens: int = Field(gt=0, description="The last part of the completion budget over which the penalty grows, in tokens; less than orchestrator.max_completion_tokens.")
    penalty_factor: float = Field(default=1.0, ge=0, description="The penalty (subtracted from the reward) at max_completion_tokens.")
    mode: Literal["penalty", "mask"] = Field(default="penalty", description="penalty: soft overlong punishment; mask: truncated samples stay in their group without loss.")


class EvalConfig(Strict):
    """A held-out evaluation set: run at step 0 and every `interval` steps, never trained on."""

    name: str = Field(description="The set's name, the prefix of its metrics.")
    environment: EnvironmentName | HubEnvironment = Field(default="procedural", description="A built-in environment (procedural, math, calculator, arithmetic), a plug-in 'package.module:name', or an environment written for a hub: {hub: verifiers, id: ...} or {hub: openenv, url: ...} (docs/environments/hubs.md).")
    dataset: str | None = Field(default=None, description="procedural: the task (reverse, copy, count); math / calculator: a JSONL or Parquet file, or a saved datasets directory, of prompts (text or messages) and answers.")
    environment_args: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of the environment's constructor beyond dataset and seed (calculator: max_turns, low, high, ops, question, instruction; math: prompt_field, answer_field, tools, tool_parser, max_turns; arithmetic: low, high, ops, question, system, tools, tool_parser, max_turns; a plug-in: its own; a hub environment: its own arguments).")
    num_examples: int = Field(default=64, gt=0, description="Prompts in the set.")
    samples_per_example: int = Field(default=1, gt=0, description="Completions per prompt (k of pass@k).")
    temperature: float = Field(default=0.0, ge=0, description="Sampling temperature; 0: greedy.")
    max_completion_tokens: int | None = Field(default=None, gt=0, description="Completion budget, in tokens; null: orchestrator.max_completion_tokens.")
    interval: int = Field(default=10, ge=1, description="Evaluate at step 0 and every this many steps.")
    seed: int = Field(default=1_000_003, description="Rows come from this seed (procedural tasks: a seed other than orchestrator.seed is held out).")
    chat_template_kwargs: dict[str, Any] | None = Field(default=None, description="Keyword arguments of the chat template for this set (e.g. enable_thinking); null: orchestrator.chat_template_kwargs.")
    judged: bool = Field(default=False, description="Grade the set with orchestrator.judge (its verdict weighed with the environment's own reward as in training: weight, rule_weight, pass_threshold) instead of the environment's reward alone; needs orchestrator.judge and a built-in or plug-in environment.")


class JudgeServeConfig(ServeConfig):
    """The judge's own vLLM servers and router, started by the run from `judge.model_dir`."""

    base_port: int = Field(default=8400, gt=0, lt=65536, description="Port of the judge's server 0; server i listens on base_port + i.")
    router_port: int = Field(default=8450, gt=0, lt=65536, description="Port of the vllm-router in front of the judge's servers (the orchestrator's requests go there).")


class JudgeConfig(Strict):
    """An LLM judge whose verdict is the reward (envs/judge.py): an OpenAI-compatible chat
    endpoint, a prompt template with the rubric, and how its verdict is read. Without `url` the
    run serves the judge itself (`serve`: its own vLLM servers and vllm-router on GPUs of their
    own, from `model_dir`); with `url` it is a server of the user's (vLLM, a router, any
    OpenAI-compatible service)."""

    url: str | None = Field(default=None, description="Base URL of a judge the user serves, an OpenAI-compatible server (http://host:port); requests go to /v1/chat/completions. null: the run serves the judge from model_dir (serve).")
    serve: JudgeServeConfig | None = Field(default=None, description="The judge's vLLM servers and router that the run starts (its GPUs: num_servers x tp, beside every other role's); the default block when url is null; not with url.")
    model_dir: str | None = Field(default=None, description="The judge's HF directory (relative to the config file), which a served judge starts from; needed without url.")
    model: str = Field(description="The model name the judge's server serves (a served judge is served under it).")
    template: str = Field(description="The user message: the rubric, with {answer} (the completion, reasoning removed) and optionally {prompt} and {reference} (the row's answer).")
    system: str | None = Field(default=None, description="A system message before the template; null: none.")
    verdict: Literal["score", "choice"] = Field(default="score", description="'score': the first group of pattern as a number, clipped to score_range and mapped to [0, 1]; 'choice': the reply must be one of choices.")
    pattern: str = Field(default=r"(\d+)", description="score: a regular expression whose first group is the score.")
    score_range: tuple[float, float] = Field(default=(0.0, 10.0), description="score: the scale the judge scores on, mapped to [0, 1].")
    choices: dict[str, float] | None = Field(default=None, description="choice: each verdict the judge may give and its reward.")
    structured: bool = Field(default=True, description="Ask the server for structured outputs (vLLM: regex for a score, choice for choices), so the judge can only emit a verdict the parser reads.")
    weight: float = Field(default=1.0, ge=0, description="The verdict's weight in the reward.")
    rule_weight: float = Field(default=0.0, ge=0, description="The environment's own reward's weight beside the verdict (0: the judge alone).")
    train: bool = Field(default=True, description="The judge grades the training rollouts (the reward); false: only the evaluation sets marked judged.")
    pass_threshold: float = Field(default=0.5, description="A rollout passes (pass rate, pass@k) when its verdict is at least this.")
    max_tokens: int = Field(default=16, gt=0, description="The verdict's length limit, in tokens.")
    max_concurrent: int = Field(default=16, gt=0, description="Judge requests in flight at once.")
    retries: int = Field(default=2, ge=0, description="Retries of a request that failed (connection, timeout, HTTP 5xx) before the step fails, naming the judge.")
    timeout_s: float = Field(default=120.0, gt=0, description="How long one judge request may take, in seconds.")
    api_key_env: str | None = Field(default=None, description="The name of an environment variable holding the judge's API key; null: none.")

    def api_key(self) -> str | None:
        return secret_from_env(self.api_key_env, "orchestrator.judge.api_key_env")

    @model_validator(mode="before")
    @classmethod
    def _served_without_url(cls, data: Any) -> Any:
        """Without url the run serves the model: serve defaults to its block."""
        return serve_unless_url(data)

    @model_validator(mode="after")
    def _readable(self) -> JudgeConfig:
        """The template's placeholders are known, a score's pattern has a group, choices exist."""
        problems = []
        try:
            self.template.format(prompt="", answer="", reference="")
        except (KeyError, IndexError, ValueError) as exc:
            problems.append(f"orchestrator.judge.template: placeholders are {{prompt}}, {{answer}}, {{reference}} ({type(exc).__name__}: {exc})")
        if "{answer}" not in self.template:
            problems.append("orchestrator.judge.template: has no {answer}: the judge would not see the completion")
        if self.verdict == "score":
            try:
                if re.compile(self.pattern).groups < 1:
                    problems.append(f"orchestrator.judge.pattern {self.pattern!r}: needs a group around the score")
            except re.error as exc:
                problems.append(f"orchestrator.judge.pattern {self.pattern!r}: {exc}")
            if self.score_range[1] <= self.score_range[0]:
                problems.append(f"orchestrator.judge.score_range {list(self.score_range)}: low < high")
        elif not self.choices:
            problems.append("orchestrator.judge.choices: verdict 'choice' needs the verdicts and their rewards")
        if self.url is not None and self.serve is not None:
            problems.append(f"orchestrator.judge: url ({self.url}: a judge you serve) and serve (the run serves the "
                            "judge) exclude each other; remove one")  # fmt: skip
        if self.url is None and self.model_dir is None:
            problems.append("orchestrator.judge.model_dir: a judge the run serves (no url) starts from its HF "
                            "directory; set model_dir, or url for a judge you serve")  # fmt: skip
        if problems:
            raise ValueError("; ".join(problems))
        return self


class OrchestratorConfig(Strict):
    """Rollouts: the environment, sampling, groups and batches, admission, asynchrony, evaluation."""

    num_steps: int = Field(default=1, ge=1, description="Training steps of the run.")
    batch_size: int = Field(gt=0, description="Groups per training step.")
    group_size: int = Field(gt=0, description="Completions sampled per prompt (one group).")
    max_async_level: int = Field(default=1, ge=0, description="Lead gate: batch n is shipped (and generated) only once policy version >= n - max_async_level.")
    max_off_policy_steps: int = Field(default=1, ge=0, description="Staleness bound: a sample generated by version v is dropped at training step n if n - v > this.")
    batch_order: Literal["dataset", "finish"] = Field(default="dataset", description="Which finished groups form a step's batch: 'dataset': in dataset order (a batch waits for its slowest group; a run is reproducible bit for bit, a resume too); 'finish': the first admitted groups to finish (no waiting on the tail; groups left over go into later steps, counted against max_off_policy_steps; a resume trains every row at most once but batches differ).")
    oversample: int = Field(default=0, ge=0, description="batch_order 'finish': how many groups beyond what the lead gate admits may generate at once, so a batch can be formed from the first to finish; 0 with batch_order 'dataset'.")
    max_empty_steps: int = Field(default=3, ge=1, description="Stop (with the reason) after this many consecutive steps that admitted no group.")
    max_prompt_tokens: int = Field(gt=0, description="Longest prompt, in tokens.")
    max_completion_tokens: int = Field(gt=0, description="Completion budget per sample, in tokens.")
    temperature: float = Field(default=1.0, gt=0, description="Sampling temperature of training rollouts.")
    top_p: float = Field(default=1.0, gt=0, le=1, description="Nucleus sampling of training rollouts; must stay 1.0 (rule training_samples_are_untruncated).")
    seed: int = Field(default=0, description="Seed of the prompts' order and sampling (the policy's seed; the critic's is seed + 1).")
    admission: AdmissionConfig = Field(default_factory=AdmissionConfig, description="Which completed groups become training samples.")
    dynamic_sampling: DynamicSamplingConfig | None = Field(default=None, description="Bound the groups one step consumes (DAPO); null: replace rejected groups without bound.")
    overlong: OverlongConfig | None = Field(default=None, description="DAPO's overlong shaping; null: no length shaping.")
    environment: EnvironmentName | HubEnvironment = Field(default="procedural", description="A built-in environment (procedural, math, calculator, arithmetic), a plug-in 'package.module:name', or an environment written for a hub: {hub: verifiers, id: ...} or {hub: openenv, url: ...} (docs/environments/hubs.md).")
    dataset: str | None = Field(default=None, description="procedural: the task (reverse, copy, count); math / calculator: a JSONL or Parquet file, or a saved datasets directory, of prompts (text or messages) and answers.")
    environment_args: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of the environment's constructor beyond dataset and seed (calculator: max_turns, low, high, ops, question, instruction; math: prompt_field, answer_field, tools, tool_parser, max_turns; arithmetic: low, high, ops, question, system, tools, tool_parser, max_turns; a plug-in: its own; a hub environment: its own arguments).")
    chat_template: bool | str = Field(default=True, description="true: the tokenizer's own chat template renders prompts and tool messages (when it has one); false: prompts are raw text; a path: a Jinja template file used instead of the tokenizer's (relative to the config file).")
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of every render of the chat template (e.g. enable_thinking: false).")
    reasoning_markers: tuple[str, str] | None = Field(default=("<think>", "</think>"), description="Start and end of a completion's reasoning: the grader and the tool parser see only what follows the last end marker (nothing while the reasoning is unfinished); the trained tokens are always the sampled ones. null: the whole text.")
    train_on_observations: bool = Field(default=False, description="Ablation: observation tokens are trained on as actions (loss mask 1, the sampler's log-probabilities of them from the next turn's prompt_logprobs; a last observation with no turn after it stays masked), to measure what skip-observation GAE buys. Needs temperature 1.")
    eval: list[EvalConfig] = Field(default_factory=list, description="Held-out evaluation sets, never trained on.")
    judge: JudgeConfig | None = Field(default=None, description="An LLM judge whose verdict is the training rollouts' reward (beside the environment's, weighted); null: the environment's reward alone.")

    @model_validator(mode="after")
    def _settings_fit(self) -> OrchestratorConfig:
        """overlong.buffer_tokens is less than max_completion_tokens, overlong mode mask is not
        combined with admission.drop_truncated, train_on_observations samples at temperature 1,
        chat_template_kwargs leave the rollout's own keywords alone, reasoning_markers are two
        different strings."""
        overlong = self.overlong
        problems = [template_kwargs_error(self.chat_template_kwargs, "orchestrator.chat_template_kwargs")]
        problems += [template_kwargs_error(e.chat_template_kwargs, f"orchestrator.eval ({e.name}).chat_template_kwargs")
                     for e in self.eval]  # fmt: skip
        if self.chat_template == "":
            problems.append("orchestrator.chat_template: true, false or the path of a Jinja template file, got ''")
        if self.reasoning_markers is not None and (not all(self.reasoning_markers) or len(set(self.reasoning_markers)) < 2):
            problems.append(f"orchestrator.reasoning_markers: two different non-empty strings, got {list(self.reasoning_markers)}")
        problems = [problem for problem in problems if problem]
        if problems:
            raise ValueError("; ".join(problems))
        if overlong is not None and overlong.buffer_tokens >= self.max_completion_tokens:
            raise ValueError(
                f"orchestrator.overlong.buffer_tokens ({overlong.buffer_tokens}) must be less than "
                f"orchestrator.max_completion_tokens ({self.max_completion_tokens}): the buffer is the last "
                "part of the completion budget"
            )
        if self.train_on_observations and self.temperature != 1.0:
            raise ValueError(
                f"orchestrator.train_on_observations takes the observations' log-probabilities from vLLM's "
                f"prompt_logprobs, which are of the model at temperature 1; orchestrator.temperature is {self.temperature}"
            )
        if self.oversample and self.batch_order == "dataset":
            raise ValueError(
                f"orchestrator.oversample ({self.oversample}) lets groups beyond the batch generate so that a batch "
                "takes the first to finish; with orchestrator.batch_order 'dataset' batches wait for their groups "
                "in dataset order: set batch_order 'finish' or oversample 0"
            )
        if overlong is not None and overlong.mode == "mask" and self.admission.drop_truncated:
            raise ValueError(
                "orchestrator.overlong.mode 'mask' keeps truncated samples in their group without loss, "
                "orchestrator.admission.drop_truncated removes them from it: choose one"
            )
        return self
