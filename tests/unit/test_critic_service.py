"""Request validation and request merging of the critic's scoring service (no processes)."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from megatron_rl.critic.service import BadRequest, ScoreQueue, answer, parse_score_request
from megatron_rl.data.types import ScoreResult
from megatron_rl.parallel import free_port

VOCAB, SEQ_LEN, MAX_BATCH = 100, 16, 4


def parse(body: bytes):
    return parse_score_request(body, VOCAB, SEQ_LEN, MAX_BATCH)


def test_batched_and_legacy_shapes():
    assert parse(b'{"batched_token_ids": [[1, 2], [3]]}') == ([[1, 2], [3]], False)
    assert parse(b'{"token_ids": [5, 6, 7]}') == ([[5, 6, 7]], True)
    assert parse(b'{"batched_token_ids": [[99]]}') == ([[99]], False)


@pytest.mark.parametrize(
    "body,message",
    [
        (b"{not json", "malformed JSON"),
        (b"[1, 2]", "invalid request: Expected `object`, got `array`"),
        (b"{}", "expected exactly one key"),
        (b'{"batched_token_ids": [[1]], "token_ids": [1]}', "expected exactly one key"),
        (b'{"batched_tokens_ids": [[1]]}', "unknown field `batched_tokens_ids`"),
        (b'{"batched_token_ids": []}', "batched_token_ids is empty"),
        (b'{"batched_token_ids": [[1], []]}', "batched_token_ids[1] is empty"),
        (b'{"batched_token_ids": [1, 2]}', "Expected `array`, got `int` - at `$.batched_token_ids[0]`"),
        (b'{"batched_token_ids": "abc"}', "got `str` - at `$.batched_token_ids`"),
        (b'{"batched_token_ids": [[1, 2.5]]}', "Expected `int`, got `float` - at `$.batched_token_ids[0][1]`"),
        (b'{"batched_token_ids": [[1, "7"]]}', "Expected `int`, got `str` - at `$.batched_token_ids[0][1]`"),
        (b'{"batched_token_ids": [[1, true]]}', "Expected `int`, got `bool` - at `$.batched_token_ids[0][1]`"),
        (b'{"batched_token_ids": [[1, null]]}', "Expected `int`, got `null` - at `$.batched_token_ids[0][1]`"),
        (b'{"batched_token_ids": [[1, 100]]}', "token id 100 outside the vocabulary 0..99"),
        (b'{"batched_token_ids": [[-1, 3]]}', "token id -1 outside"),
        (b'{"batched_token_ids": [[1], [2], [3], [4], [5]]}', "at most 4 per request"),
        (b'{"token_ids": []}', "token_ids is empty"),
        (b'{"token_ids": [[1]]}', "Expected `int`, got `array` - at `$.token_ids[0]`"),
        (b'{"token_ids": ' + str(list(range(17))).encode() + b"}", "17 tokens; the critic's seq_len is 16"),
    ],
)
def test_bad_requests_name_the_problem(body, message):
    with pytest.raises(BadRequest) as info:
        parse(body)
    assert message in str(info.value)


def test_queue_merges_requests_and_answers_each_with_its_own_rows():
    queue = ScoreQueue()
    futures = [queue.submit([[i] * (i + 1)] * (i + 1)) for i in range(3)]  # 1, 2, 3 sequences
    taken = queue.take(max_sequences=3)
    assert [len(t.sequences) for t in taken] == [1, 2]  # the third would exceed 3 sequences
    merged = [ids for t in taken for ids in t.sequences]
    answer(
        taken,
        ScoreResult(
            values=[np.full(len(ids), float(ids[0])) for ids in merged],
            bootstrap_values=[float(ids[0]) for ids in merged],
            step=7,
        ),
    )
    first, second = futures[0].result(), futures[1].result()
    assert first.bootstrap_values == [0.0] and first.step == 7
    assert second.bootstrap_values == [1.0, 1.0] and [len(v) for v in second.values] == [2, 2]
    assert len(queue) == 1
    (third,) = queue.take(max_sequences=1)  # a request larger than the limit still goes alone
    assert len(third.sequences) == 3
    assert not queue.wait(0.01)


def test_queue_fail_all_reaches_every_waiting_request():
    queue = ScoreQueue()
    futures = [queue.submit([[1]]) for _ in range(2)]
    queue.fail_all(RuntimeError("shutting down"))
    for future in futures:
        with pytest.raises(RuntimeError, match="shutting down"):
            future.result(timeout=1)


@contextlib.contextmanager
def serving(vocab, seq_len, max_batch, values, bootstrap, step):
    """A real ScoringService on a free port, with the critic's main loop reduced to answering
    each merged sequence with `values(ids)` and `bootstrap(its values)` at `step`."""
    import threading

    from megatron_rl.critic.service import CriticState, ScoringService

    queue = ScoreQueue()
    service = ScoringService("127.0.0.1", free_port(), queue, CriticState({}), vocab, seq_len, max_batch, 60.0)
    service.start()
    stop = threading.Event()

    def scorer():
        while not stop.is_set():
            if queue.wait(0.05):
                taken = queue.take(max_batch)
                scored = [values(ids) for t in taken for ids in t.sequences]
                answer(taken, ScoreResult(scored, [bootstrap(v) for v in scored], step))

    threading.Thread(target=scorer, daemon=True).start()
    try:
        yield service
    finally:
        stop.set()
        service.stop()


def test_the_largest_valid_request_is_scored_and_a_larger_one_gets_413():
    """At 64 x 4,096 tokens of 6-digit ids the largest valid body is ~2.1 MB, over aiohttp's 1 MiB
    default; it is scored. A body over the service's limit is answered 413 with a message."""
    import httpx

    vocab, seq_len, max_batch = 151_936, 4096, 64
    zeros = lambda ids: np.zeros(len(ids))  # noqa: E731
    with serving(vocab, seq_len, max_batch, zeros, lambda v: 0.0, step=3) as service:
        largest = b'{"batched_token_ids": [' + b", ".join([b"[" + b", ".join([b"151935"] * seq_len) + b"]"] * max_batch) + b"]}"
        assert len(largest) > 2_000_000
        reply = httpx.post(f"{service.url}/score", content=largest, timeout=60)
        assert reply.status_code == 200, reply.text
        assert len(reply.json()["values"]) == max_batch and reply.json()["step"] == 3
        too_big = b'{"batched_token_ids": [[' + b"1, " * (service.max_body_bytes // 3) + b"1]]}"
        reply = httpx.post(f"{service.url}/score", content=too_big, timeout=60)
        assert reply.status_code == 413
        assert "over this critic's limit" in reply.json()["error"] and "max_batch_sequences" in reply.json()["error"]


def test_a_token_guards_every_endpoint_and_our_client_sends_it(monkeypatch):
    """value.service.token_env: requests without the right bearer token get 401; HttpValueScorer
    with the token is served; a missing variable is an error naming key and variable."""
    import asyncio

    import httpx

    from megatron_rl.config import ConfigError, secret_from_env
    from megatron_rl.critic.client import CriticError, HttpValueScorer
    from megatron_rl.critic.service import CriticState, ScoringService

    monkeypatch.setenv("CRITIC_TOKEN", "s3cret")
    token = secret_from_env("CRITIC_TOKEN", "value.service.token_env")
    monkeypatch.delenv("MISSING_TOKEN", raising=False)
    with pytest.raises(ConfigError, match="value.service.token_env names the environment variable MISSING_TOKEN"):
        secret_from_env("MISSING_TOKEN", "value.service.token_env")
    assert secret_from_env(None, "value.service.token_env") is None
    service = ScoringService("127.0.0.1", free_port(), ScoreQueue(), CriticState({}), 100, 16, 4, 5.0, token=token)
    service.start()
    try:
        for path in ("/health", "/status"):
            assert httpx.get(service.url + path).status_code == 401
            assert httpx.get(service.url + path, headers={"Authorization": "Bearer wrong"}).status_code == 401
        reply = httpx.post(service.url + "/score", content=b'{"batched_token_ids": [[1]]}')
        assert reply.status_code == 401 and "value.service.token_env" in reply.json()["error"]

        async def client(token):
            scorer = HttpValueScorer(service.url, token=token, retries=0)
            try:
                return await scorer.health(), await scorer.status()
            finally:
                await scorer.close()

        healthy, status = asyncio.run(client("s3cret"))
        assert healthy and status["queued_requests"] == 0
        with pytest.raises(CriticError, match="401"):
            asyncio.run(client(None))
    finally:
        service.stop()


def test_binary_and_json_replies_carry_the_same_values_and_our_client_asks_for_binary():
    """`Accept: application/x-float32-values` gets float32 bytes (critic/wire.py) holding exactly
    the numbers of the JSON reply, about a fifth of its size; HttpValueScorer asks for it and
    still reads a JSON reply; a binary body of the wrong size is an error naming the sizes."""
    import asyncio

    import httpx

    from megatron_rl.critic.client import CriticError, HttpValueScorer
    from megatron_rl.critic.wire import BINARY_VALUES, STEP_HEADER, decode_values, encode_values

    def values_of(ids):  # float32 values with many digits, a function of the ids
        return (np.sin(np.asarray(ids) * 1.3) / 7.0).astype(np.float32)

    batch = [[3, 1, 4, 1, 5], [9], [2, 6, 5, 3, 5, 8, 9, 7]]
    body = b'{"batched_token_ids": ' + str(batch).encode() + b"}"
    with serving(VOCAB, SEQ_LEN, MAX_BATCH, values_of, lambda v: float(v[-1] * np.float32(3)), step=5) as service:
        json_reply = httpx.post(f"{service.url}/score", content=body)
        binary = httpx.post(f"{service.url}/score", content=body, headers={"Accept": BINARY_VALUES})
        assert binary.headers["Content-Type"].startswith(BINARY_VALUES) and binary.headers[STEP_HEADER] == "5"
        assert len(binary.content) == 4 * (3 + 14) and len(binary.content) * 3 < len(json_reply.content)
        decoded, as_json = decode_values(binary.content, [len(ids) for ids in batch], 5), json_reply.json()
        assert all(v.dtype == np.float32 for v in decoded.values)
        assert [v.tolist() for v in decoded.values] == as_json["values"]  # the same numbers, exactly
        assert decoded.bootstrap_values == as_json["bootstrap_values"] and as_json["step"] == 5
        assert all(np.array_equal(v, values_of(ids)) for v, ids in zip(decoded.values, batch))
        round_trip = decode_values(encode_values(decoded), [5, 1, 8], 5)
        assert all(np.array_equal(a, b) for a, b in zip(round_trip.values, decoded.values))
        legacy = httpx.post(f"{service.url}/score", content=b'{"token_ids": [1, 2]}', headers={"Accept": BINARY_VALUES})
        assert set(legacy.json()) == {"values", "bootstrap_value", "step"}  # the legacy shape stays JSON

        async def ours():
            client = HttpValueScorer(service.url, retries=0)
            try:
                return await client.score(batch)
            finally:
                await client.close()

        result = asyncio.run(ours())
        assert [len(v) for v in result.values] == [5, 1, 8] and result.step == 5
        assert result.bootstrap_values == [float(np.float32(v[-1] * 3)) for v in result.values]
    with pytest.raises(ValueError, match="binary reply of 8 bytes; 2 sequences of 3 tokens need 20"):
        decode_values(b"\0" * 8, [1, 2], 0)

    def json_only(request):  # a critic that answers JSON whatever is asked
        reply = {"values": [[0.5, 0.25]], "bootstrap_values": [0.125], "step": 2}
        return httpx.Response(200, json=reply)

    def wrong_size(request):
        return httpx.Response(200, content=b"\0" * 4, headers={"Content-Type": BINARY_VALUES, STEP_HEADER: "2"})

    async def against(handler):
        client = HttpValueScorer("http://critic", retries=0, transport=httpx.MockTransport(handler))
        try:
            return await client.score([[1, 2]])
        finally:
            await client.close()

    result = asyncio.run(against(json_only))
    assert result.values[0].tolist() == [0.5, 0.25] and result.bootstrap_values == [0.125] and result.step == 2
    with pytest.raises(CriticError, match="binary reply does not follow the contract: binary reply of 4 bytes"):
        asyncio.run(against(wrong_size))
