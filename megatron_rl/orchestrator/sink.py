"""TrainSink: which completed groups become training samples (`orchestrator.admission`).

Failed and cancelled members are dropped (and counted); `drop_truncated` drops members that
ended without EOS; `min_completion_tokens` drops members with fewer completion tokens;
`reject_identical_rewards` rejects a group of two or more members whose rewards are all equal
(GRPO: no signal). A group left with no member is rejected. Each admitted member becomes one
`TrainingSample`, in original branch order, with prompt and observation tokens masked.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from megatron_rl.data.types import TrainingSample
from megatron_rl.orchestrator.rollouts import Group


@dataclass
class SinkCounters:
    admitted_groups: int = 0
    rejected_groups: Counter = field(default_factory=Counter)  # by rule
    dropped_members: Counter = field(default_factory=Counter)  # by reason

    def reset(self) -> None:
        self.admitted_groups = 0
        self.rejected_groups.clear()
        self.dropped_members.clear()


class TrainSink:
    def __init__(self, admission):
        self.admission = admission
        self.counters = SinkCounters()

    def admit(self, group: Group) -> list[TrainingSample] | None:
        """The group's training samples, or None when the group is rejected."""
        rules, kept = self.admission, []
        for member in group.members:
            if member.status != "finished":
                self.counters.dropped_members[member.status] += 1
            elif rules.drop_truncated and member.truncated:
                self.counters.dropped_members["truncated"] += 1
            elif member.num_completion_tokens < rules.min_completion_tokens:
                self.counters.dropped_members["min_completion_tokens"] += 1
            else:
                kept.append(member)
        if not kept:
            self.counters.rejected_groups["no_member_left"] += 1
            return None
        if rules.reject_identical_rewards and len(kept) > 1 and len({m.reward for m in kept}) == 1:
            self.counters.rejected_groups["identical_rewards"] += 1
            return None
        self.counters.admitted_groups += 1
        return [
            TrainingSample(
                token_ids=np.asarray(m.trajectory.token_ids, dtype=np.int64),
                loss_mask=np.asarray(m.trajectory.loss_mask, dtype=bool),
                inference_logprobs=np.asarray(m.trajectory.logprobs, dtype=np.float32),
                reward=float(m.reward),
                truncated=m.truncated,
                episode_done=m.episode_done,
                group_id=group.group_id,
                branch_index=m.branch_index,
                policy_version=m.trajectory.policy_version,
            )
            for m in kept
        ]
