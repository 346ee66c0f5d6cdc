"""A stand-in for a vLLM server's `/v1/completions` with `prompt_logprobs` (an httpx
transport), for the teacher's tests without a vLLM process.

Its model: the logits at position t are `logits[token t-1]`, a row of a seeded random table, so
the distribution of every position is known to the test (`log_softmax`). Its replies have
vLLM 0.32's shape (vllm/logprobs.py `append_logprobs_for_next_position`): at each position t
>= 1 an object token id -> {logprob, rank, decoded_token} holding the prompt's own token t first,
with its rank 1 + (tokens of larger logit), then the K most likely tokens with ranks 1..K (the
prompt token's entry is overwritten when it is one of them); position 0 is null. A request
with prompt_logprobs above `max_logprobs` gets vLLM's 400.

    server = ScoringVllm(vocab=50, seed=0)
    teacher.client._http = httpx.AsyncClient(transport=server.transport())
"""

from __future__ import annotations

import json

import httpx
import numpy as np


class ScoringVllm:
    def __init__(self, vocab: int = 50, seed: int = 0, max_logprobs: int = 20):
        self.vocab, self.max_logprobs = vocab, max_logprobs
        self.logits = np.random.default_rng(seed).normal(0.0, 2.0, (vocab, vocab))
        self.requests: list[dict] = []  # the bodies received
        self.own_token_outside_top_k = 0  # positions whose entry held the prompt token beside the top k

    def log_softmax(self, previous: int) -> np.ndarray:
        """[vocab] float64: the log-probabilities at a position after token `previous`."""
        row = self.logits[previous]
        return row - row.max() - np.log(np.exp(row - row.max()).sum())

    def entry(self, previous: int, token: int, k: int) -> dict:
        logprobs = self.log_softmax(previous)
        own_rank = 1 + int((logprobs > logprobs[token]).sum())
        entry = {str(token): {"logprob": float(logprobs[token]), "rank": own_rank, "decoded_token": f"t{token}"}}
        for rank, top in enumerate(np.argsort(-logprobs, kind="stable")[:k], start=1):
            entry[str(int(top))] = {"logprob": float(logprobs[top]), "rank": rank, "decoded_token": f"t{top}"}
        self.own_token_outside_top_k += len(entry) > k
        return entry

    def handle(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.requests.append(body)
        prompt, k = body["prompt"], body.get("prompt_logprobs")
        if k is not None and k > self.max_logprobs:
            message = f"Requested prompt logprobs of {k}, which is greater than max allowed: {self.max_logprobs}"
            return httpx.Response(400, json={"error": {"message": message, "type": "BadRequestError",
                                                       "param": "prompt_logprobs", "code": 400}})  # fmt: skip
        entries = None if k is None else [None] + [self.entry(prompt[t - 1], prompt[t], k) for t in range(1, len(prompt))]
        choice = {"index": 0, "text": "", "token_ids": [1], "logprobs": {"token_logprobs": [-1.0]},
                  "finish_reason": "length", "prompt_logprobs": entries}  # fmt: skip
        return httpx.Response(200, json={"choices": [choice]})

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)
