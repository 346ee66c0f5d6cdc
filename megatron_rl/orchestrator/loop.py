"""The orchestrator's step loop: one training step of docs/concepts/data-flow.md (steps 1 to 7).

For step n: the dispatcher hands over `batch_size` admitted groups (in dataset order, or the
first to finish under `orchestrator.batch_order: finish`), or fewer at the
`orchestrator.dynamic_sampling` bound with on_limit "train" (generation of later batches goes on
meanwhile, within the lead gate; the sink has added any overlong penalty to the rewards) ->
`prepare_batch` over the step's groups (gae: one `/score` request per group with every branch,
skip-observation GAE; outcome estimators: the step's rewards, no critic) -> pack
twice (critic layout; policy layout, split into `algorithm.policy_minibatches` mini-batches seeded
by (orchestrator.seed, n), each its own balanced grid; both padded for the layout's sequence
parallel; where both packings are the same, one grid serves both) -> critic grid -> wait until the critic's `/status` says step n trained -> policy grid
-> the next step (the weights follower moves the inference
servers to each version the policy publishes; the lead gate waits for it). After
`max_empty_steps` consecutive steps with no admitted group the run stops saying why. Every
wait has a timeout whose error names what it waited for.

The collaborators are small protocols, so tests drive the loop with in-process fakes:
`weights` (`version()`, `wait_for(version, timeout_s)`), `critic` (`scorer`, `wait_trained(step,
timeout_s)`, `send(step, grid)`), `send_policy(step, grid)`, and with `distillation` a
`teacher` (`logprobs(token_ids)`, algorithms/distillation.TeacherScorer); the loop keeps no
sample past its step. The step's time split is read from
the event loop's clock (monotonic time; a simulated cluster's virtual clock,
megatron_rl/sim/cluster.py, gives simulated seconds).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from dataclasses import dataclass

from megatron_rl.algorithms import make_algorithm
from megatron_rl.algorithms.distillation import Distillation
from megatron_rl.config import ResolvedConfig
from megatron_rl.data.packing import pack_into_grid, pack_minibatches
from megatron_rl.inference.rollout import SamplingParams
from megatron_rl.orchestrator.chat import PromptEncoder
from megatron_rl.orchestrator.dispatcher import Dispatcher
from megatron_rl.orchestrator.evaluation import Evaluator
from megatron_rl.orchestrator.metrics import step_metrics
from megatron_rl.orchestrator.rollouts import run_group
from megatron_rl.orchestrator.sink import TrainSink
from megatron_rl.orchestrator.state import OrchestratorState

log = logging.getLogger(__name__)


class OrchestratorError(RuntimeError):
    pass


@dataclass
class Timeouts:
    batch_s: float = 3600.0  # generating one batch
    critic_s: float = 3600.0  # the critic training a step
    weights_s: float = 3600.0  # a new policy version going live


class Orchestrator:
    def __init__(self, resolved: ResolvedConfig, env, encoder: PromptEncoder, client, weights, critic,
                 send_policy, state: OrchestratorState, record_metrics, timeouts: Timeouts | None = None,
                 teacher=None, judge=None):  # fmt: skip
        self.resolved = resolved
        self.env, self.encoder, self.client = env, encoder, client
        self.weights, self.critic, self.send_policy = weights, critic, send_policy
        self.state = state
        self.record_metrics = record_metrics
        self.timeouts = timeouts or Timeouts()
        o = resolved.orchestrator
        # An advantage that reads values without a critic: make_algorithm refuses it, naming the key.
        distillation = None
        if resolved.distillation is not None:
            if teacher is None:
                raise OrchestratorError("distillation is configured but the orchestrator was given no teacher")
            d = resolved.distillation
            distillation = Distillation(teacher, d.coef, d.mode, d.baseline, d.top_k)
        # What of the teacher's the policy's loss reads from its grid: its log-probabilities
        # (kl_penalty) or its top k (top_k_kl).
        mode = distillation.mode if distillation is not None else None
        self.teacher_in_grid, self.teacher_top_k_in_grid = mode == "kl_penalty", mode == "top_k_kl"
        self.algorithm = make_algorithm(resolved.algorithm, critic.scorer if critic is not None else None, distillation)
        self.sink = TrainSink(o.admission, o.overlong, o.max_completion_tokens)
        self.one_packing = self._policy_packs_like_the_critic()

        replay = resolved.layout.sampler_routes  # the samples carry the sampler's routes
        self.sampling = SamplingParams.from_config(o, resolved.layout.policy_architecture.num_experts if replay else 0)
        self.evaluator = (
            Evaluator(o.eval, client, encoder, o.max_completion_tokens, o.seed, judge=judge) if o.eval else None
        )
        self.dispatcher = Dispatcher(
            self._start_group, self.sink.judge, o.batch_size, o.max_async_level, o.max_off_policy_steps,
            weights.version, next_group_id=state.group_for_step(state.step), shipped_batches=state.step,
            dynamic_sampling=o.dynamic_sampling, batch_order=o.batch_order, oversample=o.oversample,
            consumed_ahead=state.consumed_for_step(state.step),
        )  # fmt: skip

    def _policy_packs_like_the_critic(self) -> bool:
        """True when the policy's packing would equal the critic's: one mini-batch and the same
        seq_len, DP, CP and sequence-parallel sizes (packing is deterministic), so the critic
        grid is sent to the policy too instead of packing (copying) every token a second time."""
        r = self.resolved
        teacher_in_loss = r.distillation is not None and r.distillation.mode in ("kl_penalty", "top_k_kl")
        if r.value is None or r.algorithm.policy_minibatches != 1 or r.layout.sampler_routes or teacher_in_loss:
            return False  # (the critic's grid never carries routes or the teacher's scores)
        critic, policy = r.layout.critic, r.layout.policy
        same_layout = (critic.dp, critic.cp, critic.sp) == (policy.dp, policy.cp, policy.sp)
        return same_layout and r.value.model.seq_len == r.model.seq_len

    async def _start_group(self, group_id: int, row_index: int):
        o = self.resolved.orchestrator
        return await run_group(self.env, self.env.row(row_index), group_id, o.group_size, self.client,
                               self.encoder, self.sampling, o.max_completion_tokens)  # fmt: skip

    async def run(self) -> int:
        """Runs the remaining steps; returns the number of steps run."""
        o = self.resolved.orchestrator
        empty_steps, ran, rejected = 0, 0, Counter()
        follower = asyncio.ensure_future(self._follow_versions())
        try:
            for step in range(self.state.step, o.num_steps):
                record = await self.run_step(step)
                ran += 1
                empty = record["groups_admitted"] == 0
                empty_steps = empty_steps + 1 if empty else 0
                rejected = rejected + Counter(record["groups_rejected"]) if empty else Counter()
                if empty_steps >= o.max_empty_steps:
                    raise OrchestratorError(
                        f"stopping: {empty_steps} consecutive steps admitted no group "
                        f"(rejected by rule: {dict(rejected)}; check orchestrator.admission)"
                    )
        finally:
            follower.cancel()
            self.dispatcher.cancel()
        return ran

    async def _follow_versions(self) -> None:
        last = self.weights.version()
        while True:
            await asyncio.sleep(0.05)
            if self.weights.version() != last:
                last = self.weights.version()
                self.dispatcher.notify()

    async def run_step(self, step: int) -> dict:
        o, times = self.resolved.orchestrator, {}
        clock = asyncio.get_running_loop().time
        began = clock()
        # The lead gate: batch n ships only once version >= n - max_async_level is live.
        await self.weights.wait_for(step - o.max_async_level, self.timeouts.weights_s)
        times["wait_weights"] = clock() - began
        evaluation = {}
        if self.evaluator is not None and self.evaluator.due(step):
            mark = clock()
            evaluation = await self.evaluator.run(step)
            times["eval"] = clock() - mark
        mark = clock()
        first_group = self.dispatcher.next_to_ship
        batch = await self.dispatcher.next_batch(step, self.timeouts.batch_s)
        times["generate"] = clock() - mark
        samples = [s for _, group_samples in batch for s in group_samples]
        mark = clock()
        await self.algorithm.prepare_batch([group_samples for _, group_samples in batch], step)
        times["score"] = clock() - mark
        layout = self.resolved.layout
        critic_grid = None
        if self.critic is not None:
            mark = clock()
            critic_grid = pack_into_grid(samples, self.resolved.value.model.seq_len, layout.critic.dp,
                                         layout.critic.cp, sequence_parallel_size=layout.critic.sp)  # fmt: skip
            await self.critic.send(step, critic_grid)
            status = await self.critic.wait_trained(step, self.timeouts.critic_s)
            times["critic_train"] = clock() - mark
        else:
            status = None
        mark = clock()
        if critic_grid is not None and self.one_packing:  # the same packing: do not pack (copy) twice
            policy_grid = critic_grid
        else:
            policy_grid = pack_minibatches(samples, self.resolved.algorithm.policy_minibatches, (o.seed, step),
                                           self.resolved.model.seq_len, layout.policy.dp, layout.policy.cp,
                                           layout.policy.sp, routes=self.resolved.layout.sampler_routes,
                                           teacher=self.teacher_in_grid,
                                           teacher_top_k=self.teacher_top_k_in_grid)  # fmt: skip
        await self.send_policy(step, policy_grid)
        times["policy_send"] = clock() - mark
        sync_seconds = getattr(self.weights, "sync_seconds", None)
        if sync_seconds:  # the newest path (a) weight sync (pause, load, reset, resume)
            times["weight_sync"] = sync_seconds[-1]
        times["total"] = clock() - began
        self.state.advance(step, first_group, self.dispatcher.next_to_ship, self.dispatcher.consumed_ahead)
        record = step_metrics(
            step, batch, samples, self.dispatcher.last_counts, self.dispatcher, times, status,
            live_version=self.weights.version(), batch_size=o.batch_size, overlong=o.overlong,
            distillation=self.algorithm.distillation,
        )  # fmt: skip
        record.update(evaluation)
        self.record_metrics(record)
        return record
