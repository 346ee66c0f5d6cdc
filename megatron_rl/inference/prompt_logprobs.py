"""vLLM's `prompt_logprobs` of a completion reply, read per prompt position.

A request with `prompt_logprobs: K` gets, for every prompt position t >= 1, a JSON object
token id -> {logprob, rank, decoded_token} of the distribution given tokens 0..t-1 at
temperature 1 (vLLM computes it from the raw logits whatever the request's temperature): the K
most likely tokens, ranks 1..K in torch.topk's order, and the prompt's own token t with its rank
in the vocabulary (1 + the number of tokens with a larger logit) when it is not among them, so
K or K + 1 entries (vllm/logprobs.py `append_logprobs_for_next_position`). Position 0 is null.
K = 0 gives the prompt token's entry alone. A log-probability of -inf arrives as -9999.0 (vLLM's
`clamp_prompt_logprobs`).

`token_logprobs(entries, prompt_ids)` returns each prompt token's own log-probability;
`top_k(entries, k)` the K most likely tokens and their log-probabilities at every position,
chosen by rank. Both raise ValueError naming the position of a reply that does not hold them.
"""

from __future__ import annotations

import msgspec
import numpy as np


class PromptLogprob(msgspec.Struct):
    logprob: float
    rank: int | None = None  # 1 = the most likely token


# One position's entries, keyed by token id (JSON object keys, decoded as ints).
PositionEntries = dict[int, PromptLogprob]


def token_logprobs(entries: list[PositionEntries | None], prompt_ids: list[int]) -> list[float]:
    """The log-probability of each prompt token given the tokens before it (nan where the
    position's entry is null: position 0, which has no context)."""
    if len(entries) != len(prompt_ids):
        raise ValueError(f"asked for prompt_logprobs of {len(prompt_ids)} tokens, got {len(entries)}")
    values = []
    for position, (entry, token) in enumerate(zip(entries, prompt_ids)):
        if entry is None:
            values.append(float("nan"))
        elif int(token) in entry:
            values.append(float(entry[int(token)].logprob))
        else:
            raise ValueError(f"prompt_logprobs at position {position} do not include token {token}")
    return values


def top_k(entries: list[PositionEntries | None], k: int) -> tuple[np.ndarray, np.ndarray]:
    """([T, k] int32, [T, k] float32): at each position t >= 1 the k tokens of rank 1..k, most
    likely first, and their log-probabilities; row 0 is ids 0 and log-probabilities nan.

    The prompt's own token outside the top k (rank > k) is left out. Where it ties with the
    top k (rank <= k but not one of torch.topk's k), the k entries of lowest rank are taken,
    the larger log-probability first among equal ranks: its log-probability equals that of the
    top-k token it displaces, so the result is still a top k."""
    if k < 1:
        raise ValueError(f"top_k needs k >= 1, not {k}")
    if not entries or entries[0] is not None:
        raise ValueError("prompt_logprobs at position 0 should be null (the first token has no context)")
    ids = np.zeros((len(entries), k), dtype=np.int32)
    logprobs = np.full((len(entries), k), np.nan, dtype=np.float32)
    for position, entry in enumerate(entries[1:], start=1):
        if entry is None:
            raise ValueError(f"prompt_logprobs at position {position} is null; expected the top {k} tokens")
        unranked = [token for token, value in entry.items() if value.rank is None or value.rank < 1]
        if unranked:
            raise ValueError(f"prompt_logprobs at position {position}: token {unranked[0]} has no rank >= 1")
        ranked = sorted((value.rank, -value.logprob, token) for token, value in entry.items() if value.rank <= k)
        if len(ranked) < k:
            raise ValueError(
                f"prompt_logprobs at position {position} hold {len(ranked)} tokens of rank 1..{k} "
                f"({len(entry)} entries); expected the top {k}"
            )
        ids[position] = [token for _, _, token in ranked[:k]]
        logprobs[position] = [-negated for _, negated, _ in ranked[:k]]
    return ids, logprobs
