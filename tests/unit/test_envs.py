"""Environments: deterministic rows, rewards, the calculator's safe evaluation, math-verify
grading, dataset errors that name the file and line; TrainSink's admission rules."""

from __future__ import annotations

import json

import pytest

from megatron_rl.config import AdmissionConfig
from megatron_rl.envs import make_environment
from megatron_rl.envs.calculator import evaluate
from megatron_rl.inference.rollout import TokenTrajectory
from megatron_rl.orchestrator.rollouts import Group, Member
from megatron_rl.orchestrator.sink import TrainSink


def test_procedural_rows_are_deterministic_and_rewards_give_partial_credit():
    reverse = make_environment("procedural", "reverse", seed=5)
    assert [reverse.row(i) for i in range(5)] == [
        make_environment("procedural", "reverse", seed=5).row(i) for i in range(5)
    ]
    assert reverse.row(0) != make_environment("procedural", "reverse", seed=6).row(0)
    row = reverse.row(3)
    assert reverse.step(row, [row["answer"] + "\nmore"]).reward == 1.0
    assert reverse.step(row, [row["answer"]]).passed is True
    partial = reverse.step(row, [row["answer"][:-1]])
    assert 0 < partial.reward < 1 and partial.passed is False
    count = make_environment("procedural", "count", seed=0)
    row = count.row(0)
    assert count.step(row, ["x" * row["n"]]).reward == 1.0
    assert count.step(row, ["x" * row["n"] + "yy"]).reward == pytest.approx(0.8)
    with pytest.raises(ValueError, match="procedural task 'sort'"):
        make_environment("procedural", "sort")
    with pytest.raises(ValueError, match="unknown environment 'chess'"):
        make_environment("chess")


def test_calculator_evaluates_arithmetic_only_and_runs_turns():
    assert evaluate("2 * (3 + 4) - 10 // 3") == 11
    for bad in ["__import__('os')", "x + 1", "2 ** 100000", "1/0", "(lambda: 1)()"]:
        with pytest.raises(ValueError):
            evaluate(bad)
    env = make_environment("calculator", seed=0)
    row = env.row(0)
    turn = env.step(row, ["let me <calc>6*7</calc>"])
    assert turn.done is False and turn.observation == "<result>42</result>"
    assert env.step(row, ["<calc>1</calc>", f"it is {row['answer']}"]).reward == 1.0
    assert env.step(row, ["<calc>open('x')</calc>"]).reward == 0.0  # a tool error ends the rollout
    assert evaluate("-3 + 5") == 2
    # A call in the last turn allowed, where the answer had to be: the rollout ends unanswered.
    last = env.step(row, ["<calc>1</calc>"] * env.max_turns)
    assert (last.done, last.reward, last.passed, last.tool_calls, last.tool_errors) == (True, 0.0, False, 1, 0)


def test_math_environment_grades_with_math_verify_and_names_bad_lines(tmp_path):
    data = tmp_path / "math.jsonl"
    data.write_text(json.dumps({"prompt": "1/2 + 1/4?", "answer": "3/4"}) + "\n")
    env = make_environment("math", str(data))
    row = env.row(0)
    assert env.step(row, ["so the result is \\boxed{\\frac{3}{4}}"]).reward == 1.0
    assert env.step(row, ["\\boxed{0.75}"]).reward == 1.0
    assert env.step(row, ["\\boxed{1/2}"]).reward == 0.0
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "a", "answer": "1"}) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not JSON"):
        make_environment("math", str(bad))
    bad.write_text(json.dumps({"question": "a"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl: row 1: no field 'prompt' \(the prompt\)"):
        make_environment("math", str(bad))
    with pytest.raises(ValueError, match="needs a dataset of prompts and answers"):
        make_environment("math")


def member(branch, reward, completion_tokens, status="finished", truncated=False):
    trajectory = TokenTrajectory(prompt_ids=[1, 2, 3])
    trajectory.token_ids += [7] * completion_tokens
    trajectory.loss_mask += [True] * completion_tokens
    trajectory.logprobs += [-0.5] * completion_tokens
    trajectory.policy_versions.append(3)
    return Member(branch, status, trajectory if status == "finished" else None, reward, truncated=truncated)


def test_train_sink_admission_rules():
    rules = AdmissionConfig(reject_identical_rewards=True, min_completion_tokens=2, drop_truncated=True)
    sink = TrainSink(rules)
    group = Group(0, {}, [member(0, 1.0, 4), member(1, 0.0, 1), member(2, 0.5, 4, truncated=True),
                          member(3, 0.0, 0, status="failed"), member(4, 0.0, 3)])  # fmt: skip
    samples = sink.admit(group)
    assert [s.branch_index for s in samples] == [0, 4]  # original order, dropped ones skipped
    assert samples[0].loss_mask.tolist() == [False] * 3 + [True] * 4 and samples[0].policy_version == 3
    assert dict(sink.counters.dropped_members) == {"min_completion_tokens": 1, "truncated": 1, "failed": 1}
    assert sink.admit(Group(1, {}, [member(0, 0.5, 3), member(1, 0.5, 3)])) is None
    assert sink.admit(Group(2, {}, [member(0, 0.5, 3, status="cancelled")])) is None
    assert dict(sink.counters.rejected_groups) == {"identical_rewards": 1, "no_member_left": 1}
    single = TrainSink(AdmissionConfig(reject_identical_rewards=True))
    assert len(single.admit(Group(3, {}, [member(0, 0.5, 3)]))) == 1  # group size 1 (SAO) is kept
