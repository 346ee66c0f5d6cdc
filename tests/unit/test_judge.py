"""LLM judges (envs/judge.py) against an in-process stand-in of an OpenAI-compatible server
(httpx.MockTransport): the request (template, structured outputs, temperature 0), the verdict
parsers (a score on a scale, a choice), every bad case counted and named (an unreadable verdict
fails that member with its text kept; a judge down fails the step after its retries), the
reward's weights, the config's checks, and the orchestrator's loop with a judged environment."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from transformers import AutoTokenizer

from megatron_rl.config import ConfigError
from megatron_rl.config.orchestrator import JudgeConfig
from megatron_rl.envs import make_environment
from megatron_rl.envs.judge import Judge, JudgedEnvironment, JudgeUnavailable, JudgeVerdictError, prompt_text
from megatron_rl.orchestrator.rollouts import PromptEncoder
from tests.support.orchestrator import build_orchestrator, orchestrator_config

SCORE = dict(url="http://judge:9000", model="judge", template="Question: {prompt}\nReference: {reference}\n"
             "Answer: {answer}\nScore 0-10:", score_range=(0.0, 10.0))  # fmt: skip


class StandIn:
    """Answers chat completions with `reply(body)`: a string (the verdict) or an httpx.Response."""

    def __init__(self, reply):
        self.reply, self.bodies = reply, []

    def handle(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.bodies.append(body)
        out = self.reply(body)
        if isinstance(out, httpx.Response):
            return out
        return httpx.Response(200, json={"choices": [{"message": {"role": "assistant", "content": out}}]})


def judge_with(reply, **config) -> tuple[Judge, StandIn]:
    stand_in = StandIn(reply)
    return Judge(JudgeConfig(**{**SCORE, **config}), httpx.MockTransport(stand_in.handle), backoff_s=0.001), stand_in


def test_the_request_and_the_score_parser():
    judge, stand_in = judge_with(lambda body: "Score: 7 because")
    assert asyncio.run(judge.verdict("2+2?", "4", "4")) == pytest.approx(0.7)
    body = stand_in.bodies[0]
    assert body["messages"] == [{"role": "user", "content": "Question: 2+2?\nReference: 4\nAnswer: 4\nScore 0-10:"}]
    assert body["temperature"] == 0.0 and body["structured_outputs"] == {"regex": r"(\d+)"} and body["model"] == "judge"
    assert judge.parse("12") == 1.0 and judge.parse("0") == 0.0  # clipped to the scale
    with pytest.raises(JudgeVerdictError, match="judge verdict 'looks fine' has no score"):
        judge.parse("looks fine")


def test_choices_and_an_unreadable_verdict_kept_and_counted():
    choices = {"correct": 1.0, "partly": 0.5, "wrong": 0.0}
    judge, stand_in = judge_with(lambda body: "partly" if "half" in body["messages"][-1]["content"] else "maybe?",
                                 verdict="choice", choices=choices, system="You grade answers.")  # fmt: skip
    assert asyncio.run(judge.verdict("q", "half of it")) == 0.5
    assert stand_in.bodies[0]["structured_outputs"] == {"choice": ["correct", "partly", "wrong"]}
    assert stand_in.bodies[0]["messages"][0] == {"role": "system", "content": "You grade answers."}
    with pytest.raises(JudgeVerdictError, match=r"judge verdict 'maybe\?' is none of \['correct', 'partly', 'wrong'\]"):
        asyncio.run(judge.verdict("q", "something"))
    assert (judge.calls, judge.unparsable) == (2, 1)


def test_a_failing_judge_is_retried_then_named():
    answers = iter([httpx.Response(503, text="busy"), httpx.Response(502, text="gateway"), "9"])
    judge, _ = judge_with(lambda body: next(answers), retries=2)
    assert asyncio.run(judge.verdict("q", "a")) == pytest.approx(0.9) and judge.retried == 2
    judge, _ = judge_with(lambda body: httpx.Response(503, text="overloaded"), retries=1)
    with pytest.raises(JudgeUnavailable, match=r"judge http://judge:9000/v1/chat/completions failed 2 times .*HTTP 503: overloaded"):
        asyncio.run(judge.verdict("q", "a"))
    judge, _ = judge_with(lambda body: httpx.Response(404, text="no such model"))
    with pytest.raises(JudgeUnavailable, match="refused the request: HTTP 404: no such model"):
        asyncio.run(judge.verdict("q", "a"))
    judge, _ = judge_with(lambda body: httpx.Response(200, text="<html>"))
    with pytest.raises(JudgeUnavailable, match="not a chat completion"):
        asyncio.run(judge.verdict("q", "a"))


def test_the_judged_environment_weighs_the_verdict_with_the_rule_reward():
    inner = make_environment("procedural", "count", seed=0)
    judge, _ = judge_with(lambda body: "10" if "Answer: xxx\n" in body["messages"][-1]["content"] else "2", rule_weight=0.5,
                          weight=2.0, pass_threshold=0.6)  # fmt: skip
    env = JudgedEnvironment(inner, judge)
    row = next(inner.row(i) for i in range(50) if inner.row(i)["answer"] == "xxx")
    right = asyncio.run(env.astep(row, ["xxx"]))
    wrong = asyncio.run(env.astep(row, ["xx"]))
    assert (right.reward, right.passed, right.judge_score) == (pytest.approx(0.5 * 1.0 + 2.0), True, 1.0)
    assert (wrong.reward, wrong.passed) == (pytest.approx(0.5 * inner.step(row, ["xx"]).reward + 2.0 * 0.2), False)
    assert prompt_text([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]) == "u"


def test_the_config_names_what_the_judge_cannot_read():
    for config, message in [
        ({"template": "Rate it"}, "template: has no {answer}"),
        ({"template": "{answer} {rubric}"}, r"placeholders are \{prompt\}, \{answer\}, \{reference\}"),
        ({"pattern": r"\d+"}, "needs a group around the score"),
        ({"verdict": "choice"}, "verdict 'choice' needs the verdicts"),
        ({"score_range": (5, 1)}, "score_range .*low < high"),
    ]:
        with pytest.raises(ConfigError, match=message):
            orchestrator_config("grpo", judge={**SCORE, **config})


def test_the_orchestrator_trains_on_verdicts_counts_unreadable_ones_and_stops_when_the_judge_is_down(tiny_models):
    encoder = PromptEncoder(AutoTokenizer.from_pretrained(str(tiny_models["qwen3"])))
    resolved = orchestrator_config("grpo", judge=SCORE, num_steps=2, batch_size=3, group_size=2)
    seen = []

    def verdict(body):
        seen.append(body)
        return "no idea" if len(seen) % 4 == 0 else str(len(seen) % 10)  # every 4th unreadable

    judge, _ = judge_with(verdict)
    env = JudgedEnvironment(make_environment("procedural", None, 0), judge)
    orchestrator, _, _, _, _, records = build_orchestrator(resolved, encoder, environment=env)
    asyncio.run(asyncio.wait_for(orchestrator.run(), 30))
    unreadable = sum(r.get("judge_unparsable", 0) for r in records)
    assert unreadable == judge.unparsable > 0 and all(r["judge_score_mean"] is not None for r in records)
    assert sum(r["members_dropped"].get("failed", 0) for r in records) >= unreadable
    scores = {round(s.reward, 6) for _, s in orchestrator.shipped.items}
    assert scores <= {round(k / 10, 6) for k in range(10)}  # the verdicts, on the judge's scale

    down, _ = judge_with(lambda body: httpx.Response(500, text="judge crashed"), retries=1)
    env = JudgedEnvironment(make_environment("procedural", None, 0), down)
    orchestrator, *_ = build_orchestrator(resolved, encoder, environment=env)
    with pytest.raises(JudgeUnavailable, match="judge http://judge:9000/v1/chat/completions failed 2 times"):
        asyncio.run(asyncio.wait_for(orchestrator.run(), 30))


def test_judged_eval_sets_are_graded_by_the_judge_and_the_config_names_what_is_missing(tiny_models):
    """An eval set marked `judged` is graded by the run's judge (its verdict weighed with the
    environment's reward; unreadable verdicts among the set's errors); a set beside it keeps its
    environment's reward. A judged set needs orchestrator.judge; judge.train false leaves the
    training reward the environment's (and allows a hub's environment to train)."""
    from megatron_rl.orchestrator.eval_only import EvalError, check_sets
    from megatron_rl.orchestrator.evaluation import Evaluator
    from tests.support.orchestrator import FakeClient, FakeWeights

    sets = [{"name": "judged", "dataset": "count", "num_examples": 6, "judged": True},
            {"name": "plain", "dataset": "count", "num_examples": 6}]  # fmt: skip
    resolved = orchestrator_config("grpo", judge={**SCORE, "train": False}, eval=sets)
    calls = []

    def verdict(body):
        calls.append(body)
        return "no idea" if len(calls) == 3 else "8"

    judge, _ = judge_with(verdict, rule_weight=0.0)
    encoder = PromptEncoder(AutoTokenizer.from_pretrained(str(tiny_models["qwen3"])))
    evaluator = Evaluator(resolved.orchestrator.eval, FakeClient(FakeWeights()), encoder, 8, 0, judge=judge)
    results = asyncio.run(evaluator.run(0))
    assert len(calls) == 6 and judge.unparsable == 1  # the judged set's rollouts only
    assert results["eval/judged/reward_mean"] == pytest.approx(0.8) and results["eval/judged/judge_score_mean"] == pytest.approx(0.8)
    assert results["eval/judged/pass@1"] == pytest.approx(5 / 6)  # 0.8 >= pass_threshold 0.5; the unreadable one fails
    assert results["eval/judged/error_kinds"] == {"JudgeVerdictError": 1}
    assert results["eval/plain/reward_mean"] < 0.8 and "eval/plain/judge_score_mean" not in results  # random tokens

    with pytest.raises(ConfigError, match=r"orchestrator.eval \(judged\).judged: there is no orchestrator.judge"):
        orchestrator_config("grpo", eval=sets)
    hub = {"hub": "openenv", "url": "http://127.0.0.1:9"}
    with pytest.raises(ConfigError, match=r"orchestrator.judge: the environment is hub 'openenv'.*judge.train: false"):
        orchestrator_config("grpo", judge=SCORE, environment=hub)
    assert orchestrator_config("grpo", judge={**SCORE, "train": False}, environment=hub, eval=sets).orchestrator.judge.train is False
    check_sets(resolved.orchestrator)  # the judge has a url: megatron-rl eval reaches it
    served = orchestrator_config("grpo", judge={**{k: v for k, v in SCORE.items() if k != "url"}, "model_dir": str(tiny_models["qwen3"])},
                                 eval=sets)  # fmt: skip
    with pytest.raises(EvalError, match=r"orchestrator.eval \['judged'\]: judged sets need a judge at orchestrator.judge.url"):
        check_sets(served.orchestrator)
