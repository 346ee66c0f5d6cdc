"""On-policy distillation's signal: the teacher's log-probabilities of the student's own tokens.

For every action token a_t of a sample (loss mask True; prompt and observation tokens are not
the student's choices and get nothing), with the student's sampler log-probability and the
teacher's of the same token after the same prefix:

    k_t = log pi_student(a_t) - log pi_teacher(a_t)      (the reverse-KL estimate, per token)
    r_t = -coef * k_t                                    (its dense reward)

Summed over the sample, E[sum_t k_t] is KL(pi_student || pi_teacher) of the completion, so
maximising the dense reward moves the student towards the teacher where the student samples
(on-policy, mode-seeking). Both log-probabilities are of the untempered distributions: the
config requires `orchestrator.temperature` 1 (the teacher's are vLLM's prompt_logprobs, which
are of temperature 1).

`distillation.mode` says where the signal enters training:

- `reward`: beside the task reward. How the estimators take it (`algorithms/base.py`): GAE adds
  r_t to each action token's reward (skip-observation GAE's per-token rewards, the task reward
  still on the last action token), for the policy's advantages and the critic's targets alike;
  the outcome estimators (GRPO, RLOO, REINFORCE++, ...) see one scalar per sample, the task
  reward plus sum_t r_t.
- `advantage` (Thinking Machines' recipe, Tinker's `incorporate_kl_penalty` with a discount of
  0): the estimator sees the task reward alone, then each action token's advantage gets r_t
  added, A_t + r_t: the token's own reverse KL, not a sum over the sample, not normalised over
  the group or whitened, never seen by the critic (`token_advantages`, added once for every
  estimator in `Algorithm.prepare_batch`). With `distillation.baseline` the term is
  -coef * (k_t - b), b the mean of k_t over the step's action tokens (`batch_mean`) or over the
  sample's group's (`group_mean`): since E_{a ~ pi_student}[grad log pi_student(a | prefix)] = 0
  at every prefix, a b that does not depend on the token keeps the term's gradient unbiased (up
  to the token's own 1/n share of the mean) and removes the push-down that a student far from
  its teacher gives every sampled token alike (`baselines`).
- `kl_penalty`: a term of the policy's loss (policy/loss.py: coef x the per-token estimator
  `algorithm.kl_estimator` against the teacher's log-probabilities, which the policy's grid
  carries); the rewards and advantages are the task's alone.
- `top_k_kl` (NeMo-RL's top-k logit distillation, verl's distillation `topk`): the teacher
  returns, at every position, its `distillation.top_k` most likely tokens and their
  log-probabilities (`TeacherScorer.top_k`); the policy's grid carries them and its loss adds
  coef x sum_j p_teacher(j) (log p_teacher(j) - log p_student(j)) over those j at each action
  token's position (models/logprobs.py `vocab_parallel_top_k_kl`): the forward KL of the
  teacher's top k from the student's whole distribution, a signal about every likely token at
  every position the student visits, where the modes above score the one token it sampled.
  The rewards and advantages are the task's alone; `teacher_kl_mean` is still k_t's mean (the
  sampled token's log-probability comes in the same reply).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from megatron_rl.data.types import TeacherTopK, TrainingSample


class TeacherScorer(Protocol):
    """The teacher: for each token sequence, the log-probability of every token given the tokens
    before it ([T] float, the first nan), at temperature 1; with `top_k`, also each position's k
    most likely tokens and their log-probabilities (data/types.py `TeacherTopK`)."""

    async def logprobs(self, batched_token_ids: list[list[int]]) -> list[np.ndarray]: ...

    async def top_k(self, batched_token_ids: list[list[int]], k: int) -> list[TeacherTopK]: ...


class TeacherReplyError(RuntimeError):
    """The teacher's reply does not fit the sequences it was asked about."""


def set_teacher_logprobs(samples: list[TrainingSample], replies: list[np.ndarray]) -> None:
    """Stores each reply as the sample's `teacher_logprobs` ([T] float32, 0 off the action
    tokens); a TeacherReplyError naming the sample when a reply has the wrong length or a
    non-finite value on an action token."""
    if len(replies) != len(samples):
        raise TeacherReplyError(f"the teacher answered {len(replies)} sequences for {len(samples)}")
    for sample, reply in zip(samples, replies):
        reply = np.asarray(reply, dtype=np.float64)
        where = f"group {sample.group_id}, branch {sample.branch_index}"
        if reply.shape != (len(sample),):
            raise TeacherReplyError(f"teacher log-probabilities for {where}: {reply.shape[0]} for {len(sample)} tokens")
        actions = sample.loss_mask
        if not np.isfinite(reply[actions]).all():
            bad = int(np.flatnonzero(actions & ~np.isfinite(reply))[0])
            raise TeacherReplyError(f"teacher log-probability of {where}, token {bad}: {reply[bad]}")
        sample.teacher_logprobs = np.where(actions, reply, 0.0).astype(np.float32)


def set_teacher_top_k(samples: list[TrainingSample], replies: list[TeacherTopK], k: int) -> None:
    """Stores each reply's log-probabilities as `set_teacher_logprobs` does and its top k as the
    sample's `teacher_top_ids` ([T, k] int32) and `teacher_top_logprobs` ([T, k] float32), both 0
    off the action tokens' rows; a TeacherReplyError naming the sample when a reply's arrays are
    not [T] and [T, k], or an action token's row holds a negative id or a log-probability that is
    not finite or above 0 (up to float32 rounding)."""
    if len(replies) != len(samples):
        raise TeacherReplyError(f"the teacher answered {len(replies)} sequences for {len(samples)}")
    set_teacher_logprobs(samples, [reply.logprobs for reply in replies])
    for sample, reply in zip(samples, replies):
        where = f"group {sample.group_id}, branch {sample.branch_index}"
        ids, logprobs = np.asarray(reply.top_ids), np.asarray(reply.top_logprobs, dtype=np.float32)
        for name, array in (("ids", ids), ("log-probabilities", logprobs)):
            if array.shape != (len(sample), k):
                raise TeacherReplyError(f"teacher top-{k} {name} for {where}: shape {array.shape} for {len(sample)} tokens")
        actions = sample.loss_mask
        bad = actions[:, None] & ~(np.isfinite(logprobs) & (logprobs <= 1e-4) & (ids >= 0))
        if bad.any():
            t, j = map(int, np.argwhere(bad)[0])
            raise TeacherReplyError(f"teacher top-{k} of {where}, token {t}, entry {j}: id {ids[t, j]}, "
                                    f"log-probability {logprobs[t, j]}")  # fmt: skip
        sample.teacher_top_ids = np.where(actions[:, None], ids, 0).astype(np.int32)
        sample.teacher_top_logprobs = np.where(actions[:, None], np.minimum(logprobs, 0.0), 0.0).astype(np.float32)


def reverse_kl(sample: TrainingSample) -> np.ndarray:
    """[T] float64: k_t = log pi_student(a_t) - log pi_teacher(a_t) on action tokens, 0 elsewhere."""
    if sample.teacher_logprobs is None:
        raise ValueError(f"group {sample.group_id}, branch {sample.branch_index}: no teacher log-probabilities")
    student = sample.inference_logprobs.astype(np.float64)
    return np.where(sample.loss_mask, student - sample.teacher_logprobs.astype(np.float64), 0.0)


def dense_rewards(sample: TrainingSample, coef: float) -> np.ndarray:
    """[T] float64: r_t = -coef * k_t on action tokens, 0 elsewhere."""
    return -coef * reverse_kl(sample)


BASELINES = ("none", "batch_mean", "group_mean")


def baselines(groups: list[list[TrainingSample]], baseline: str = "none") -> list[float]:
    """One b per group, subtracted from k_t in mode advantage's term: 0 ("none"), the mean of k_t
    over all the groups' action tokens ("batch_mean", the same b for every group) or over the
    group's own ("group_mean"; 0 for a group without action tokens)."""
    if baseline not in BASELINES:
        raise ValueError(f"distillation.baseline {baseline!r}: one of {', '.join(BASELINES)}")
    if baseline == "none":
        return [0.0] * len(groups)
    sums = [sum(float(reverse_kl(s)[s.loss_mask].sum()) for s in group) for group in groups]
    counts = [sum(int(s.loss_mask.sum()) for s in group) for group in groups]
    if baseline == "batch_mean":
        b = sum(sums) / sum(counts) if sum(counts) else 0.0
        return [b] * len(groups)
    return [total / count if count else 0.0 for total, count in zip(sums, counts)]


def by_group(samples: list[TrainingSample]) -> list[list[TrainingSample]]:
    """The step's samples as groups (by group_id, in order of first appearance)."""
    groups: dict[int, list[TrainingSample]] = {}
    for sample in samples:
        groups.setdefault(sample.group_id, []).append(sample)
    return list(groups.values())


def distillation_metrics(samples: list[TrainingSample], coef: float, mode: str = "reward", baseline: str = "none") -> dict:
    """`teacher_kl_mean` (k_t over the step's action tokens), `teacher_kl_per_sample` (sum_t k_t,
    mean over samples), `distill_reward_mean` (sum_t r_t, mean over samples) and
    `distill_reward_share` (sum |sum_t r_t| / (sum |sum_t r_t| + sum |task reward|) over samples);
    under `mode` "advantage" also `distill_advantage_mean` (the term added to each action token's
    advantage, -coef * (k_t - b), mean over the step's action tokens) and `distill_advantage_share`
    (sum |term| / (sum |term| + sum |A_t - term|) over the action tokens: the teacher's part of the
    advantages beside the estimator's, read from the samples' `advantages`); with a `baseline`
    also `distill_baseline` (b: the step's, or under "group_mean" the mean of the groups' b) and
    under "group_mean" `distill_baseline_std` (their spread over the groups); with the teacher's
    top k (mode "top_k_kl") `teacher_top_k_mass`: the probability the teacher's top k hold, mean
    over the step's action tokens."""
    scored = [s for s in samples if s.teacher_logprobs is not None]
    if not scored:
        return {}
    kl = [reverse_kl(s) for s in scored]
    tokens = np.concatenate([k[s.loss_mask] for k, s in zip(kl, scored)])
    per_sample = np.array([k.sum() for k in kl])
    dense = -coef * per_sample
    task = np.array([s.reward for s in scored], dtype=np.float64)
    total = np.abs(dense).sum() + np.abs(task).sum()
    record = {
        "teacher_kl_mean": float(tokens.mean()) if tokens.size else None,
        "teacher_kl_per_sample": float(per_sample.mean()),
        "distill_reward_mean": float(dense.mean()),
        "distill_reward_share": float(np.abs(dense).sum() / total) if total > 0 else None,
    }
    tops = [s for s in scored if s.teacher_top_logprobs is not None]
    if tops:
        mass = np.concatenate([np.exp(s.teacher_top_logprobs[s.loss_mask].astype(np.float64)).sum(-1) for s in tops])
        record["teacher_top_k_mass"] = float(mass.mean()) if mass.size else None
    if mode == "advantage" and tokens.size and all(s.advantages is not None for s in scored):
        groups = by_group(scored)
        values = baselines(groups, baseline)
        b = {id(s): value for group, value in zip(groups, values) for s in group}
        teacher = np.concatenate([-coef * (k[s.loss_mask] - b[id(s)]) for k, s in zip(kl, scored)])
        estimator = np.concatenate([s.advantages[s.loss_mask].astype(np.float64) for s in scored]) - teacher
        both = np.abs(teacher).sum() + np.abs(estimator).sum()
        record["distill_advantage_mean"] = float(teacher.mean())
        record["distill_advantage_share"] = float(np.abs(teacher).sum() / both) if both > 0 else None
        if baseline != "none":
            record["distill_baseline"] = float(np.mean(values))
        if baseline == "group_mean":
            record["distill_baseline_std"] = float(np.std(values))
    return record


class Distillation:
    """The teacher and the signal's weight, as the algorithm uses them (`algorithms/base.py`):
    `rewards` (mode "reward": the dense reward beside the task's) and `token_advantages` (mode
    "advantage": the term added to each action token's advantage after the estimator). Under
    "kl_penalty" both are zero: the samples are scored (the policy's grid carries the teacher's
    log-probabilities to its loss) and the rewards are the task's alone; so under "top_k_kl"
    (the grid carries the teacher's top k, `top_k` of them). `baseline` (mode
    "advantage" only): what `baselines` subtracts from k_t in the advantage's term."""

    def __init__(self, teacher: TeacherScorer, coef: float, mode: str = "reward", baseline: str = "none",
                 top_k: int = 0):  # fmt: skip
        if mode == "top_k_kl" and top_k < 1:
            raise ValueError(f"distillation.mode 'top_k_kl' needs distillation.top_k >= 1, not {top_k}")
        if baseline not in BASELINES:
            raise ValueError(f"distillation.baseline {baseline!r}: one of {', '.join(BASELINES)}")
        if baseline != "none" and mode != "advantage":
            raise ValueError(f"distillation.baseline {baseline!r} is for distillation.mode 'advantage', not {mode!r}")
        self.teacher, self.coef, self.mode, self.baseline, self.top_k = teacher, coef, mode, baseline, top_k

    async def score(self, samples: list[TrainingSample]) -> None:
        """The teacher's log-probabilities of every sample's tokens, into `teacher_logprobs`;
        under mode "top_k_kl" also each position's top k (`set_teacher_top_k`), in the same reply."""
        if not samples:
            return
        sequences = [s.token_ids.tolist() for s in samples]
        if self.mode == "top_k_kl":
            set_teacher_top_k(samples, await self.teacher.top_k(sequences, self.top_k), self.top_k)
        else:
            set_teacher_logprobs(samples, await self.teacher.logprobs(sequences))

    def rewards(self, sample: TrainingSample) -> np.ndarray:
        """[T] float64: the dense reward the estimator takes beside the task's (0 unless mode "reward")."""
        if self.mode != "reward":
            return np.zeros(len(sample))
        return dense_rewards(sample, self.coef)

    def token_advantages(self, sample: TrainingSample, baseline: float = 0.0) -> np.ndarray:
        """[T] float64: what each token's advantage gains after the estimator, -coef * (k_t -
        baseline) on action tokens (0 elsewhere, and everywhere unless mode "advantage")."""
        if self.mode != "advantage":
            return np.zeros(len(sample))
        return np.where(sample.loss_mask, -self.coef * (reverse_kl(sample) - baseline), 0.0)
