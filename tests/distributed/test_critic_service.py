"""The critic as a process (`megatron-rl critic` on gloo ranks) against its HTTP contract:
batched = per-sample = legacy scoring, every bad request answered 400 while the service keeps
serving, sparse / large / concurrent requests, training from the ZMQ stream, clean SIGTERM."""

from __future__ import annotations

import asyncio
import json
import random
import time

import aiohttp
import numpy as np
import pytest

from megatron_rl.config import load_resolved
from megatron_rl.critic.client import CriticError, CriticRequestError, HttpValueScorer
from megatron_rl.data.packing import pack_into_grid
from megatron_rl.parallel import free_port
from megatron_rl.transport import GridSender
from tests.support.critic import critic_config, critic_url, start_critic, value_loss
from tests.support.samples import training_samples

VOCAB = 512  # the tiny qwen3's vocabulary


@pytest.fixture(scope="module")
def critic(tiny_models, tmp_path_factory):
    """A critic with DP=2 (CP=1) on two ranks, shared by the tests of this module."""
    tmp = tmp_path_factory.mktemp("critic_dp2")
    resolved, path = critic_config(tmp, tiny_models["qwen3"], world=2, num_steps=2)
    ranks = start_critic(resolved, path, tmp / "ranks")
    yield resolved, ranks, tmp, asyncio.run(status_of(critic_url(resolved)))  # status before any test
    ranks.__exit__(None, None, None)


async def status_of(url: str) -> dict:
    scorer = HttpValueScorer(url)
    try:
        return await scorer.status()
    finally:
        await scorer.close()


def mixed_batch(count: int, seed: int = 0, longest: int = 64) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(1, longest))] for _ in range(count)]


async def post(url: str, body: bytes) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{url}/score", data=body) as response:
            return response.status, json.loads(await response.read())


def assert_same(a, b, atol=1e-5):
    assert len(a.values) == len(b.values)
    for x, y in zip(a.values, b.values):
        assert x.shape == y.shape
        np.testing.assert_allclose(x, y, atol=atol, rtol=0)
    np.testing.assert_allclose(a.bootstrap_values, b.bootstrap_values, atol=atol, rtol=0)


def check_batched_equals_per_sample(url: str) -> None:
    batch = mixed_batch(9)

    async def run():
        scorer = HttpValueScorer(url)
        try:
            batched = await scorer.score(batch)
            singles = [await scorer.score([ids]) for ids in batch]
            reversed_ = await scorer.score(batch[::-1])
            legacy = [await post(url, json.dumps({"token_ids": ids}).encode()) for ids in batch[:3]]
        finally:
            await scorer.close()
        return batched, singles, reversed_, legacy

    batched, singles, reversed_, legacy = asyncio.run(run())
    assert [len(v) for v in batched.values] == [len(ids) for ids in batch]
    for i, single in enumerate(singles):
        np.testing.assert_allclose(batched.values[i], single.values[0], atol=1e-5, rtol=0)
        assert batched.bootstrap_values[i] == pytest.approx(single.bootstrap_values[0], abs=1e-5)
    assert_same(
        reversed_, type(batched)(values=batched.values[::-1], bootstrap_values=batched.bootstrap_values[::-1])
    )
    for i, (status, reply) in enumerate(legacy):
        assert status == 200 and set(reply) == {"values", "bootstrap_value", "step"}
        np.testing.assert_allclose(reply["values"], batched.values[i], atol=1e-5, rtol=0)
        assert reply["bootstrap_value"] == pytest.approx(batched.bootstrap_values[i], abs=1e-5)
    assert all(v[0] == 0.0 for v in batched.values)  # no state before the first token
    assert max(abs(b) for b in batched.bootstrap_values) > 1e-3  # a non-trivial head


def test_health_and_status(critic):
    resolved, _, _, initial = critic
    assert initial["trained_step"] == -1 and initial["phase"] == "ready" and initial["busy"] is False

    async def run():
        scorer = HttpValueScorer(critic_url(resolved))
        try:
            return await scorer.health(), await scorer.status()
        finally:
            await scorer.close()

    healthy, status = asyncio.run(run())
    assert healthy  # other tests of this module may have trained it by now
    assert status["trained_step"] in (-1, 0, 1) and status["phase"] in ("ready", "finished")
    assert status["layout"]["dp"] == 2 and status["model"]["family"] == "qwen3"
    assert status["model"]["seq_len"] == 64 and status["num_steps"] == 2


def test_batched_equals_per_sample_at_dp2(critic):
    check_batched_equals_per_sample(critic_url(critic[0]))


BAD_REQUESTS = [
    (b"{oops", "malformed JSON"),
    (b'"text"', "Expected `object`, got `str`"),
    (b'{"batched_token_ids": []}', "is empty"),
    (b'{"batched_token_ids": [[1, 2], []]}', "batched_token_ids[1] is empty"),
    (b'{"batched_token_ids": [[1, 2.5]]}', "Expected `int`, got `float` - at `$.batched_token_ids[0][1]`"),
    (b'{"batched_token_ids": [["1"]]}', "Expected `int`, got `str` - at `$.batched_token_ids[0][0]`"),
    (b'{"batched_token_ids": [[1, 512]]}', "outside the vocabulary"),
    (b'{"batched_token_ids": [[-3]]}', "outside the vocabulary"),
    (json.dumps({"batched_token_ids": [list(range(65))]}).encode(), "seq_len is 64"),
    (json.dumps({"batched_token_ids": [[1]] * 65}).encode(), "at most 64 per request"),
    (b'{"token_ids": 5}', "Expected `array | null`, got `int` - at `$.token_ids`"),
    (b'{"tokens": [1]}', "unknown field `tokens`"),
    (b'{}', "expected exactly one key"),
]


def test_bad_requests_get_400_and_the_service_keeps_serving(critic):
    url = critic_url(critic[0])

    async def run():
        replies = [await post(url, body) for body, _ in BAD_REQUESTS]
        good = await post(url, b'{"batched_token_ids": [[1, 2, 3]]}')
        return replies, good

    replies, good = asyncio.run(run())
    for (body, message), (status, reply) in zip(BAD_REQUESTS, replies):
        assert status == 400, body
        assert message in reply["error"], (body, reply)
    assert good[0] == 200 and len(good[1]["values"][0]) == 3


def test_client_surfaces_refusals_and_unreachable_critics(critic):
    url = critic_url(critic[0])

    async def run():
        scorer = HttpValueScorer(url)
        dead = HttpValueScorer(f"http://127.0.0.1:{free_port()}", retries=2, backoff_s=0.05)
        try:
            with pytest.raises(CriticRequestError) as refused:
                await scorer.score([[1, 99999]])
            with pytest.raises(CriticError) as unreachable:
                await dead.score([[1]])
        finally:
            await scorer.close()
            await dead.close()
        return str(refused.value), str(unreachable.value)

    refused, unreachable = asyncio.run(run())
    assert url in refused and "outside the vocabulary" in refused
    assert "unreachable after 3 attempts" in unreachable and "127.0.0.1" in unreachable


def test_sparse_large_and_concurrent_requests(critic):
    url = critic_url(critic[0])
    batch = mixed_batch(64, seed=5)
    groups = [mixed_batch(8, seed=10 + g) for g in range(8)]

    async def run():
        scorer = HttpValueScorer(url)
        try:
            one = await scorer.score(batch[:1])
            large = await scorer.score(batch)
            concurrent = await asyncio.gather(*(scorer.score(g) for g in groups))
            references = [await scorer.score(g) for g in groups]  # one at a time
        finally:
            await scorer.close()
        return one, large, concurrent, references

    one, large, concurrent, references = asyncio.run(run())
    assert len(large.values) == 64
    np.testing.assert_allclose(one.values[0], large.values[0], atol=1e-5, rtol=0)
    for got, expected in zip(concurrent, references):
        assert_same(got, expected)


def test_training_from_the_zmq_stream_lowers_the_value_loss(critic):
    resolved, ranks, tmp, _ = critic
    url = critic_url(resolved)
    samples = training_samples(8, VOCAB, seed=21)
    request = [s.token_ids.tolist() for s in samples]
    grid = pack_into_grid(samples, resolved.value.model.seq_len, 2)

    async def run(sender):
        scorer = HttpValueScorer(url)
        try:
            before = await scorer.score(request)
            losses = [value_loss(before, samples)]
            for step in range(2):
                sender.publish(step, grid, timeout_s=60)
                status = await scorer.wait_trained(step, timeout_s=120)
                after = await scorer.score(request)
                assert after.step == step
                losses.append(value_loss(after, samples))
            return losses, status, await scorer.status()
        finally:
            await scorer.close()

    with GridSender(
        "127.0.0.1", resolved.transport.critic_port, data_parallel_size=2, name="critic"
    ) as sender:
        losses, trained, final = asyncio.run(run(sender))
        sender.wait_delivered(1, timeout_s=60)
    assert losses[1] < losses[0] and losses[2] < losses[1], losses
    assert trained["trained_step"] == 1 and final["phase"] == "finished"
    records = [json.loads(line) for line in (tmp / "logs" / "critic_metrics.jsonl").read_text().splitlines()]
    assert [(r["phase"], r["step"]) for r in records] == [("rl", 0), ("rl", 1)]
    assert all(r["num_tokens"] == sum(s.num_action_tokens for s in samples) for r in records)
    assert (tmp / "checkpoints" / "critic" / "latest").read_text() == "step_00000001"
    check_batched_equals_per_sample(url)  # still consistent after training


def test_sigterm_stops_every_rank_cleanly(tiny_models, tmp_path):
    """Its own critic (the module's shared one keeps serving the other tests, in any order):
    SIGTERM after a training step ends every rank with exit 0 and says where it stopped."""
    resolved, path = critic_config(tmp_path, tiny_models["qwen3"], world=2, num_steps=3)
    samples = training_samples(4, VOCAB, seed=3)
    grid = pack_into_grid(samples, resolved.value.model.seq_len, 2)
    with start_critic(resolved, path, tmp_path / "ranks") as ranks:
        with GridSender("127.0.0.1", resolved.transport.critic_port, data_parallel_size=2, name="critic") as sender:
            sender.publish(0, grid, timeout_s=60)

            async def trained():
                scorer = HttpValueScorer(critic_url(resolved))
                try:
                    return await scorer.wait_trained(0, timeout_s=120)
                finally:
                    await scorer.close()

            assert asyncio.run(trained())["trained_step"] == 0
        assert ranks.stop() == [0, 0]
        assert "critic: stopped after step 0" in ranks.output(0)


@pytest.mark.parametrize(
    "world,cp",
    [
        (2, 2),
        pytest.param(4, 1, marks=pytest.mark.slow),
        pytest.param(4, 2, marks=pytest.mark.slow),
        pytest.param(4, 4, marks=pytest.mark.slow),
    ],
)
def test_batched_equals_per_sample_at_other_layouts(tiny_models, tmp_path, world, cp):
    resolved, path = critic_config(tmp_path, tiny_models["qwen3"], world=world, cp=cp)
    assert resolved.layout.critic.dp == world // cp
    with start_critic(resolved, path, tmp_path / "ranks") as ranks:
        check_batched_equals_per_sample(critic_url(resolved))
        assert ranks.stop() == [0] * world


def test_a_failing_score_request_gets_500_and_the_critic_keeps_serving(tiny_models, tmp_path):
    """Scoring that raises (on every rank while packing, or on one rank only) answers just that
    request with HTTP 500 naming the cause; all ranks stay in lockstep and the next requests are
    scored; SIGTERM still stops every rank cleanly."""
    from tests.support.spawn import run_ranks
    resolved, path = critic_config(tmp_path, tiny_models["qwen3"], world=2, num_steps=1)
    replies = run_ranks(critic_with_failing_scores, 2, str(path), timeout_s=300)[0]
    assert [status for status, _ in replies] == [200, 500, 500, 200]
    assert "PackingError: injected: a 13-token sequence" in replies[1][1]["error"]
    assert "another rank failed" in replies[2][1]["error"]
    assert len(replies[3][1]["values"][0]) == 3


def test_a_killed_critic_rank_ends_the_critic_named_and_clients_get_an_error(tiny_models, tmp_path):
    """Issue 16 item 8: kill -9 critic rank 1 while the critic trains: rank 0 (the HTTP service)
    exits non-zero within the heartbeat timeout, naming rank 1, and a client's request gets an
    error naming the critic service instead of hanging."""
    timeout_s = 6.0
    resolved, path = critic_config(
        tmp_path, tiny_models["qwen3"], world=2, num_steps=100, deployment={"heartbeat_timeout_s": timeout_s}
    )
    url = critic_url(resolved)
    with start_critic(resolved, path, tmp_path / "ranks") as ranks:
        with GridSender("127.0.0.1", resolved.transport.critic_port, data_parallel_size=2, name="critic") as sender:
            for step in range(2):
                grid = pack_into_grid(training_samples(4, VOCAB, seed=step), resolved.value.model.seq_len, 2)
                sender.publish(step, grid, timeout_s=60)

            async def kill_while_training() -> tuple[float, BaseException | None]:
                scorer = HttpValueScorer(url, retries=3, backoff_s=0.5, timeout_s=60)
                try:
                    await scorer.wait_trained(0, timeout_s=120)
                    ranks.processes[1].kill()  # step 1 is training or about to
                    began = time.monotonic()
                    try:
                        await scorer.score(mixed_batch(4))
                    except CriticError as exc:
                        return time.monotonic() - began, exc
                    return time.monotonic() - began, None
                finally:
                    await scorer.close()

            seconds, error = asyncio.run(kill_while_training())
            code = ranks.processes[0].wait(timeout=2 * timeout_s + 30)
    output = ranks.output(0)
    assert ranks.processes[1].returncode == -9
    assert code != 0, output
    assert "critic rank 0 of 2: lost rank 1" in output, output[-3000:]
    assert error is not None and f"critic service {url}/score" in str(error), (seconds, error)
    assert seconds < 2 * timeout_s + 30


# Rank functions: module-level, so that the spawned ranks can import them.


def critic_with_failing_scores(rank, world_size, resolved_path):
    """`run_critic` on every rank, with scoring made to fail twice: on every rank while packing a
    batch that holds a 13-token sequence (a deterministic failure), and on rank 1 only after
    the collectives of the third scoring call. Rank 0 also runs the client in a thread and
    returns [(status, reply)] for its requests; afterwards it stops the critic with SIGTERM."""
    import json
    import os
    import signal
    import threading
    import time

    import httpx

    from megatron_rl.critic import scoring, worker
    from megatron_rl.critic.trainer import CriticTrainer
    from megatron_rl.data.packing import PackingError

    original_pack, original_score = scoring.pack_into_grid, CriticTrainer.score
    calls = {"n": 0}

    def pack(samples, *args, **kwargs):
        if any(len(s.token_ids) == 13 for s in samples):
            raise PackingError("injected: a 13-token sequence")
        return original_pack(samples, *args, **kwargs)

    def score(self, request, request_sizes=None):
        result = original_score(self, request, request_sizes)
        calls["n"] += 1
        if calls["n"] == 2 and rank == 1:  # the third request (the second was refused while packing)
            raise RuntimeError("injected: rank 1 fails after its collectives")
        return result

    scoring.pack_into_grid, CriticTrainer.score = pack, score
    resolved = load_resolved(resolved_path)
    url = f"http://{resolved.value.service.host}:{resolved.value.service.port}"
    replies = []

    def client():
        for _ in range(600):
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        for batch in ([[1, 2, 3]], [[5] * 13, [6]], [[7, 8]], [[9, 10, 11]]):
            reply = httpx.post(f"{url}/score", content=json.dumps({"batched_token_ids": batch}), timeout=60)
            replies.append((reply.status_code, reply.json()))
        os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=client, daemon=True) if rank == 0 else None
    if thread is not None:
        thread.start()
    worker.run_critic(resolved)
    if thread is not None:
        thread.join(timeout=30)
    return replies
