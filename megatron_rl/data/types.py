"""The core types: TrainingSample, MicroBatch, Grid (names are the contract between modules).

Arrays are numpy so that they cross process boundaries as raw buffers (see transport/); the
trainer turns a MicroBatch into one rank's torch tensors with `trainer.batches.rank_batch`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np


@dataclass
class TrainingSample:
    """One trainable branch of a rollout group.

    `loss_mask` is True on policy-generated action tokens only; `inference_logprobs` is the
    sampler's log-probability per token (0 where not an action). Annotated later: `values`
    (per token, the value of the state before that token), `bootstrap_value`, `advantages`,
    `returns` (per token, 0 off the action tokens).

    `truncated`: ended without EOS. `episode_done`: the environment ended the episode, so its
    reward is final and the value after the last token is 0. GAE bootstraps the tail with the
    critic's value only when a sample is truncated and its episode is not done (a multi-turn
    rollout cut off by its token budget). A single-turn answer cut off at the length limit and
    graded is done: bootstrapping it would add V to a terminal reward, which at gamma 1 grows
    the values without bound.

    `reward` is what the advantages see: the environment's reward plus any shaping
    (`orchestrator.overlong`); `score` is the environment's own reward (default: `reward`).

    `routes` (a MoE policy with `algorithm.routing_replay` on): the experts the sampler routed
    each token to, [R, moe_layers, top_k] (uint8 up to 256 experts, else uint16) for the first
    R <= T tokens; vLLM routes every token it ran through the model, so R is T - 1 (the last
    sampled token was never fed back). The tokens after R get padding routes when packed
    (`padding_routes`; transforms/routing.py replays them).

    `token_versions` ([T] int64): the policy version that sampled each action token (a partial
    rollout, interrupted by weight updates and resumed, spans several); the prompt's and the
    observations' tokens carry the oldest. `policy_version` is the oldest: staleness is judged by
    it. None: every token `policy_version`.

    `teacher_logprobs` ([T] float32, on-policy distillation): the teacher's log-probability of
    each action token after the same prefix (0 elsewhere; algorithms/distillation.py).
    `teacher_top_ids` and `teacher_top_logprobs` ([T, K] int32 and float32, distillation.mode
    `top_k_kl`): at each action token's position t the teacher's K most likely tokens given the
    tokens before t, most likely first, and their log-probabilities at temperature 1 (ids 0 and
    log-probabilities 0 on the other rows).
    """

    token_ids: np.ndarray  # [T] int64
    loss_mask: np.ndarray  # [T] bool
    inference_logprobs: np.ndarray  # [T] float32
    reward: float
    truncated: bool = False
    episode_done: bool = False
    group_id: int = 0
    branch_index: int = 0
    policy_version: int = 0
    values: np.ndarray | None = None  # [T] float32
    bootstrap_value: float | None = None
    advantages: np.ndarray | None = None  # [T] float32
    returns: np.ndarray | None = None  # [T] float32
    score: float | None = None  # the environment's reward before shaping
    routes: np.ndarray | None = None  # [R <= T, moe_layers, top_k] uint8 / uint16
    token_versions: np.ndarray | None = None  # [T] int64
    teacher_logprobs: np.ndarray | None = None  # [T] float32
    teacher_top_ids: np.ndarray | None = None  # [T, K] int32 (distillation top_k_kl)
    teacher_top_logprobs: np.ndarray | None = None  # [T, K] float32 (distillation top_k_kl)

    def __post_init__(self) -> None:
        if self.score is None:
            self.score = self.reward
        self.token_ids = np.asarray(self.token_ids, dtype=np.int64)
        self.loss_mask = np.asarray(self.loss_mask, dtype=bool)
        self.inference_logprobs = np.asarray(self.inference_logprobs, dtype=np.float32)
        n = len(self.token_ids)
        if self.token_versions is not None:
            self.token_versions = np.asarray(self.token_versions, dtype=np.int64)
        for name in ("loss_mask", "inference_logprobs") + (("token_versions",) if self.token_versions is not None else ()):
            if len(getattr(self, name)) != n:
                raise ValueError(
                    f"TrainingSample(group {self.group_id}, branch {self.branch_index}): {name} has "
                    f"{len(getattr(self, name))} entries for {n} tokens"
                )
        if self.routes is not None:
            routes = np.asarray(self.routes)
            if routes.ndim != 3 or len(routes) > n or routes.dtype not in ROUTE_DTYPES:
                raise ValueError(
                    f"TrainingSample(group {self.group_id}, branch {self.branch_index}): routes of shape "
                    f"{routes.shape} and dtype {routes.dtype}; expected [at most {n} tokens, moe_layers, top_k] "
                    "of uint8 or uint16"
                )
            self.routes = routes

    def __len__(self) -> int:
        return len(self.token_ids)

    def versions(self) -> np.ndarray:
        """[T] int64: the version that sampled each token (`token_versions`, or `policy_version`)."""
        if self.token_versions is not None:
            return self.token_versions
        return np.full(len(self.token_ids), self.policy_version, dtype=np.int64)

    @property
    def num_action_tokens(self) -> int:
        return int(self.loss_mask.sum())


# Expert indices of `routes` (`route_dtype`).
ROUTE_DTYPES = (np.dtype(np.uint8), np.dtype(np.uint16))


def route_dtype(num_experts: int) -> np.dtype:
    """The compact dtype of expert indices: uint8 up to 256 experts, uint16 up to 65,536."""
    if num_experts <= 256:
        return np.dtype(np.uint8)
    if num_experts <= 65536:
        return np.dtype(np.uint16)
    raise ValueError(f"routing replay: {num_experts} experts do not fit a uint16 expert index")


def padding_routes(num_tokens: int, num_layers: int, topk: int, dtype=np.uint8) -> np.ndarray:
    """Routes for tokens vLLM did not route (padding, a sample's last token): experts 0..k-1 in
    every layer, valid and distinct. Real tokens never see them (they are in no sequence, or
    after every position that has a target)."""
    return np.broadcast_to(np.arange(topk, dtype=dtype), (num_tokens, num_layers, topk)).copy()


# Per-token float arrays a MicroBatch carries (all [num_tokens] float32).
MICRO_BATCH_FLOAT_FIELDS = ("advantages", "returns", "old_values", "inference_logprobs")


@dataclass
class MicroBatch:
    """Sequences packed end to end into one row of `num_tokens` tokens (THD layout).

    `position_ids` restart at 0 for every sequence; `cu_seqlens` ([num_sequences + 1], int32)
    are the sequence boundaries; padding at the end of the bin (for CP divisibility) belongs to
    no sequence and is masked. `sample_index[i]` is the original index (in the list given to the
    packer) of the sample the token belongs to, -1 for padding. A dummy micro-batch (`is_dummy`)
    has an all-False mask and contributes exactly zero loss and gradient. `minibatch` is the
    policy mini-batch of the step it belongs to (`algorithm.policy_minibatches`; 0 for the
    critic and when there is one): the policy makes one optimizer step per mini-batch.

    The policy's grid carries the samples' `routes` when routing replay is on ([N, moe_layers,
    top_k], padding routes where the sampler routed nothing) and `routed` ([N] bool: the sampler
    routed the token); the critic's grid never does. A dummy carries neither. Under on-policy
    distillation's `kl_penalty` the policy's grid carries `teacher_logprobs` ([N] float32, the
    teacher's log-probability of each action token, 0 elsewhere); a dummy does not. Under
    `top_k_kl` it carries `teacher_top_ids` ([N, K] int32) and `teacher_top_logprobs` ([N, K]
    float32): the samples' rows (`TrainingSample.teacher_top_ids`), ids 0 and log-probabilities 0
    on the padding; a dummy carries neither.
    """

    input_ids: np.ndarray  # [N] int64
    position_ids: np.ndarray  # [N] int64
    cu_seqlens: np.ndarray  # [S + 1] int32
    loss_mask: np.ndarray  # [N] bool
    advantages: np.ndarray  # [N] float32
    returns: np.ndarray  # [N] float32
    old_values: np.ndarray  # [N] float32
    inference_logprobs: np.ndarray  # [N] float32
    sample_index: np.ndarray  # [N] int64
    is_dummy: bool = False
    minibatch: int = 0
    routes: np.ndarray | None = None  # [N, moe_layers, top_k] uint8 / uint16
    routed: np.ndarray | None = None  # [N] bool
    teacher_logprobs: np.ndarray | None = None  # [N] float32 (distillation kl_penalty: the policy's grid)
    teacher_top_ids: np.ndarray | None = None  # [N, K] int32 (distillation top_k_kl: the policy's grid)
    teacher_top_logprobs: np.ndarray | None = None  # [N, K] float32 (distillation top_k_kl)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def seq_lens(self) -> np.ndarray:
        return np.diff(self.cu_seqlens)

    @property
    def num_action_tokens(self) -> int:
        return int(self.loss_mask.sum())

    def arrays(self) -> dict[str, np.ndarray]:
        """The arrays that travel (the optional ones, `routes` to `teacher_top_logprobs`, only when set)."""
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.name not in ("is_dummy", "minibatch") and getattr(self, f.name) is not None
        }


Grid = list[list[MicroBatch]]  # grid[data_rank][micro_step]


@dataclass
class TeacherTopK:
    """A teacher's scores of one token sequence with its top k (on-policy distillation's
    `top_k_kl` mode; algorithms/distillation.py `TeacherScorer.top_k`), all at temperature 1:

        logprobs[t]       = log p(token t | tokens 0..t-1)                  [T] float32, nan at 0
        top_ids[t, j]     = the j-th most likely token at position t given tokens 0..t-1,
                            most likely first                              [T, K] int32, row 0: 0
        top_logprobs[t, j] = its log-probability                          [T, K] float32, row 0: nan
    """

    logprobs: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray


@dataclass
class ScoreResult:
    """The critic's reply for one batch of sequences, in request order."""

    values: list[np.ndarray]  # per sequence, [T_i] float32
    bootstrap_values: list[float]
    step: int = 0
