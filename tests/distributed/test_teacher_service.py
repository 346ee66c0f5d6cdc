"""The Megatron teacher (`megatron-rl teacher`, distillation.teacher.megatron) against its HTTP
contract, in one start of its two gloo ranks at TP = 2 (the real CLI entry point): each token's
log-probability, and with `top_k` each position's top k tokens and their log-probabilities,
equal transformers' on the same weights (single- and multi-turn sequences, the whole sequence),
TP = 2, CP = 2, PP = 2 and two replicas equal one process, the client splits large batches,
requests merged into one pass are answered with their own rows, bad requests (a bad top_k
included) get 400, a failing pass 500 for its requests only, and SIGTERM stops both ranks
cleanly; the top-k arithmetic over a real two-rank group with a padded vocabulary."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from megatron_rl.critic.wire import BINARY_TOP_K, decode_top_k
from tests.support.spawn import run_ranks
from tests.support.teacher import teacher_config

VOCAB = 512  # the tiny qwen3's vocabulary
TOP_K = 16
TIE = 1e-6  # top-k ids are compared as sets where the reference's k-th and (k+1)-th log-probs are further apart


def multi_turn(tokenizer) -> list[int]:
    """A two-turn chat as one token sequence: prompt, reply, a tool observation, a second reply."""
    messages = [
        {"role": "user", "content": "Count to three."},
        {"role": "assistant", "content": "one two three"},
        {"role": "user", "content": "observation: ok, now backwards"},
        {"role": "assistant", "content": "three two one"},
    ]
    ids = tokenizer.apply_chat_template(messages, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def hf_logprobs(model_dir, ids: list[int]) -> np.ndarray:
    """transformers' log p(token t | tokens before it) in float32, nan at 0."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    picked = torch.log_softmax(logits[:-1], dim=-1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    return np.concatenate([[np.nan], picked.numpy()]).astype(np.float32)


def hf_log_softmax(model_dir, batch: list[list[int]]) -> list[np.ndarray]:
    """transformers' log p(v | tokens before t) for every token v, float32 [T, V] per sequence,
    row 0 nan (no tokens before it)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    rows = []
    with torch.no_grad():
        for ids in batch:
            log_p = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1).numpy()
            rows.append(np.concatenate([np.full((1, log_p.shape[1]), np.nan), log_p[:-1]]).astype(np.float32))
    return rows


def assert_top_k_of(result, reference: np.ndarray, k: int, atol: float) -> None:
    """`result` (a TeacherTopK) holds the k most likely tokens of `reference` ([T, V] log-probs,
    row 0 nan) and their log-probabilities within `atol`, most likely first; its ids equal
    torch.topk's as sets in every row without a tie (within TIE) at the k-th place."""
    ids, top, ref = result.top_ids, result.top_logprobs, reference[1:]
    assert ids.shape == top.shape == (len(reference), k) and ids.dtype == np.int32 and top.dtype == np.float32
    assert (ids[0] == 0).all() and np.isnan(top[0]).all()
    values, expected = torch.topk(torch.from_numpy(ref), k + 1 if k < ref.shape[1] else k, dim=-1)
    values, expected = values.numpy(), expected.numpy()
    np.testing.assert_allclose(top[1:], values[:, :k], atol=atol, rtol=0)
    np.testing.assert_allclose(np.take_along_axis(ref, ids[1:], 1), top[1:], atol=atol, rtol=0)  # each id's own
    assert (np.diff(top[1:], axis=1) <= 0).all()  # most likely first
    clear = values[:, k - 1] - values[:, k] > TIE if k < ref.shape[1] else np.ones(len(ref), bool)
    assert clear.mean() > 0.9  # the comparison below is not vacuous
    for row_ids, row_expected in zip(ids[1:][clear], expected[:, :k][clear]):
        assert set(row_ids.tolist()) == set(row_expected.tolist())


BAD_REQUESTS = [
    (b"{oops", "malformed JSON"),
    (b'{"batched_token_ids": []}', "is empty"),
    (b'{"batched_token_ids": [[1, 2], []]}', "batched_token_ids[1] is empty"),
    (b'{"batched_token_ids": [[1, 2.5]]}', "Expected `int`, got `float` - at `$.batched_token_ids[0][1]`"),
    (b'{"batched_token_ids": [[1, 512]]}', "outside the vocabulary"),
    (b'{"batched_token_ids": [[' + b", ".join([b"1"] * 129) + b"]]}", "teacher's seq_len is 128"),
    (b'{"batched_token_ids": [' + b", ".join([b"[1]"] * 9) + b"]}",
     "at most 8 per request (distillation.teacher.megatron.max_batch_sequences)"),
    (b'{"token_ids": [1, 2]}', "unknown field `token_ids`"),
    (b"{}", "Object missing required field `batched_token_ids`"),
    (b'{"batched_token_ids": [[1, 2]], "top_k": -1}', "top_k is -1; expected 0"),
    (b'{"batched_token_ids": [[1, 2]], "top_k": 513}', "up to the teacher's vocabulary size 512"),
    (b'{"batched_token_ids": [[1, 2]], "top_k": 2.5}', "Expected `int`, got `float` - at `$.top_k`"),
]


@pytest.fixture(scope="module")
def served(tiny_models, tmp_path_factory):
    """Everything one session with the teacher at TP = 2 returned (see `teacher_session`)."""
    model = tiny_models["qwen3"]
    tokenizer = AutoTokenizer.from_pretrained(model)
    single = list(tokenizer("The quick brown fox jumps over the lazy dog")["input_ids"])
    rng = np.random.default_rng(0)
    others = [rng.integers(0, VOCAB, int(n)).tolist() for n in (5, 17, 33, 2, 64)]
    samples = [single, multi_turn(tokenizer), *others]
    tmp = tmp_path_factory.mktemp("teacher_tp2")
    resolved, path = teacher_config(tmp, model, seq_len=128, tp=2, max_batch_sequences=8)
    assert resolved.layout.services["teacher"].megatron.tp == 2
    session = run_ranks(teacher_session, 2, str(path), samples, timeout_s=300)[0]
    return model, samples, session, tmp


def test_logprobs_equal_transformers_single_and_multi_turn(served):
    model, samples, session, _ = served
    rows = session["client_rows"]
    assert [len(r) for r in rows] == [len(s) for s in samples]
    for ids, row in zip(samples[:2], rows[:2]):
        expected = hf_logprobs(model, ids)
        assert np.isnan(row[0]) and row.dtype == np.float32
        np.testing.assert_allclose(row[1:], expected[1:], atol=1e-4, rtol=0)
        assert (row[1:] < 0).all() and np.isfinite(row[1:]).all()
    assert 40 < len(samples[1]) <= 128  # the whole two-turn chat, observation tokens included
    json_row = session["json_row"]
    assert json_row[0] is None and np.allclose(json_row[1:], rows[0][1:], atol=0)  # JSON: null at 0


@pytest.fixture(scope="module")
def hf_reference(served):
    """transformers' log-probabilities of every token at every position of the samples."""
    model, samples, _, _ = served
    return hf_log_softmax(model, samples)


def test_top_k_equals_transformers_single_and_multi_turn(served, hf_reference):
    """Through the client (binary reply): every sample's top TOP_K, and its log-probabilities,
    which are /logprobs' of the same sequence within float32 rounding."""
    _, samples, session, _ = served
    results = session["client_top_k"]
    assert len(results) == len(samples)
    for ids, result, reference, row in zip(samples, results, hf_reference, session["client_rows"]):
        assert_top_k_of(result, reference, TOP_K, atol=1e-4)
        own = np.take_along_axis(reference[1:], np.array(ids[1:])[:, None], 1)[:, 0]
        assert np.isnan(result.logprobs[0]) and result.logprobs.dtype == np.float32
        np.testing.assert_allclose(result.logprobs[1:], own, atol=1e-4, rtol=0)
        np.testing.assert_allclose(result.logprobs[1:], row[1:], atol=1e-6, rtol=0)
    json_reply = session["json_top_k"]
    assert set(json_reply) == {"logprobs", "top_ids", "top_logprobs"}
    for i, index in enumerate((0, 1)):  # the JSON reply carries the binary reply's numbers
        binary = results[index]
        assert json_reply["logprobs"][i][0] is None and json_reply["top_logprobs"][i][0] == [None] * TOP_K
        assert json_reply["top_ids"][i][0] == [0] * TOP_K
        np.testing.assert_array_equal(np.array(json_reply["top_ids"][i], np.int32), binary.top_ids)
        np.testing.assert_array_equal(np.array(json_reply["top_logprobs"][i][1:], np.float32), binary.top_logprobs[1:])
        np.testing.assert_array_equal(np.array(json_reply["logprobs"][i][1:], np.float32), binary.logprobs[1:])
    assert session["top_k_0"] == {"logprobs": [session["json_row"]]}  # top_k 0: the reply without it
    code, content_type, body = session["binary_top_k"]  # what the client asked for and read
    assert code == 200 and content_type == BINARY_TOP_K
    for decoded, result in zip(decode_top_k(body, [len(ids) for ids in samples[:2]], TOP_K), results[:2], strict=True):
        for field in ("logprobs", "top_ids", "top_logprobs"):
            np.testing.assert_array_equal(getattr(decoded, field), getattr(result, field))


@pytest.fixture(scope="module")
def alone(served, tmp_path_factory):
    """The samples' log-probabilities and top TOP_K from one process (tp 1), scored directly."""
    model, samples, _, _ = served
    _, path = teacher_config(tmp_path_factory.mktemp("teacher_tp1"), model, seq_len=128)
    return run_ranks(one_process_scores, 1, str(path), samples)[0]


def assert_same_scores(scores, alone, reference, atol: float = 1e-5) -> None:
    """`scores` ({"logprobs", "top_k"} of the samples) equal one process's within `atol`; the top
    ids as sets where the reference has no tie at the k-th place."""
    for a, b in zip(scores["logprobs"], alone["logprobs"]):
        np.testing.assert_allclose(a[1:], b[1:], atol=atol, rtol=0)
    for a, b, ref in zip(scores["top_k"], alone["top_k"], reference):
        np.testing.assert_allclose(a.logprobs[1:], b.logprobs[1:], atol=atol, rtol=0)
        np.testing.assert_allclose(a.top_logprobs[1:], b.top_logprobs[1:], atol=atol, rtol=0)
        assert_top_k_of(a, ref, TOP_K, atol=1e-4)


def test_tp2_equals_one_process(served, alone, hf_reference):
    session = served[2]
    assert_same_scores({"logprobs": session["client_rows"], "top_k": session["client_top_k"]}, alone, hf_reference)


@pytest.mark.parametrize("layout", [{"cp": 2}, {"pp": 2}, {"gpus": 2}])
def test_cp2_pp2_and_two_replicas_equal_one_process(served, alone, hf_reference, layout, tmp_path):
    """The same passes (log-probabilities, top k) at CP = 2 (each sequence split over two
    ranks), PP = 2 (megatron's forward-only schedule) and DP = 2 (two replicas), scored directly
    on two ranks."""
    model, samples, _, _ = served
    resolved, path = teacher_config(tmp_path, model, seq_len=128, **layout)
    assert resolved.layout.services["teacher"].megatron.world_size == 2
    assert_same_scores(run_ranks(one_process_scores, 2, str(path), samples)[0], alone, hf_reference)


def test_merged_requests_are_answered_with_their_own_rows(served):
    _, samples, session, _ = served
    status = session["status_after_merge"]
    # the slow request took one pass; the three sent while it ran were merged into one more
    assert status["scoring_passes"] - session["status_before_merge"]["scoring_passes"] == 2
    for batch, (code, reply) in zip(session["merged_batches"], session["merged_replies"]):
        assert code == 200
        for ids, row in zip(batch, reply):
            alone = session["client_rows"][samples.index(ids)]
            assert len(row) == len(ids) and row[0] is None
            np.testing.assert_array_equal(np.array(row[1:], np.float32), alone[1:])  # bit for bit (isolated)
    # the client split 7 sequences into requests of at most max_batch_sequences (8): one request;
    # with 3 a request: 3
    assert session["client_requests"] == [1, 3]


def test_bad_requests_400_and_a_failing_pass_500_for_its_requests_only(served):
    _, _, session, _ = served
    for (body, message), (code, reply) in zip(BAD_REQUESTS, session["bad_replies"]):
        assert code == 400, body
        assert message in reply["error"], (body, reply)
    (failed, failure), (after, good) = session["failing"]
    assert failed == 500 and "RuntimeError: injected: the forward of a 13-token sequence" in failure["error"]
    assert after == 200 and len(good["logprobs"][0]) == 2
    status = session["status_initial"]
    assert status["phase"] == "ready" and status["layout"]["tp"] == 2 and status["model"]["seq_len"] == 128
    assert session["health"] is True


SLICE_CASES = [(40, 20, 5), (30, 20, 12), (20, 20, 20), (15, 20, 3), (40, 20, 40)]  # (vocabulary, columns a rank, k)


def slice_case(vocab: int, local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [9, 2 * local] whose columns from `vocab` on (megatron's padding) are larger than
    any real one, and targets in the vocabulary."""
    generator = torch.Generator().manual_seed(vocab * 100 + local)
    logits = torch.randn(9, 2 * local, generator=generator) * 3
    logits[:, vocab:] = 50.0
    return logits, torch.randint(0, vocab, (9,), generator=generator)


def test_top_k_over_a_two_rank_group_with_a_padded_vocabulary():
    """`vocab_parallel_top_k` on two ranks, each with its half of the columns, over a real gloo
    group: log_softmax over the real vocabulary and torch.topk, also where one rank holds padding
    only (vocabulary 20 and 15) or k exceeds a rank's columns (k 40, 20 a rank)."""
    ranks = run_ranks(vocabulary_slices_top_k, 2, SLICE_CASES)
    for (vocab, local, k), rows, other in zip(SLICE_CASES, *ranks):
        np.testing.assert_array_equal(rows, other)  # every TP rank gets the same rows
        logits, targets = slice_case(vocab, local)
        log_p = torch.log_softmax(logits[:, :vocab].double(), dim=-1)
        top = log_p.topk(k, dim=-1).values
        np.testing.assert_allclose(rows[:, 0], log_p.gather(-1, targets[:, None])[:, 0], atol=1e-5, rtol=0)
        np.testing.assert_allclose(rows[:, 1 + k :], top, atol=1e-5, rtol=0)
        ids = rows[:, 1 : 1 + k].long()
        assert (ids < vocab).all() and all(len(set(r.tolist())) == k for r in ids)
        np.testing.assert_allclose(log_p.gather(-1, ids), top, atol=1e-5, rtol=0)


# Rank functions: module-level, so that the spawned ranks can import them.


def vocabulary_slices_top_k(rank, world_size, cases):
    import torch.distributed as dist

    from megatron_rl.teacher.scoring import vocab_parallel_top_k

    rows = []
    for vocab, local, k in cases:
        logits, targets = slice_case(vocab, local)
        mine = logits[:, rank * local : (rank + 1) * local]
        rows.append(vocab_parallel_top_k(mine, targets, k, rank * local, vocab, dist.group.WORLD))
    return rows


def one_process_scores(rank, world_size, resolved_path, samples):
    from megatron_rl.config import load_resolved
    from megatron_rl.teacher.worker import TeacherModel

    teacher = TeacherModel(load_resolved(resolved_path))
    return {"logprobs": teacher.score(samples), "top_k": teacher.score(samples, top_k=TOP_K)}


def teacher_session(rank, world_size, resolved_path, samples):
    """`megatron-rl teacher --config PATH` on every rank (the CLI's main), with the forward made to
    fail (on every rank, before its collectives) on a batch holding a 13-token sequence, and
    packing to take 1.5 s on one holding an 11-token sequence (so that requests sent meanwhile
    queue and merge). Rank 0 also runs the client in a
    thread and returns what it saw; then it stops the teacher with SIGTERM."""
    import asyncio
    import json
    import os
    import signal
    import threading
    import time

    import httpx

    from megatron_rl.config import load_resolved
    from megatron_rl.critic import scoring
    from megatron_rl.launch import cli
    from megatron_rl.teacher import scoring as teacher_scoring
    from megatron_rl.teacher.client import MegatronTeacher

    original_pack, original_forward = scoring.pack_into_grid, teacher_scoring._next_token_logprobs

    def pack(samples_, *args, **kwargs):
        if any(len(s.token_ids) == 11 for s in samples_):
            time.sleep(1.5)
        return original_pack(samples_, *args, **kwargs)

    def forward(model, batches):
        if any(13 in np.diff(b.cu_seqlens.cpu().numpy()) for b in batches):
            raise RuntimeError("injected: the forward of a 13-token sequence")
        return original_forward(model, batches)

    scoring.pack_into_grid, teacher_scoring._next_token_logprobs = pack, forward
    resolved = load_resolved(resolved_path)
    url = resolved.layout.services["teacher"].url
    out: dict = {}

    def post(batch=None, body=None):
        content = body if body is not None else json.dumps({"batched_token_ids": batch})
        reply = httpx.post(f"{url}/logprobs", content=content, timeout=120)
        return reply.status_code, reply.json()

    def client():
        try:
            async def ready():
                client = MegatronTeacher(url)
                try:
                    return await client.check_ready(timeout_s=120, poll_s=0.2)
                finally:
                    await client.close()

            out["status_initial"] = asyncio.run(ready())
            out["health"] = httpx.get(f"{url}/health", timeout=5).json()["ok"]

            async def through_client():
                whole, split = MegatronTeacher(url), MegatronTeacher(url, max_batch_sequences=3)
                try:
                    rows = await whole.logprobs(samples)
                    again = await split.logprobs(samples)
                    requests = [whole.requests, split.requests]
                    return rows, again, requests, await whole.top_k(samples, TOP_K)
                finally:
                    await whole.close()
                    await split.close()

            rows, again, out["client_requests"], out["client_top_k"] = asyncio.run(through_client())
            assert all(np.array_equal(a, b, equal_nan=True) for a, b in zip(rows, again))
            out["client_rows"] = rows
            out["json_row"] = post([samples[0]])[1]["logprobs"][0]
            out["json_top_k"] = post(body=json.dumps({"batched_token_ids": samples[:2], "top_k": TOP_K}))[1]
            out["top_k_0"] = post(body=json.dumps({"batched_token_ids": [samples[0]], "top_k": 0}))[1]
            binary = httpx.post(f"{url}/logprobs", content=json.dumps({"batched_token_ids": samples[:2], "top_k": TOP_K}),
                                headers={"Accept": BINARY_TOP_K}, timeout=120)  # fmt: skip
            out["binary_top_k"] = (binary.status_code, binary.headers["Content-Type"], binary.content)
            out["status_before_merge"] = httpx.get(f"{url}/status", timeout=5).json()
            batches = [[samples[2], samples[3]], [samples[0]], [samples[4], samples[1], samples[5]]]
            out["merged_batches"], replies = batches, [None] * len(batches)

            def send(i):
                code, reply = post(batches[i])
                replies[i] = (code, reply.get("logprobs", reply))

            slow = threading.Thread(target=post, args=([[3] * 11],))
            slow.start()
            time.sleep(0.5)  # the slow pass is running: the next three queue together
            senders = [threading.Thread(target=send, args=(i,)) for i in range(len(batches))]
            for t in senders:
                t.start()
            for t in [slow, *senders]:
                t.join()
            out["merged_replies"] = replies
            out["status_after_merge"] = httpx.get(f"{url}/status", timeout=5).json()
            out["bad_replies"] = [post(body=body) for body, _ in BAD_REQUESTS]
            out["failing"] = [post([[5] * 13, [6, 7]]), post([[7, 8]])]
        finally:
            os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=client, daemon=True) if rank == 0 else None
    if thread is not None:
        thread.start()
    code = cli.main(["teacher", "--config", resolved_path])
    if thread is not None:
        thread.join(timeout=30)
    assert code == 0
    return out


def test_the_orchestrator_scores_its_samples_with_the_megatron_teacher(tiny_models, tmp_path):
    """The orchestrator's loop (over the in-process fakes of tests/support/orchestrator.py) with
    the teacher the config's `distillation.teacher.megatron` makes (`make_teacher`): a real
    one-rank `megatron-rl teacher` process; every shipped sample carries the service's
    log-probabilities on its action tokens, and the step reports the signal."""
    import asyncio

    from megatron_rl.algorithms.distillation import distillation_metrics
    from megatron_rl.orchestrator.rollouts import PromptEncoder
    from megatron_rl.teacher.client import MegatronTeacher, make_teacher
    from tests.support.orchestrator import build_orchestrator, orchestrator_config
    from tests.support.teacher import start_teacher, teacher_url

    model = tiny_models["qwen3"]
    served, path = teacher_config(tmp_path / "teacher", model, seq_len=256)
    distillation = {"teacher": {"url": "http://unused:1", "model_dir": str(model)}, "coef": 0.5}
    resolved = orchestrator_config("grpo", distillation=distillation, num_steps=1, batch_size=2, group_size=2)
    encoder = PromptEncoder(AutoTokenizer.from_pretrained(model))
    with start_teacher(served, path, tmp_path / "ranks"):

        async def run():
            teacher = make_teacher(served, teacher_url(served))
            assert isinstance(teacher, MegatronTeacher)
            await teacher.check_ready(timeout_s=30)
            orchestrator, _, _, _, _, records = build_orchestrator(resolved, encoder, teacher=teacher)
            try:
                await asyncio.wait_for(orchestrator.run(), 60)
                samples = [s for _, s in orchestrator.shipped.items]
                direct = await teacher.logprobs([list(s.token_ids) for s in samples])
            finally:
                await teacher.close()
            return samples, direct, records, teacher.requests

        samples, direct, records, requests = asyncio.run(run())
    assert len(samples) == 4 and requests >= 2
    for sample, row in zip(samples, direct):
        np.testing.assert_array_equal(sample.teacher_logprobs, np.where(sample.loss_mask, row, 0.0).astype(np.float32))
        assert sample.loss_mask.any() and (sample.teacher_logprobs[sample.loss_mask] < 0).all()
    expected = distillation_metrics(samples, 0.5)
    assert records[0]["teacher_kl_mean"] == pytest.approx(expected["teacher_kl_mean"])
