"""On-policy distillation's signal (algorithms/distillation.py) against plain loops: the
per-token reverse KL on action tokens only (observations of multi-turn samples excluded), GAE
with the teacher's dense reward per token, the outcome estimators with its sum, mode advantage's
-coef * k_t added to GRPO's, GAE's and whitened GAE's advantages, its baseline (the step's or
the group's mean k_t subtracted), the step's metrics, bad
teacher replies named; the config's temperature rule and the start-up tokenizer
check; and the orchestrator's loop with a fake teacher."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from transformers import AutoTokenizer

from megatron_rl.algorithms import make_algorithm
from megatron_rl.algorithms.distillation import (
    Distillation,
    TeacherReplyError,
    distillation_metrics,
    reverse_kl,
    set_teacher_logprobs,
    set_teacher_top_k,
)
from megatron_rl.config import AlgorithmConfig, ConfigError
from megatron_rl.data import ScoreResult, TrainingSample
from megatron_rl.data.types import TeacherTopK
from megatron_rl.inference.teacher import check_same_tokenizer
from megatron_rl.orchestrator.rollouts import PromptEncoder
from tests.support.orchestrator import InProcessScorer, build_orchestrator, orchestrator_config, per_token_gae

COEF = 0.5


def teacher_of(sequence: list[int]) -> np.ndarray:
    """A deterministic stand-in teacher: log-probabilities from the token ids, nan at 0."""
    out = np.array([-((t * 13) % 17) / 7.0 - 0.05 for t in sequence])
    out[0] = np.nan
    return out


def top_k_of(sequence: list[int], k: int) -> TeacherTopK:
    """A deterministic stand-in teacher's top k: at position t the ids (t * 7 + j) % 50 for j < k
    with log-probabilities -1 - j / 2 (most likely first), row 0 zeros and nan."""
    n = len(sequence)
    ids = (np.arange(n)[:, None] * 7 + np.arange(k)[None, :]) % 50
    logprobs = np.broadcast_to(-1.0 - np.arange(k) / 2, (n, k)).astype(np.float32).copy()
    ids[0], logprobs[0] = 0, np.nan
    return TeacherTopK(teacher_of(sequence).astype(np.float32), ids.astype(np.int32), logprobs)


class FakeTeacher:
    def __init__(self):
        self.calls = []

    async def logprobs(self, batched):
        self.calls.append(batched)
        return [teacher_of(ids) for ids in batched]

    async def top_k(self, batched, k):
        self.calls.append(batched)
        return [top_k_of(ids, k) for ids in batched]


def multi_turn_samples(seed: int = 0) -> list[TrainingSample]:
    """Prompt, a completion, an observation, a completion: the loss mask on the completions only."""
    rng = np.random.default_rng(seed)
    samples = []
    for branch in range(3):
        mask = np.array([False] * 3 + [True] * 4 + [False] * 2 + [True] * (3 + branch))
        n = len(mask)
        samples.append(TrainingSample(token_ids=rng.integers(1, 90, n), loss_mask=mask, group_id=7,
                                      inference_logprobs=np.where(mask, -rng.random(n) * 3, 0.0),
                                      reward=float(branch == 1), branch_index=branch))  # fmt: skip
    return samples


def test_the_reverse_kl_and_its_dense_reward_equal_a_plain_loop():
    samples = multi_turn_samples()
    asyncio.run(Distillation(FakeTeacher(), COEF).score(samples))
    for sample in samples:
        teacher = teacher_of(sample.token_ids.tolist())
        expected = [float(sample.inference_logprobs[t]) - teacher[t] if sample.loss_mask[t] else 0.0
                    for t in range(len(sample))]  # fmt: skip
        assert reverse_kl(sample) == pytest.approx(expected, abs=1e-6)
        assert not reverse_kl(sample)[~sample.loss_mask].any()  # observations and the prompt: nothing
    metrics = distillation_metrics(samples, COEF)
    tokens = [reverse_kl(s)[t] for s in samples for t in np.flatnonzero(s.loss_mask)]
    sums = [reverse_kl(s).sum() for s in samples]
    assert metrics["teacher_kl_mean"] == pytest.approx(np.mean(tokens))
    assert metrics["distill_reward_mean"] == pytest.approx(-COEF * np.mean(sums))
    share = sum(abs(COEF * x) for x in sums) / (sum(abs(COEF * x) for x in sums) + sum(abs(s.reward) for s in samples))
    assert metrics["distill_reward_share"] == pytest.approx(share)


def test_gae_takes_the_teachers_reward_per_token_and_outcome_estimators_its_sum():
    values = {}

    def critic(batched):
        out = [np.array([((t * 7) % 11) / 11.0 for t in ids], dtype=np.float32) for ids in batched]
        values.update({tuple(ids): v for ids, v in zip(batched, out)})
        return ScoreResult(values=out, bootstrap_values=[0.0] * len(batched))

    config = AlgorithmConfig(type="ppo", policy_lambda=0.9, value_lambda=1.0)
    samples = multi_turn_samples(1)
    algorithm = make_algorithm(config, InProcessScorer(critic), Distillation(FakeTeacher(), COEF))
    asyncio.run(algorithm.prepare_batch([samples], 0))
    for sample in samples:
        dense = -COEF * reverse_kl(sample)
        value = values[tuple(sample.token_ids.tolist())].astype(np.float64)
        # the loop: GAE over action tokens, reward R on the last plus the dense reward on each
        actions = np.flatnonzero(sample.loss_mask)
        expected, running, next_value = np.zeros(len(sample)), 0.0, 0.0
        for k in reversed(range(len(actions))):
            t = actions[k]
            reward = dense[t] + (sample.reward if k == len(actions) - 1 else 0.0)
            running = reward + next_value - value[t] + 0.9 * running
            expected[t], next_value = running, value[t]
        assert sample.advantages == pytest.approx(expected, abs=1e-5)
        assert sample.advantages != pytest.approx(per_token_gae(sample.reward, value, sample.loss_mask, 0.0, False,
                                                                1.0, 0.9), abs=1e-3)  # fmt: skip

    grpo = make_algorithm(AlgorithmConfig(type="grpo"), distillation=Distillation(FakeTeacher(), COEF))
    samples = multi_turn_samples(2)
    asyncio.run(grpo.prepare_batch([samples], 0))
    totals = np.array([s.reward - COEF * reverse_kl(s).sum() for s in samples])
    expected = (totals - totals.mean()) / (totals.std(ddof=1) + 1e-6)
    assert [float(s.advantages[s.loss_mask][0]) for s in samples] == pytest.approx(expected, abs=1e-4)


def plain_gae(sample: TrainingSample, value: np.ndarray, lam: float) -> np.ndarray:
    """GAE over the action tokens (gamma 1, bootstrap 0), the task reward on the last one only."""
    actions = np.flatnonzero(sample.loss_mask)
    out, running, next_value = np.zeros(len(sample)), 0.0, 0.0
    for k in reversed(range(len(actions))):
        t = actions[k]
        reward = sample.reward if k == len(actions) - 1 else 0.0
        running = reward + next_value - value[t] + lam * running
        out[t], next_value = running, value[t]
    return out


def test_the_advantage_mode_adds_each_tokens_own_reverse_kl_after_every_estimator():
    """mode advantage: the estimator sees the task reward alone (GRPO's group normalisation, GAE,
    GAE whitened over the step), then each action token's advantage gains -coef * k_t, with k_t of
    the sampler's log-probability; observation and prompt tokens gain nothing, the critic's
    returns are the task's; the step's advantage share as a plain sum."""
    value_of = lambda ids: np.array([((t * 5) % 9) / 9.0 - 0.3 for t in ids])  # noqa: E731
    critic = InProcessScorer(lambda batched: ScoreResult(values=[value_of(ids).astype(np.float32) for ids in batched],
                                                         bootstrap_values=[0.0] * len(batched)))  # fmt: skip

    def teacher_term(sample, t):  # the plain loop's -coef * (log pi_student - log pi_teacher)
        teacher = teacher_of(sample.token_ids.tolist())
        return -COEF * (float(sample.inference_logprobs[t]) - teacher[t]) if sample.loss_mask[t] else 0.0

    for seed in (4, 5):
        samples = multi_turn_samples(seed)
        samples[2].reward = 0.25  # three distinct task rewards
        grpo = make_algorithm(AlgorithmConfig(type="grpo"), distillation=Distillation(FakeTeacher(), COEF, "advantage"))
        asyncio.run(grpo.prepare_batch([samples], 0))
        task = np.array([s.reward for s in samples])
        scalar = (task - task.mean()) / (task.std(ddof=1) + 1e-6)
        for sample, a in zip(samples, scalar):
            expected = [(a + teacher_term(sample, t)) if sample.loss_mask[t] else 0.0 for t in range(len(sample))]
            assert sample.advantages == pytest.approx(expected, abs=1e-4)
        metrics = distillation_metrics(samples, COEF, "advantage")
        teacher = [teacher_term(s, t) for s in samples for t in np.flatnonzero(s.loss_mask)]
        estimator = [a for s, a in zip(samples, scalar) for _ in np.flatnonzero(s.loss_mask)]
        share = sum(map(abs, teacher)) / (sum(map(abs, teacher)) + sum(map(abs, estimator)))
        assert metrics["distill_advantage_share"] == pytest.approx(share, abs=1e-5)
        assert metrics["distill_advantage_mean"] == pytest.approx(np.mean(teacher))

        for whiten in (False, True):
            samples = multi_turn_samples(seed)
            config = AlgorithmConfig(type="ppo", policy_lambda=0.9, value_lambda=1.0, whiten_advantages=whiten)
            gae = make_algorithm(config, critic, Distillation(FakeTeacher(), COEF, "advantage"))
            asyncio.run(gae.prepare_batch([samples], 0))
            task = [plain_gae(s, value_of(s.token_ids.tolist()), 0.9) for s in samples]
            if whiten:
                flat = np.concatenate([a[s.loss_mask] for a, s in zip(task, samples)])
                mean, scale = flat.mean(), 1 / np.sqrt(flat.var(ddof=1) + 1e-8)
                task = [np.where(s.loss_mask, (a - mean) * scale, 0.0) for a, s in zip(task, samples)]
            for sample, a in zip(samples, task):
                expected = [a[t] + teacher_term(sample, t) for t in range(len(sample))]
                assert sample.advantages == pytest.approx(expected, abs=1e-4)
                value = value_of(sample.token_ids.tolist())
                returns = plain_gae(sample, value, 1.0) + value  # the task's alone: lambda 1, gamma 1
                assert sample.returns[sample.loss_mask] == pytest.approx(returns[sample.loss_mask], abs=1e-4)


def test_the_advantage_modes_baseline_subtracts_the_steps_or_the_groups_mean_kl():
    """distillation.baseline: the term added to each action token's advantage is -coef * (k_t - b),
    b the mean of k_t over all the step's action tokens (batch_mean) or over the group's
    (group_mean), against a plain loop over two groups after GRPO; the metrics' distill_baseline
    and share as plain sums; none is the term without a baseline; the config refuses a baseline
    with mode reward or kl_penalty, naming both keys."""
    def step():
        groups = [multi_turn_samples(6), multi_turn_samples(7)]
        for sample in groups[1]:
            sample.group_id = 8
        groups[0][2].reward = groups[1][0].reward = 0.25
        return groups

    def k(sample, t):  # the plain loop's log pi_student - log pi_teacher
        return float(sample.inference_logprobs[t]) - teacher_of(sample.token_ids.tolist())[t]

    plain = step()
    tokens = [[k(s, t) for s in group for t in np.flatnonzero(s.loss_mask)] for group in plain]
    expected_b = {"none": [0.0, 0.0], "batch_mean": [sum(map(sum, tokens)) / sum(map(len, tokens))] * 2,
                  "group_mean": [sum(t) / len(t) for t in tokens]}  # fmt: skip
    assert expected_b["group_mean"][0] != pytest.approx(expected_b["group_mean"][1], abs=1e-2)
    for baseline, bs in expected_b.items():
        groups = step()
        grpo = make_algorithm(AlgorithmConfig(type="grpo"),
                              distillation=Distillation(FakeTeacher(), COEF, "advantage", baseline))  # fmt: skip
        asyncio.run(grpo.prepare_batch(groups, 0))
        terms, estimators = [], []
        for group, b in zip(groups, bs):
            task = np.array([s.reward for s in group])
            scalar = (task - task.mean()) / (task.std(ddof=1) + 1e-6)
            for sample, a in zip(group, scalar):
                expected = [a - COEF * (k(sample, t) - b) if sample.loss_mask[t] else 0.0 for t in range(len(sample))]
                assert sample.advantages == pytest.approx(expected, abs=1e-4)
                terms += [-COEF * (k(sample, t) - b) for t in np.flatnonzero(sample.loss_mask)]
                estimators += [a] * int(sample.loss_mask.sum())
        if baseline != "none":  # the step's term is centred: its mean over the action tokens is 0
            assert np.mean(terms) == pytest.approx(0.0, abs=1e-9)
        metrics = distillation_metrics([s for group in groups for s in group], COEF, "advantage", baseline)
        assert metrics["distill_advantage_mean"] == pytest.approx(np.mean(terms))
        share = sum(map(abs, terms)) / (sum(map(abs, terms)) + sum(map(abs, estimators)))
        assert metrics["distill_advantage_share"] == pytest.approx(share, abs=1e-5)
        assert ("distill_baseline" in metrics) == (baseline != "none")
        if baseline != "none":
            assert metrics["distill_baseline"] == pytest.approx(np.mean(bs))
        assert ("distill_baseline_std" in metrics) == (baseline == "group_mean")
        if baseline == "group_mean":
            assert metrics["distill_baseline_std"] == pytest.approx(np.std(bs))

    with pytest.raises(ValueError, match="distillation.baseline 'batch_mean' is for distillation.mode 'advantage'"):
        Distillation(FakeTeacher(), COEF, "reward", "batch_mean")
    teacher = {"url": "http://teacher:8000", "model_dir": "teacher-model"}
    for mode, why in (("reward", "a length bonus"), ("kl_penalty", "a constant has no gradient")):
        with pytest.raises(ConfigError, match=rf"distillation.baseline 'batch_mean' is for distillation.mode 'advantage', not '{mode}': .*{why}"):
            orchestrator_config("sao", distillation={"teacher": teacher, "mode": mode, "baseline": "batch_mean"})
    resolved = orchestrator_config("sao", distillation={"teacher": teacher, "mode": "advantage", "baseline": "group_mean"})
    assert resolved.distillation.baseline == "group_mean"
    assert orchestrator_config("sao", distillation={"teacher": teacher}).distillation.baseline == "none"


def test_bad_teacher_replies_are_named():
    samples = multi_turn_samples()
    with pytest.raises(TeacherReplyError, match="answered 2 sequences for 3"):
        set_teacher_logprobs(samples, [teacher_of([1, 2]), teacher_of([3])])
    short = [teacher_of(s.token_ids.tolist()) for s in samples]
    short[1] = short[1][:-1]
    with pytest.raises(TeacherReplyError, match="group 7, branch 1: 12 for 13 tokens"):
        set_teacher_logprobs(samples, short)
    holed = [teacher_of(s.token_ids.tolist()) for s in samples]
    holed[2][4] = np.nan  # an action token
    with pytest.raises(TeacherReplyError, match="group 7, branch 2, token 4: nan"):
        set_teacher_logprobs(samples, holed)


def test_the_config_takes_the_kl_at_temperature_one_and_the_teachers_tokenizer_must_be_the_students(
    tiny_models, tmp_path
):
    teacher = {"url": "http://teacher:8000", "model_dir": "teacher-model"}
    resolved = orchestrator_config("sao", distillation={"teacher": teacher, "coef": 0.2})
    assert resolved.distillation.teacher.model_dir.endswith("/teacher-model")  # relative to the config
    with pytest.raises(ConfigError, match=r"distillation: .*orchestrator.temperature\); .*Set orchestrator.temperature: 1.0"):
        orchestrator_config("sao", distillation={"teacher": teacher}, temperature=0.7)

    qwen = AutoTokenizer.from_pretrained(str(tiny_models["qwen3"]))
    check_same_tokenizer(qwen, AutoTokenizer.from_pretrained(str(tiny_models["qwen3"])), "same")
    llama = AutoTokenizer.from_pretrained(str(tiny_models["llama"]))
    if llama.get_vocab() != qwen.get_vocab() or llama.eos_token_id != qwen.eos_token_id:
        with pytest.raises(ValueError, match="distillation.teacher.model_dir /x/llama: the teacher's tokenizer is not"):
            check_same_tokenizer(qwen, llama, "/x/llama")
    extended = AutoTokenizer.from_pretrained(str(tiny_models["qwen3"]))
    extended.add_tokens(["<extra-token>"])
    with pytest.raises(ValueError, match=r"vocabularies differ \(\d+ and \d+ tokens"):
        check_same_tokenizer(qwen, extended, "/x/extended")


@pytest.mark.parametrize("mode,baseline", [("reward", "none"), ("advantage", "none"), ("advantage", "batch_mean")])
def test_the_orchestrator_scores_every_sample_with_the_teacher_and_reports_the_signal(tiny_models, mode, baseline):
    encoder = PromptEncoder(AutoTokenizer.from_pretrained(str(tiny_models["qwen3"])))
    teacher = {"url": "http://teacher:8000", "model_dir": str(tiny_models["qwen3"])}
    resolved = orchestrator_config("sao", distillation={"teacher": teacher, "coef": COEF, "mode": mode, "baseline": baseline},
                                   num_steps=2, batch_size=3, group_size=1)  # fmt: skip
    with pytest.raises(RuntimeError, match="distillation is configured but the orchestrator was given no teacher"):
        build_orchestrator(resolved, encoder)
    fake = FakeTeacher()
    orchestrator, _, _, _, _, records = build_orchestrator(resolved, encoder, teacher=fake)
    asyncio.run(asyncio.wait_for(orchestrator.run(), 30))
    assert sum(len(call) for call in fake.calls) == len(orchestrator.shipped.items) == 6
    assert all(s.teacher_logprobs is not None for _, s in orchestrator.shipped.items)
    for record in records:
        step = [s for n, s in orchestrator.shipped.items if n == record["step"]]
        expected = distillation_metrics(step, COEF, mode, baseline)
        assert record["teacher_kl_mean"] == pytest.approx(expected["teacher_kl_mean"])
        assert ("distill_advantage_share" in record) == (mode == "advantage")
        if mode == "advantage":  # the share as the shipped samples' advantages give it
            assert 0 < record["distill_advantage_share"] == pytest.approx(expected["distill_advantage_share"])
        assert ("distill_baseline" in record) == (baseline != "none")
        if baseline == "batch_mean":  # b is the step's mean k_t: the term's mean over the step is 0
            assert record["distill_baseline"] == pytest.approx(record["teacher_kl_mean"])
            assert record["distill_advantage_mean"] == pytest.approx(0.0, abs=1e-6)


def test_kl_penalty_sends_the_teachers_log_probs_to_the_policy_and_leaves_the_rewards_alone(tiny_models):
    """mode kl_penalty: the orchestrator scores every sample, the advantages are the task reward's
    alone, the policy's grid (not the critic's) carries the teacher's log-probabilities through
    the codec, and a non-finite one is refused by it; k1 is refused by the config."""
    from megatron_rl.transport import TransportError, decode_grid_item, encode_grid_item

    teacher = {"url": "http://teacher:8000", "model_dir": str(tiny_models["qwen3"])}
    with pytest.raises(ConfigError, match="distillation.mode 'kl_penalty' with algorithm.kl_estimator 'k1'"):
        orchestrator_config("sao", algorithm_options={"kl_estimator": "k1"},
                            distillation={"teacher": teacher, "mode": "kl_penalty"})  # fmt: skip
    encoder = PromptEncoder(AutoTokenizer.from_pretrained(str(tiny_models["qwen3"])))
    resolved = orchestrator_config("sao", distillation={"teacher": teacher, "coef": COEF, "mode": "kl_penalty"},
                                   num_steps=1, batch_size=3, group_size=1)  # fmt: skip
    orchestrator, _, _, critic, policy, records = build_orchestrator(resolved, encoder, teacher=FakeTeacher())
    asyncio.run(asyncio.wait_for(orchestrator.run(), 30))
    samples = [s for _, s in orchestrator.shipped.items]
    assert records[0]["teacher_kl_mean"] == pytest.approx(distillation_metrics(samples, COEF)["teacher_kl_mean"])
    policy_rows = [mb for rank in policy.grids[0] for mb in rank if not mb.is_dummy]
    assert policy_rows and all(mb.teacher_logprobs is not None for mb in policy_rows)
    assert all(mb.teacher_logprobs is None for rank in critic.grids[0] for mb in rank)
    for mb in policy_rows:  # each token's teacher log-prob where the sample's is
        for index, sample in enumerate(samples):
            rows = np.flatnonzero(mb.sample_index == index)
            if rows.size:
                assert mb.teacher_logprobs[rows] == pytest.approx(sample.teacher_logprobs)
    plain, penalised = multi_turn_samples(3), multi_turn_samples(3)  # the advantages: the task reward's alone
    config = AlgorithmConfig(type="ppo")
    critic_scores = InProcessScorer(lambda batched: ScoreResult(values=[np.full(len(t), 0.25, np.float32) for t in batched],
                                                                bootstrap_values=[0.0] * len(batched)))  # fmt: skip
    asyncio.run(make_algorithm(config, critic_scores).prepare_batch([plain], 0))
    asyncio.run(make_algorithm(config, critic_scores, Distillation(FakeTeacher(), COEF, "kl_penalty"))
                .prepare_batch([penalised], 0))  # fmt: skip
    for a, b in zip(plain, penalised):
        assert a.advantages.tolist() == b.advantages.tolist() and b.teacher_logprobs is not None
    row = policy.grids[0][0]
    bad = [mb for mb in row if not mb.is_dummy][0]
    bad.teacher_logprobs = bad.teacher_logprobs.copy()
    bad.teacher_logprobs[0] = np.inf
    with pytest.raises(TransportError, match="array teacher_logprobs: non-finite values"):
        decode_grid_item([bytes(f) for f in encode_grid_item(0, 0, row)], "test", 0, 0)


def test_top_k_kl_sends_the_teachers_top_k_to_the_policy_and_leaves_the_rewards_alone(tiny_models):
    """mode top_k_kl: one teacher request a sample gives the sampled token's log-probability and
    each action position's top k; the policy's grid (not the critic's) carries the top k row for
    row; the advantages are the task reward's alone; the step reports the top k's mass; bad
    replies and a top_k larger than the vocabulary are named."""
    teacher = {"url": "http://teacher:8000", "model_dir": str(tiny_models["qwen3"])}
    k = 4
    encoder = PromptEncoder(AutoTokenizer.from_pretrained(str(tiny_models["qwen3"])))
    resolved = orchestrator_config("sao", distillation={"teacher": teacher, "coef": COEF, "mode": "top_k_kl", "top_k": k},
                                   num_steps=1, batch_size=3, group_size=1)  # fmt: skip
    fake = FakeTeacher()
    orchestrator, _, _, critic, policy, records = build_orchestrator(resolved, encoder, teacher=fake)
    asyncio.run(asyncio.wait_for(orchestrator.run(), 30))
    samples = [s for _, s in orchestrator.shipped.items]
    assert sum(len(call) for call in fake.calls) == len(samples) == 3  # one request a sample
    for sample in samples:
        expected = top_k_of(sample.token_ids.tolist(), k)
        actions = sample.loss_mask
        assert sample.teacher_top_ids.shape == sample.teacher_top_logprobs.shape == (len(sample), k)
        assert (sample.teacher_top_ids[actions] == expected.top_ids[actions]).all()
        assert (sample.teacher_top_logprobs[actions] == expected.top_logprobs[actions]).all()
        assert not sample.teacher_top_ids[~actions].any() and not sample.teacher_top_logprobs[~actions].any()
    mass = np.exp(-1.0 - np.arange(k) / 2).sum()
    assert records[0]["teacher_top_k_mass"] == pytest.approx(mass, rel=1e-6)
    assert records[0]["teacher_kl_mean"] == pytest.approx(distillation_metrics(samples, COEF)["teacher_kl_mean"])
    policy_rows = [mb for rank in policy.grids[0] for mb in rank if not mb.is_dummy]
    assert policy_rows and all(mb.teacher_top_ids is not None and mb.teacher_logprobs is None for mb in policy_rows)
    assert all(mb.teacher_top_ids is None for rank in critic.grids[0] for mb in rank)
    for mb in policy_rows:
        for index, sample in enumerate(samples):
            rows = np.flatnonzero(mb.sample_index == index)
            if rows.size:
                assert (mb.teacher_top_ids[rows] == sample.teacher_top_ids).all()
                assert (mb.teacher_top_logprobs[rows] == sample.teacher_top_logprobs).all()
    plain, distilled = multi_turn_samples(3), multi_turn_samples(3)
    config = AlgorithmConfig(type="ppo")
    critic_scores = InProcessScorer(lambda batched: ScoreResult(values=[np.full(len(t), 0.25, np.float32) for t in batched],
                                                                bootstrap_values=[0.0] * len(batched)))  # fmt: skip
    asyncio.run(make_algorithm(config, critic_scores).prepare_batch([plain], 0))
    asyncio.run(make_algorithm(config, critic_scores, Distillation(FakeTeacher(), COEF, "top_k_kl", top_k=k))
                .prepare_batch([distilled], 0))  # fmt: skip
    for a, b in zip(plain, distilled):
        assert a.advantages.tolist() == b.advantages.tolist() and b.teacher_top_ids is not None

    samples = multi_turn_samples()
    replies = [top_k_of(s.token_ids.tolist(), k) for s in samples]
    with pytest.raises(TeacherReplyError, match="answered 2 sequences for 3"):
        set_teacher_top_k(samples, replies[:2], k)
    narrow = list(replies)
    narrow[1] = top_k_of(samples[1].token_ids.tolist(), k - 1)
    with pytest.raises(TeacherReplyError, match=r"top-4 ids for group 7, branch 1: shape \(13, 3\) for 13 tokens"):
        set_teacher_top_k(samples, narrow, k)
    holed = [top_k_of(s.token_ids.tolist(), k) for s in samples]
    holed[2].top_logprobs[4, 2] = np.nan  # an action token's row
    with pytest.raises(TeacherReplyError, match="top-4 of group 7, branch 2, token 4, entry 2: id .*, log-probability nan"):
        set_teacher_top_k(samples, holed, k)
    holed[2].top_logprobs[4, 2] = -1.0
    holed[2].top_logprobs[0, 1] = np.nan  # row 0 is a prompt token's: not read
    set_teacher_top_k(samples, holed, k)
    with pytest.raises(ValueError, match="distillation.mode 'top_k_kl' needs distillation.top_k >= 1"):
        Distillation(FakeTeacher(), COEF, "top_k_kl")
    with pytest.raises(ConfigError, match=r"distillation.top_k \(100000\) is larger than the student's vocabulary"):
        orchestrator_config("sao", distillation={"teacher": teacher, "mode": "top_k_kl", "top_k": 100000})
