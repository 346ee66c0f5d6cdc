"""`megatron-rl orchestrate --config RESOLVED.json`: the orchestrator process, built from the
resolved config with the real collaborators:

- the inference pool: started here (`--start-inference`, on the devices given) or attached to
  servers already running at `inference.host` : the layout's inference ports, behind the router
  at `inference.router_port`;
- `VersionFollower`: keeps the servers on the newest policy version. Path (a): watches
  `inference.publish_dir` and loads each new complete version with WeightSync (pause keep ->
  load -> reset -> resume; `inference.update_mode: interrupt` ends the requests in flight instead,
  and the rollout client resumes them: partial rollouts); path (b): the policy broadcasts, and
  the follower asks the servers which version they run;
- `CriticLink`: the critic's HTTP service (`HttpValueScorer`: one `/score` per group, `/status`
  polled until the step is trained) and its ZMQ GridSender;
- the policy's GridSender;
- with `distillation`, the teacher (teacher/client.py `make_teacher`: `VllmTeacher` at
  `distillation.teacher.url`, or, for a teacher the run serves, at its router:
  `layout.services["teacher"].url`; `MegatronTeacher` at the Megatron teacher's service with
  `distillation.teacher.megatron`), its tokenizer checked to be the student's before anything
  starts;
- with `orchestrator.judge`, the judge at its `url` or, served by the run, at its router
  (`layout.services["judge"].url`): the training reward's (unless judge.train is false) and the
  judged evaluation sets'.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

from megatron_rl.config import ResolvedConfig
from megatron_rl.critic.client import HttpValueScorer
from megatron_rl.envs import make_environment
from megatron_rl.envs.judge import Judge, JudgedEnvironment
from megatron_rl.inference.pool import InferencePool, WeightSync, adapter_rank, served_model_dir
from megatron_rl.inference.rollout import RolloutClient
from megatron_rl.inference.router import VllmRouter
from megatron_rl.inference.teacher import check_same_tokenizer
from megatron_rl.inference.vllm_control import VllmControl
from megatron_rl.orchestrator.chat import PromptEncoder
from megatron_rl.orchestrator.loop import Orchestrator, OrchestratorError, Timeouts
from megatron_rl.orchestrator.metrics import MetricsWriter
from megatron_rl.orchestrator.state import OrchestratorState
from megatron_rl.orchestrator.tracking import Tracker
from megatron_rl.teacher.client import make_teacher
from megatron_rl.trainer import atomic_dir
from megatron_rl.trainer.atomic_dir import latest
from megatron_rl.trainer.resume import run_resume_step
from megatron_rl.transport import GridSender

log = logging.getLogger(__name__)


class VersionFollower:
    """The policy version live on the inference servers, moved forward as the policy publishes."""

    def __init__(self, sync: WeightSync, publish_dir: str | None, poll_s: float = 0.1):
        self.sync, self.publish_dir, self.poll_s = sync, publish_dir, poll_s
        self.error: BaseException | None = None
        self.sync_seconds: list[float] = []
        self._task = None

    def version(self) -> int:
        return self.sync.version

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._follow())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _follow(self) -> None:
        try:
            while True:
                if self.publish_dir is not None:  # path (a)
                    newest = latest(Path(self.publish_dir), "manifest.json")
                    if newest is not None:
                        version = atomic_dir.number(newest.name)
                        if version > self.sync.version:
                            self.sync_seconds.append(
                                await asyncio.to_thread(self.sync.update, version, newest)
                            )
                else:  # path (b): the policy installs; learn the version from the servers
                    await asyncio.to_thread(self.sync.refresh)
                # path (b) asks every server over HTTP: once a second, not at the file-poll rate
                await asyncio.sleep(self.poll_s if self.publish_dir is not None else max(self.poll_s, 1.0))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # surfaced by wait_for
            self.error = exc

    async def wait_for(self, version: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self.sync.version < version:
            if self.error is not None:
                raise OrchestratorError(f"weight sync failed: {self.error}") from self.error
            if time.monotonic() > deadline:
                where = self.publish_dir or "the inference servers (path (b))"
                raise OrchestratorError(
                    f"policy version {version} did not go live within {timeout_s:.0f}s (live: {self.sync.version}; "
                    f"watching {where}): is the policy trainer running?"
                )
            await asyncio.sleep(0.02)


class CriticLink:
    def __init__(self, resolved: ResolvedConfig, timeout_s: float):
        service, layout = resolved.value.service, resolved.layout.critic
        self.url = f"http://{service.host}:{service.port}"
        self.scorer = HttpValueScorer(
            self.url, timeout_s=timeout_s, token=service.token()
        )
        self.sender = GridSender(resolved.transport.host, resolved.transport.critic_port, layout.dp,
                                 receivers_per_data_rank=layout.tp * layout.cp * layout.pp, name="critic")  # fmt: skip
        self.timeout_s = timeout_s

    async def send(self, step: int, grid) -> None:
        await asyncio.to_thread(self.sender.publish, step, grid, self.timeout_s)

    async def wait_trained(self, step: int, timeout_s: float) -> dict:
        return await self.scorer.wait_trained(step, timeout_s=timeout_s)

    async def close(self) -> None:
        await self.scorer.close()
        self.sender.close()


def attach_pool(resolved: ResolvedConfig) -> InferencePool:
    """The running servers (`layout.inference_urls`) and router (`inference.host`:`router_port`)
    of `resolved.inference`, started by the launcher."""
    inference = resolved.inference
    api_key = inference.api_key()
    controls = [VllmControl(url, api_key=api_key) for url in resolved.layout.inference_urls]
    router = VllmRouter.attach(f"http://{inference.host}:{inference.router_port}", api_key=api_key)
    return InferencePool.attach(controls, router, inference.served_model_name)


async def orchestrate(resolved: ResolvedConfig, pool: InferencePool, tokenizer=None) -> int:
    """Runs the configured steps against `pool`; returns the number of steps run."""
    from megatron_rl.models.tokenizer import load_tokenizer

    o, layout = resolved.orchestrator, resolved.layout
    # First: a tracker whose package is missing is an error before anything starts.
    tracker = Tracker.from_config(resolved)  # None: no logging.wandb / logging.tensorboard
    remote_code = resolved.model.trust_remote_code
    tokenizer = tokenizer or load_tokenizer(served_model_dir(resolved), remote_code)
    encoder = prompt_encoder(o, tokenizer)
    timeouts = Timeouts(batch_s=resolved.inference.request_timeout_s, critic_s=resolved.transport.receive_timeout_s,
                        weights_s=resolved.transport.receive_timeout_s)  # fmt: skip
    state = OrchestratorState(Path(resolved.layout.paths.orchestrator_state), o.seed)
    resume_step = trainer_resume_step(resolved)
    if resume_step < state.step:
        state.resume_at(resume_step)
    publish_dir = (
        resolved.inference.publish_dir if resolved.inference.weight_update == "safetensors" else None
    )
    # A LoRA policy served as adapters: after version 0 (the base), requests name the adapter.
    pool.sync.adapter_versions = adapter_rank(resolved.layout) is not None
    pool.sync.update_mode = resolved.inference.update_mode  # requests in flight at an update: held or resumed
    follower = VersionFollower(pool.sync, publish_dir)
    if publish_dir is None:
        pool.sync.refresh()
    critic = CriticLink(resolved, timeouts.critic_s) if resolved.value is not None else None
    policy_sender = GridSender(resolved.transport.host, resolved.transport.policy_port, layout.policy.dp,
                               receivers_per_data_rank=layout.policy.tp * layout.policy.cp * layout.policy.pp,
                               name="policy")  # fmt: skip

    async def send_policy(step, grid):
        await asyncio.to_thread(policy_sender.publish, step, grid, timeouts.weights_s)

    metrics = MetricsWriter(resolved.logging.dir, resolved.logging.console, o.num_steps, tracker=tracker)
    client = RolloutClient(pool.router_url, pool.model_name, pool.worker_urls,
                           timeout_s=resolved.inference.request_timeout_s, version_source=follower.version,
                           model_source=lambda: pool.sync.model_for(pool.model_name),
                           update_in_progress=lambda: pool.sync.updating,
                           interrupting=lambda: pool.sync.update_mode == "interrupt",
                           api_key=resolved.inference.api_key(),
                           on_worker_failure=lambda url: log.warning("inference server %s failed a request", url))  # fmt: skip
    environment = make_environment(o.environment, o.dataset, o.seed, args=o.environment_args)
    judge = Judge(o.judge, url=service_url(resolved, "judge")) if o.judge is not None else None
    if judge is not None and o.judge.train:  # the verdict is the reward (orchestrator.judge)
        environment = JudgedEnvironment(environment, judge)
    encoder.check_environment(environment)
    teacher = None
    if resolved.distillation is not None:  # the same token ids, then a teacher that answers
        settings = resolved.distillation.teacher
        check_same_tokenizer(tokenizer, load_tokenizer(settings.model_dir, remote_code), settings.model_dir)
        teacher = make_teacher(resolved, service_url(resolved, "teacher"))
    orchestrator = Orchestrator(resolved, environment, encoder, client, follower, critic, send_policy, state, metrics,
                                timeouts, teacher=teacher, judge=judge)  # fmt: skip
    follower.start()
    finished = False
    try:
        if teacher is not None:
            await teacher.check_ready()
        if critic is not None:
            await critic.scorer.wait_ready(timeout_s=timeouts.critic_s)
        ran = await orchestrator.run()
        # The last version goes live before we report done (the next run starts from it).
        await follower.wait_for(o.num_steps, timeouts.weights_s)
        finished = True
        return ran
    finally:
        follower.stop()
        if tracker is not None:  # after a full run: the trainers' last metrics lines first
            await asyncio.to_thread(tracker.close, o.num_steps - 1 if finished else None)
        await client.close()
        await environment.aclose()
        if orchestrator.evaluator is not None:
            await orchestrator.evaluator.aclose()
        if judge is not None:
            await judge.close()
        if teacher is not None:
            await teacher.close()
        if critic is not None:
            await critic.close()
        await asyncio.to_thread(policy_sender.close)


def service_url(resolved: ResolvedConfig, name: str) -> str | None:
    """The router URL of a model the run serves (teacher, judge), as the launcher started it;
    None when the user serves it (its section's url)."""
    service = resolved.layout.services.get(name)
    return service.url if service is not None else None


def prompt_encoder(o, tokenizer) -> PromptEncoder:
    """The rollouts' encoder from `orchestrator.chat_template`, `chat_template_kwargs` and
    `reasoning_markers` (a template file is read once, here)."""
    template = Path(o.chat_template).read_text() if isinstance(o.chat_template, str) else None
    return PromptEncoder(tokenizer, o.chat_template is not False, template, o.chat_template_kwargs,
                         o.reasoning_markers)  # fmt: skip


def trainer_resume_step(resolved: ResolvedConfig) -> int:
    """The step the trainers resume at: one past the step every role has checkpointed."""

    if not resolved.checkpoint.resume:
        return 0
    common = run_resume_step(resolved)
    return 0 if common is None else common + 1
