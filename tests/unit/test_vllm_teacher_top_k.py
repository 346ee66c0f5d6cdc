"""The vLLM teacher's top k (distillation.mode top_k_kl; inference/teacher.py `VllmTeacher.top_k`,
inference/prompt_logprobs.py): against a stand-in vLLM whose distributions the test knows
(tests/support/scoring_vllm.py), every position's k most likely tokens and log-probabilities equal
a plain log-softmax and sort; the top k is chosen by rank, the prompt's own token outside it kept
as the token's log-probability only; a reply short of k tokens, unranked or null is an error
naming the server and the position; vLLM's refusal of k above --max-logprobs says how to lift
it; the run's own vLLM teacher is started with --max-logprobs distillation.top_k."""

from __future__ import annotations

import asyncio
import math

import httpx
import msgspec
import numpy as np
import pytest

from megatron_rl.config import parse_config
from megatron_rl.inference.rollout import RolloutClient, RolloutError, SamplingParams
from megatron_rl.inference.services import service_servers
from megatron_rl.inference.teacher import TeacherError, TeacherRequestError, VllmTeacher
from tests.support.scoring_vllm import ScoringVllm


def teacher_on(server: ScoringVllm) -> VllmTeacher:
    teacher = VllmTeacher("http://teacher:8000", "teacher", max_concurrent=3)
    teacher.client._http = httpx.AsyncClient(transport=server.transport())
    return teacher


def top_k_of(teacher: VllmTeacher, sequences: list[list[int]], k: int):
    async def run():
        try:
            return await teacher.top_k(sequences, k)
        finally:
            await teacher.close()

    return asyncio.run(run())


def reference_top_k(logits_row: np.ndarray, k: int) -> list[tuple[float, int]]:
    """The k largest (log-probability, token) of log_softmax(logits_row), by a loop over tokens."""
    norm = math.log(sum(math.exp(float(x)) for x in logits_row))
    scored = [(float(x) - norm, token) for token, x in enumerate(logits_row)]
    return sorted(scored, key=lambda pair: -pair[0])[:k]


@pytest.mark.parametrize("k", [1, 5, 20])
def test_the_top_k_of_every_position_equals_a_plain_log_softmax_and_sort(k):
    server = ScoringVllm(vocab=50, seed=k)
    rng = np.random.default_rng(100 + k)
    sequences = [rng.integers(0, 50, n).tolist() for n in (2, 7, 33)]
    scored = top_k_of(teacher_on(server), sequences, k)
    assert [body["prompt_logprobs"] for body in server.requests] == [k] * 3
    assert server.own_token_outside_top_k > 0  # the replies held the prompt's token beside the top k
    for tokens, got in zip(sequences, scored, strict=True):
        assert got.top_ids.shape == got.top_logprobs.shape == (len(tokens), k) and got.logprobs.shape == (len(tokens),)
        assert (got.top_ids.dtype, got.top_logprobs.dtype, got.logprobs.dtype) == (np.int32, np.float32, np.float32)
        assert got.top_ids[0].tolist() == [0] * k and np.isnan(got.top_logprobs[0]).all() and np.isnan(got.logprobs[0])
        for t in range(1, len(tokens)):
            want = reference_top_k(server.logits[tokens[t - 1]], k)
            assert got.top_ids[t].tolist() == [token for _, token in want]
            assert got.top_logprobs[t].tolist() == pytest.approx([lp for lp, _ in want], abs=1e-6)
            own = reference_top_k(server.logits[tokens[t - 1]], 50)
            assert got.logprobs[t] == pytest.approx(dict((tok, lp) for lp, tok in own)[tokens[t]], abs=1e-6)


def parse(entries: list, prompt_ids: list[int], k: int):
    reply = {"choices": [{"token_ids": [7], "logprobs": {"token_logprobs": [-0.1]}, "finish_reason": "length",
                          "prompt_logprobs": entries}]}  # fmt: skip
    client = RolloutClient("http://router:1", "teacher")
    try:
        return client._parse(msgspec.json.encode(reply), 0, "http://w:1", prompt_ids=prompt_ids, prompt_top_k=k)
    finally:
        asyncio.run(client.close())


def test_the_top_k_is_chosen_by_rank_and_the_prompt_token_outside_it_only_gives_its_own_logprob():
    # vLLM's order: the prompt token first (here rank 9, outside the top 3), then ranks 1..3;
    # listed here out of order to show that the rank decides, not the position in the object.
    position_1 = {"42": {"logprob": -6.5, "rank": 9}, "3": {"logprob": -1.5, "rank": 3},
                  "11": {"logprob": -0.5, "rank": 1}, "8": {"logprob": -1.0, "rank": 2}}  # fmt: skip
    position_2 = {"8": {"logprob": -0.25, "rank": 1}, "5": {"logprob": -2.0, "rank": 2}, "6": {"logprob": -3.0, "rank": 3}}
    completion = parse([None, position_1, position_2], [4, 42, 8], 3)
    assert completion.prompt_logprobs[1:] == [-6.5, -0.25] and math.isnan(completion.prompt_logprobs[0])
    assert completion.prompt_top_ids.tolist() == [[0, 0, 0], [11, 8, 3], [8, 5, 6]]
    assert completion.prompt_top_logprobs[1:].tolist() == [[-0.5, -1.0, -1.5], [-0.25, -2.0, -3.0]]
    # A tie: the prompt token (17) has the rank-2 token's log-probability, so rank 2 too; the
    # three of lowest rank are a top 3 (rank 3's token has the same log-probability as well).
    tie = {"17": {"logprob": -1.0, "rank": 2}, "11": {"logprob": -0.5, "rank": 1},
           "8": {"logprob": -1.0, "rank": 2}, "3": {"logprob": -1.0, "rank": 3}}  # fmt: skip
    completion = parse([None, tie], [4, 17], 3)
    assert completion.prompt_top_ids[1].tolist() == [11, 8, 17] and completion.prompt_top_logprobs[1].tolist() == [-0.5, -1.0, -1.0]


def test_a_reply_short_of_the_top_k_or_malformed_is_an_error_naming_the_server_and_the_position():
    full = {"9": {"logprob": -0.5, "rank": 1}, "8": {"logprob": -1.0, "rank": 2}, "3": {"logprob": -1.5, "rank": 3}}
    short = {"9": {"logprob": -0.5, "rank": 1}, "8": {"logprob": -1.0, "rank": 2}, "40": {"logprob": -7.0, "rank": 30}}
    with pytest.raises(RolloutError, match=r"^http://w:1: prompt_logprobs at position 2 hold 2 tokens of rank 1\.\.3 "
                                           r"\(3 entries\); expected the top 3$"):  # fmt: skip
        parse([None, full, short], [1, 9, 40], 3)
    unranked = {**full, "8": {"logprob": -1.0}}
    with pytest.raises(RolloutError, match=r"^http://w:1: prompt_logprobs at position 1: token 8 has no rank >= 1$"):
        parse([None, unranked], [1, 9], 3)
    with pytest.raises(RolloutError, match=r"^http://w:1: prompt_logprobs at position 2 is null; expected the top 3"):
        parse([None, full, None], [1, 9, 9], 3)
    with pytest.raises(RolloutError, match=r"^http://w:1: prompt_logprobs at position 1 do not include token 5$"):
        parse([None, full], [1, 5], 3)
    with pytest.raises(RolloutError, match=r"^http://w:1: asked for prompt_logprobs of 3 tokens, got 2$"):
        parse([None, full], [1, 9, 9], 3)
    with pytest.raises(RolloutError, match=r"^http://w:1: unexpected completion reply \(Expected `int`"):
        parse([None, {"nine": {"logprob": -0.5, "rank": 1}}], [1, 9], 1)
    # Through the teacher: a short reply from the server is a TeacherError naming the teacher's URL.
    server = ScoringVllm(vocab=30, seed=1)
    server.entry = lambda previous, token, k: {str(token): {"logprob": -1.0, "rank": 1}}  # one token, whatever k
    with pytest.raises(TeacherError, match=r"^the teacher at http://teacher:8000 \(distillation.teacher\): "
                                           r"http://teacher:8000: prompt_logprobs at position 1 hold 1 tokens"):  # fmt: skip
        top_k_of(teacher_on(server), [[1, 2, 3]], 4)


def test_a_top_k_above_the_servers_max_logprobs_is_a_request_error_saying_how_to_lift_it():
    server = ScoringVllm(vocab=60, seed=2, max_logprobs=20)
    assert len(top_k_of(teacher_on(server), [[1, 2, 3]], 20)) == 1  # up to the limit: answered
    with pytest.raises(TeacherRequestError) as refused:
        top_k_of(teacher_on(server), [[1, 2, 3], [4, 5]], 21)
    message = str(refused.value)
    assert message.startswith("the teacher at http://teacher:8000 (distillation.teacher): completion for session")
    assert "HTTP 400" in message and "Requested prompt logprobs of 21, which is greater than max allowed: 20" in message
    assert message.endswith("raise the teacher server's --max-logprobs to at least 21 (vLLM's default is 20; a teacher "
                            "the run serves gets it from distillation.top_k) or lower distillation.top_k")  # fmt: skip

    def refuse(request: httpx.Request) -> httpx.Response:
        return httpx.Response(400, json={"error": {"message": "This model's maximum context length is 8 tokens"}})

    teacher = VllmTeacher("http://teacher:8000", "teacher")
    teacher.client._http = httpx.AsyncClient(transport=httpx.MockTransport(refuse))
    with pytest.raises(TeacherRequestError) as other:  # another refusal: no word of --max-logprobs
        asyncio.run(teacher.logprobs([list(range(12))]))
    assert "maximum context length" in str(other.value) and "--max-logprobs" not in str(other.value)
    teacher.client._http = httpx.AsyncClient(transport=httpx.MockTransport(lambda request: httpx.Response(500)))
    with pytest.raises(TeacherError, match=r"HTTP 500") as failed:
        asyncio.run(teacher.top_k([[1, 2]], 4))
    assert not isinstance(failed.value, TeacherRequestError)
    with pytest.raises(ValueError, match=r"needs k >= 1 \(distillation.top_k\), not 0"):
        asyncio.run(teacher.top_k([[1, 2]], 0))


def test_logprobs_and_the_top_k_ask_for_what_they_read():
    client = RolloutClient("http://router:1", "teacher")
    assert "prompt_logprobs" not in client._body([1, 2], SamplingParams(), None, None, None)
    assert client._body([1, 2], SamplingParams(prompt_logprobs=True), None, None, None)["prompt_logprobs"] == 0
    assert client._body([1, 2], SamplingParams(prompt_top_k=64), None, None, None)["prompt_logprobs"] == 64
    asyncio.run(client.close())


def served_teacher_config(tmp_path, model, **distillation) -> dict:
    """A GRPO run on 8 CUDA GPUs whose teacher (the same tiny model) the run serves with vLLM."""
    return {
        "model": {"hf_config": str(model), "seq_len": 128},
        "algorithm": {"type": "grpo"},
        "orchestrator": {"num_steps": 2, "batch_size": 4, "group_size": 2, "max_prompt_tokens": 32,
                         "max_completion_tokens": 16},  # fmt: skip
        "inference": {"num_servers": 1, "weight_update": "safetensors", "publish_dir": str(tmp_path / "published")},
        "deployment": {"nodes": 1, "gpus_per_node": 8, "inference_gpus": 1, "policy_gpus": 2},
        "logging": {"dir": str(tmp_path / "run")},
        "distillation": {"teacher": {"model_dir": str(model), "serve": {"base_port": 9300, "router_port": 9350}},
                         **distillation},  # fmt: skip
    }


def test_the_runs_own_vllm_teacher_allows_the_top_k(tmp_path, tiny_models):
    model = tiny_models["qwen3"]

    def teacher_command(**distillation) -> list[str]:
        (server,) = service_servers(parse_config(served_teacher_config(tmp_path, model, **distillation)), "teacher",
                                    [["0"]], tmp_path / "logs")  # fmt: skip
        return server.command

    command = teacher_command(mode="top_k_kl", top_k=64)
    assert command[command.index("--max-logprobs") + 1] == "64"
    assert "--max-logprobs" not in teacher_command(mode="kl_penalty")  # vLLM's default (20) is enough for 0
    whole_vocabulary = {"model_dir": str(model), "serve": {"extra_args": ["--max-logprobs=-1"]}}
    assert teacher_command(mode="top_k_kl", top_k=8, teacher=whole_vocabulary)[-3:] == [
        "--max-logprobs", "8", "--max-logprobs=-1"]  # the user's last: vLLM takes it  # fmt: skip
    with pytest.raises(ValueError, match=r"distillation.teacher.serve.extra_args sets --max-logprobs 10, below "
                                         r"distillation.top_k \(64\)"):  # fmt: skip
        teacher_command(mode="top_k_kl", top_k=64, teacher={"model_dir": str(model),
                                                            "serve": {"extra_args": ["--max-logprobs", "10"]}})  # fmt: skip
