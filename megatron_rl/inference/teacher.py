"""The teacher of on-policy distillation, served by vLLM (algorithms/distillation.py); the
Megatron teacher's client is megatron_rl/teacher/client.py (`MegatronTeacher`), which raises the
errors defined here too; teacher/client.py `make_teacher(resolved, url)` builds the one the
config asks for.

`VllmTeacher(url, model)` scores token sequences: one `/v1/completions` request a sequence with
the sequence as the token-id prompt, `prompt_logprobs` 0 (the log-probability of each prompt
token given the tokens before it, of the untempered distribution) and one generated token (vLLM
needs one; it is discarded). Requests carrying prompt_logprobs never read vLLM's prefix cache,
so each sequence is scored once, whole. At most `max_concurrent` requests are in flight; each
goes through `RolloutClient` (retried once on another server of the teacher's); a failure is a
TeacherError naming the server, a refusal (HTTP 400) a TeacherRequestError.

`top_k(batched_token_ids, k)` (distillation.mode top_k_kl) asks `prompt_logprobs` k: besides
each token's log-probability, the k most likely tokens at every position and theirs
(`TeacherTopK`; inference/prompt_logprobs.py reads vLLM's reply). vLLM refuses k above its
`--max-logprobs` (default 20) with a 400; the run starts its own vLLM teacher with
`--max-logprobs` of at least distillation.top_k (inference/services.py).

`check_same_tokenizer(student, teacher, where)` is the start-up check that both read the same
token ids: the same vocabulary (every token at the same id) and the same special tokens;
otherwise the teacher's log-probabilities would be of other tokens than the student sampled.
"""

from __future__ import annotations

import asyncio
import dataclasses
import zlib

import httpx
import numpy as np

from megatron_rl.data.types import TeacherTopK
from megatron_rl.inference.rollout import Completion, RolloutClient, RolloutError, SamplingParams

SCORING = SamplingParams(temperature=1.0, max_tokens=1, prompt_logprobs=True)


class TeacherError(RuntimeError):
    pass


class TeacherTimeout(TeacherError):
    """A teacher request took longer than `distillation.teacher.timeout_s`."""


class TeacherRequestError(TeacherError, ValueError):
    """The teacher refused a request (HTTP 400)."""


class VllmTeacher:
    def __init__(self, url: str, model: str, api_key: str | None = None, timeout_s: float = 600.0,
                 max_concurrent: int = 64):  # fmt: skip
        self.url, self.model = url.rstrip("/"), model
        self.client = RolloutClient(self.url, model, timeout_s=timeout_s, api_key=api_key)
        self.max_concurrent = max_concurrent
        self._bound: asyncio.Semaphore | None = None
        self.requests = 0

    async def logprobs(self, batched_token_ids: list[list[int]]) -> list[np.ndarray]:
        """[T] float64 per sequence: log p_teacher(token_t | tokens before it), nan at 0."""
        completions = await self._score(batched_token_ids, SCORING)
        return [np.asarray(c.prompt_logprobs, dtype=np.float64) for c in completions]

    async def top_k(self, batched_token_ids: list[list[int]], k: int) -> list[TeacherTopK]:
        """Per sequence of T tokens: each token's log-probability ([T] float32, nan at 0), and at
        each position t the k most likely tokens given tokens 0..t-1, most likely first ([T, k]
        int32, row 0: 0), with their log-probabilities ([T, k] float32, row 0: nan); all of the
        untempered distribution."""
        if k < 1:
            raise ValueError(f"VllmTeacher.top_k needs k >= 1 (distillation.top_k), not {k}")
        completions = await self._score(batched_token_ids, dataclasses.replace(SCORING, prompt_top_k=int(k)))
        return [
            TeacherTopK(np.asarray(c.prompt_logprobs, dtype=np.float32), c.prompt_top_ids, c.prompt_top_logprobs)
            for c in completions
        ]

    async def _score(self, batched_token_ids: list[list[int]], sampling: SamplingParams) -> list[Completion]:
        """One request a sequence, at most max_concurrent in flight; the completions in order."""
        self._bound = self._bound or asyncio.Semaphore(self.max_concurrent)

        async def one(token_ids: list[int]) -> Completion:
            session = f"teacher-{zlib.crc32(np.asarray(token_ids, dtype=np.int64).tobytes()):08x}"
            try:
                async with self._bound:
                    completion = await self.client.complete(token_ids, sampling, session)
            except RolloutError as exc:
                raise self._error(exc, sampling.prompt_top_k) from None
            self.requests += 1
            return completion

        return list(await asyncio.gather(*[one([int(t) for t in ids]) for ids in batched_token_ids]))

    def _error(self, exc: RolloutError, k: int) -> TeacherError:
        """The TeacherError of a failed request: a TeacherRequestError for a refusal (400), which
        for a top k above vLLM's limit says how to lift it."""
        where = f"the teacher at {self.url} (distillation.teacher): {exc}"
        if exc.status != 400:
            return TeacherError(where)
        if k and "logprobs" in str(exc):
            return TeacherRequestError(
                f"{where}; the teacher's vLLM does not return the top {k} tokens a position (distillation.top_k "
                f"{k}): raise the teacher server's --max-logprobs to at least {k} (vLLM's default is 20; a teacher "
                "the run serves gets it from distillation.top_k) or lower distillation.top_k"
            )
        return TeacherRequestError(where)

    async def check_ready(self, timeout_s: float = 30.0) -> None:
        """The teacher answers /v1/models with its model; a TeacherError naming the URL if not."""
        try:
            reply = await self.client._http.get(f"{self.url}/v1/models", timeout=timeout_s)
            names = [entry["id"] for entry in reply.json().get("data", [])] if reply.status_code == 200 else None
        except (httpx.HTTPError, ValueError) as exc:
            raise TeacherError(f"the teacher at {self.url} (distillation.teacher): {type(exc).__name__}: {exc}") from None
        if names is None or self.model not in names:
            raise TeacherError(
                f"the teacher at {self.url} (distillation.teacher) does not serve {self.model!r} "
                f"(distillation.teacher.served_model_name); it answered {names if names is not None else reply.status_code}"
            )

    async def close(self) -> None:
        await self.client.close()


def check_same_tokenizer(student, teacher, where: str) -> None:
    """Raises ValueError naming `where` (the teacher's model_dir) unless both tokenizers have
    the same vocabulary and special tokens."""
    problems = []
    mine, theirs = student.get_vocab(), teacher.get_vocab()
    if mine != theirs:
        differing = sorted(set(mine.items()) ^ set(theirs.items()), key=lambda item: item[1])
        problems.append(f"vocabularies differ ({len(mine)} and {len(theirs)} tokens; e.g. {differing[:3]})")
    for name in ("eos_token_id", "bos_token_id", "pad_token_id"):
        if getattr(student, name, None) != getattr(teacher, name, None):
            problems.append(f"{name} {getattr(student, name, None)} (student) and {getattr(teacher, name, None)} (teacher)")
    if problems:
        raise ValueError(
            f"distillation.teacher.model_dir {where}: the teacher's tokenizer is not the student's ("
            + "; ".join(problems) + "): its log-probabilities would be of other tokens than the student sampled"
        )
