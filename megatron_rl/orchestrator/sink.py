"""TrainSink: which completed groups become training samples (`orchestrator.admission`), and
their reward shaping (`orchestrator.overlong`).

Failed and cancelled members are dropped (and counted); `drop_truncated` drops members that
ended without EOS; `min_completion_tokens` drops members with fewer completion tokens;
`reject_identical_rewards` rejects a group of two or more members whose rewards are all equal
(GRPO: no signal; with a length penalty the shaped rewards are compared, since those are what
the advantages see). A group left with no member is rejected. Each admitted member becomes one
`TrainingSample`, in original branch order, with prompt and observation tokens masked.

`judge` gives the verdict (samples, the rejection rule, the members dropped by reason) so the
dispatcher can count each group in the step that consumes it; `counters` are run totals.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from megatron_rl.config import AdmissionConfig, OverlongConfig
from megatron_rl.data.types import TrainingSample
from megatron_rl.orchestrator.rollouts import Group


@dataclass
class SinkCounters:
    """Run totals (each step's own counts are the dispatcher's StepCounts)."""

    admitted_groups: int = 0
    rejected_groups: Counter = field(default_factory=Counter)  # by rule
    dropped_members: Counter = field(default_factory=Counter)  # by reason


@dataclass
class Verdict:
    """One group's admission: its samples (None: rejected, by `rule`) and its dropped members."""

    samples: list[TrainingSample] | None
    rule: str | None = None
    dropped: Counter = field(default_factory=Counter)


def overlong_penalty(completion_tokens: int, max_completion_tokens: int, buffer_tokens: int,
                     penalty_factor: float) -> float:  # fmt: skip
    """DAPO's soft overlong punishment: 0 up to `max - buffer` completion tokens, then
    (max - buffer - L) / buffer * factor, reaching -factor at `max` (verl's overlong_buffer:
    `min(-(L - (max - buffer)) / buffer * factor, 0)`). L counts action tokens only: in a
    multi-turn rollout the budget also holds the observations, which verl's response length
    would count."""
    exceed = completion_tokens - (max_completion_tokens - buffer_tokens)
    return -exceed / buffer_tokens * penalty_factor if exceed > 0 else 0.0


class TrainSink:
    def __init__(
        self,
        admission: AdmissionConfig,
        overlong: OverlongConfig | None = None,
        max_completion_tokens: int | None = None,
    ):
        """`overlong` (an OverlongConfig or None) needs `max_completion_tokens`, the budget L_max."""
        if overlong is not None and max_completion_tokens is None:
            raise ValueError("orchestrator.overlong needs orchestrator.max_completion_tokens")
        self.admission, self.overlong, self.max_completion_tokens = admission, overlong, max_completion_tokens
        self.counters = SinkCounters()

    def admit(self, group: Group) -> list[TrainingSample] | None:
        """The group's training samples, or None when the group is rejected."""
        return self.judge(group).samples

    def _reward(self, member) -> float:
        o = self.overlong
        if o is None or o.mode != "penalty":
            return float(member.reward)
        penalty = overlong_penalty(member.num_completion_tokens, self.max_completion_tokens, o.buffer_tokens,
                                   o.penalty_factor)  # fmt: skip
        return float(member.reward) + penalty

    def judge(self, group: Group) -> Verdict:
        """The group's verdict; counted in the run totals."""
        rules, kept, dropped = self.admission, [], Counter()
        for member in group.members:
            if member.status != "finished":
                dropped[member.status] += 1
            elif rules.drop_truncated and member.truncated:
                dropped["truncated"] += 1
            elif member.num_completion_tokens < rules.min_completion_tokens:
                dropped["min_completion_tokens"] += 1
            else:
                kept.append(member)
        self.counters.dropped_members.update(dropped)
        rewards = [self._reward(m) for m in kept]
        rule = None
        if not kept:
            rule = "no_member_left"
        elif rules.reject_identical_rewards and len(kept) > 1 and len(set(rewards)) == 1:
            rule = "identical_rewards"
        if rule is not None:
            self.counters.rejected_groups[rule] += 1
            return Verdict(None, rule, dropped)
        self.counters.admitted_groups += 1
        masking = self.overlong is not None and self.overlong.mode == "mask"
        samples = [
            TrainingSample(
                token_ids=np.asarray(m.trajectory.token_ids, dtype=np.int64),
                loss_mask=np.asarray(m.trajectory.loss_mask, dtype=bool) & (not (masking and m.truncated)),
                inference_logprobs=np.asarray(m.trajectory.logprobs, dtype=np.float32),
                reward=reward,
                truncated=m.truncated,
                episode_done=m.episode_done,
                group_id=group.group_id,
                branch_index=m.branch_index,
                policy_version=m.trajectory.policy_version,
                score=float(m.reward),
                routes=m.trajectory.routes(),
                token_versions=m.trajectory.versions(),
            )
            for m, reward in zip(kept, rewards)
        ]
        return Verdict(samples, None, dropped)
