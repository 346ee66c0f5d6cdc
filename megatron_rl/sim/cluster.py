"""A simulated cluster: the REAL orchestrator against stand-ins that spend simulated time.

What runs for real, unchanged: `Orchestrator` (dispatcher, TrainSink, rollouts of each group,
`prepare_batch` with the critic's `HttpValueScorer` — one `/score` per group, a JSON request and a float32 reply, encoded and
decoded by the client — both packings, both ZMQ `GridSender`s with real `GridReceiver`s on
loopback that decode and checksum every grid item, `VersionFollower`'s path (b) bookkeeping, the
`MetricsWriter` JSONL and the `OrchestratorState` checkpoint after every step).

The stand-ins (timing models in megatron_rl/sim/models.py):

- **inference** (the rollout client's place, megatron_rl/sim/inference.py): the router's session
  hash picks a server; each server runs at most `concurrency_per_server` requests (the rest
  queue, in order); a request takes prompt / prefill rate + completion / decode rate, its
  completion length drawn from a lognormal (seeded by the request's seed) cut at the token
  budget (finish "length"); a weight broadcast pauses every server and does to the requests in
  flight what `inference.update_mode` says (keep: preempted, re-prefilled after it; interrupt:
  ended with their tokens so far and resumed as partial rollouts);
- **critic** (behind an in-process httpx transport: `/score`, `/status`, `/health`): a score
  request takes a fixed overhead plus its forward FLOPs; a training step (after its grid
  arrived over ZMQ) its training FLOPs, times a per-step spread; both share the critic's GPUs;
- **policy**: receives the policy grid over ZMQ, trains its FLOPs, broadcasts (the servers
  pause) and the version goes live.

Time: the whole run is one asyncio loop on a virtual clock (megatron_rl/sim/virtual_clock.py):
simulated seconds pass only in sleeps, so minutes of a step run in milliseconds, and code that
spends CPU spends no simulated time (a grid's time on the wire is modelled: bytes /
`wire_bytes_per_s`). Same seed, same events at the same simulated times.

CPU: `orchestrator_cpu_s` is the process CPU time of the run minus what the stand-ins spent
(each stand-in's code is timed with its thread's CPU clock, the ZMQ receiver threads whole), so
it is the orchestrator's own work: rollout bookkeeping, admission, score-request encoding and
reply decoding, GAE, packing, grid encoding and sending, polling, metrics and checkpoints.
"""

from __future__ import annotations

import asyncio
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import msgspec
import numpy as np

from megatron_rl.config import ResolvedConfig, load_config, parse_config
from megatron_rl.critic.client import HttpValueScorer
from megatron_rl.critic.wire import BINARY_VALUES, STEP_HEADER
from megatron_rl.orchestrator.chat import PromptEncoder
from megatron_rl.orchestrator.loop import Orchestrator, Timeouts
from megatron_rl.orchestrator.metrics import MetricsWriter
from megatron_rl.orchestrator.run import VersionFollower
from megatron_rl.orchestrator.state import OrchestratorState
from megatron_rl.sim.inference import SimInference
from megatron_rl.sim.models import (
    ClusterModel,
    SimEnvironment,
    SimTokenizer,
    forward_flops,
    group_of,
    seed_flops_per_gpu_s,
    spread,
    training_passes,
)
from megatron_rl.sim.transport import GridLink
from megatron_rl.sim.virtual_clock import run_virtual


class CpuLedger:
    """CPU seconds the stand-ins spent, from any thread (`with ledger:` times a block on the
    calling thread's CPU clock)."""

    def __init__(self):
        self.seconds, self._lock, self._local = 0.0, threading.Lock(), threading.local()

    def add(self, seconds: float) -> None:
        with self._lock:
            self.seconds += seconds

    def __enter__(self):
        self._local.began = time.thread_time()

    def __exit__(self, *exc):
        self.add(time.thread_time() - self._local.began)


def _now() -> float:
    return asyncio.get_running_loop().time()


class _ScoreBody(msgspec.Struct):
    batched_token_ids: list[list[int]]


class SimCritic:
    """The critic's HTTP service (an httpx transport) and trainer; one GPU group for both."""

    def __init__(self, cluster: SimCluster, resolved: ResolvedConfig):
        self.cluster, self.resolved = cluster, resolved
        value = resolved.value
        self.arch, self.gpus = value.model.architecture, resolved.layout.critic.world_size
        self.passes = training_passes(value.model, value.epochs_per_step)
        self.gpu = asyncio.Lock()
        self.trained_step = -1
        self.score_calls: list[tuple[int, int, bool]] = []  # (group, sequences, all of that group)
        self.request_bytes = self.reply_bytes = 0
        rng = np.random.default_rng(cluster.seed)
        self._floats = rng.normal(size=4096).astype("<f4").tobytes()  # reply values, repeated
        self.transport = httpx.MockTransport(self.handle)
        self.link = GridLink(cluster, "critic", resolved.layout.critic.dp, self._train)

    def _values_binary(self, lengths) -> bytes:
        total = 4 * (len(lengths) + sum(lengths))  # bootstrap values, then every sequence's values
        whole, rest = divmod(total, len(self._floats))
        return self._floats * whole + self._floats[:rest]

    async def handle(self, request: httpx.Request) -> httpx.Response:
        c = self.cluster
        if request.url.path == "/health":
            return httpx.Response(200, content=b'{"ok": true}')
        if request.url.path == "/status":
            body = {"trained_step": self.trained_step, "phase": "ready", "busy": self.gpu.locked()}
            return httpx.Response(200, content=msgspec.json.encode(body))
        if request.url.path != "/score":
            return httpx.Response(404, content=b'{"error": "no such endpoint"}')
        with c.ledger:
            body = request.content
            sequences = msgspec.json.decode(body, type=_ScoreBody).batched_token_ids
            lengths = [len(s) for s in sequences]
            group = group_of(sequences[0])
            seconds = c.model.score_overhead_s + forward_flops(self.arch, lengths, False) / (
                self.gpus * c.flops_per_gpu_s
            )
        self.score_calls.append((group, len(sequences), {group_of(s) for s in sequences} == {group}))
        c.event("score", group, len(sequences))
        async with self.gpu:
            await asyncio.sleep(seconds)
        with c.ledger:
            if BINARY_VALUES not in request.headers.get("Accept", ""):
                return httpx.Response(406, content=b'{"error": "the simulated critic answers binary replies only"}')
            reply = self._values_binary(lengths)  # what HttpValueScorer asks for
            self.request_bytes += len(body)
            self.reply_bytes += len(reply)
        headers = {"Content-Type": BINARY_VALUES, STEP_HEADER: str(self.trained_step)}
        return httpx.Response(200, content=reply, headers=headers)

    async def _train(self, step: int, items) -> None:
        c = self.cluster
        lengths = [n for item in items for n in item.sequence_lengths]
        seconds = self.passes * forward_flops(self.arch, lengths, False) / (self.gpus * c.flops_per_gpu_s)
        async with self.gpu:
            c.event("critic_train_start", step, len(lengths))
            await asyncio.sleep(seconds * spread(c.model, c.seed, "critic", step))
            self.trained_step = step
        c.event("critic_trained", step, 0)

    # -- what the orchestrator calls (run.py's CriticLink, over the stand-in) -----------------
    @property
    def scorer(self):
        return self._scorer

    def connect(self) -> None:
        self._scorer = HttpValueScorer(
            "http://sim-critic", timeout_s=1e9, retries=0, transport=self.transport
        )

    async def send(self, step: int, grid) -> None:
        self.cluster.event("critic_grid", step, len(grid[0]))
        await self.link.send(step, grid)

    async def wait_trained(self, step: int, timeout_s: float) -> dict:
        return await self._scorer.wait_trained(step, timeout_s=timeout_s)


class SimPolicy:
    """Receives the policy grid over ZMQ, trains, broadcasts; then the version is live."""

    def __init__(self, cluster: SimCluster, resolved: ResolvedConfig):
        self.cluster, self.resolved = cluster, resolved
        a = resolved.algorithm
        self.arch, self.gpus = resolved.model.architecture, resolved.layout.policy.world_size
        extra = 1 if a.old_logprobs == "recompute" else 0
        self.passes = training_passes(resolved.model, a.policy_epochs, extra)
        self.gpu = asyncio.Lock()
        self.installed = 0
        self.link = GridLink(cluster, "policy", resolved.layout.policy.dp, self._train)

    async def send(self, step: int, grid) -> None:
        self.cluster.event("policy_grid", step, len(grid[0]))
        await self.link.send(step, grid)

    async def _train(self, step: int, items) -> None:
        c = self.cluster
        lengths = [n for item in items for n in item.sequence_lengths]
        seconds = self.passes * forward_flops(self.arch, lengths, True) / (self.gpus * c.flops_per_gpu_s)
        async with self.gpu:
            c.event("policy_train_start", step, len(lengths))
            await asyncio.sleep(seconds * spread(c.model, c.seed, "policy", step))
            c.inference.pause(_now(), c.model.broadcast_s, step + 1)
            c.event("broadcast", step + 1, 0)
            await asyncio.sleep(c.model.broadcast_s)
            self.installed = max(self.installed, step + 1)
        c.event("version_live", step + 1, 0)


class SimSync:
    """VersionFollower's `sync` on path (b): the version the servers run, asked on refresh."""

    def __init__(self, policy: SimPolicy):
        self.policy, self.version = policy, 0

    def refresh(self) -> None:
        self.version = self.policy.installed


def cluster_config(
    example: str | Path, run_dir: str | Path, algorithm: dict | None = None, settings: dict | None = None,
    **orchestrator,
) -> ResolvedConfig:
    """The resolved config of `example` (a YAML, e.g. examples/configs/qwen3_30b_a3b_sao.yaml)
    with `orchestrator` keys and `algorithm` keys replaced, any other key set by its dotted path in
    `settings` (`{"model.seq_len": 32768, "inference.update_mode": "interrupt"}`), and the run's
    directories under `run_dir`. The result is validated like any config (memory plan included)."""
    data = load_config(example).model_dump(exclude={"layout"}, exclude_none=True)
    data["algorithm"].update(algorithm or {})
    unknown = sorted(
        set(orchestrator)
        - set(data["orchestrator"])
        - set(type(load_config(example).orchestrator).model_fields)
    )
    if unknown:
        raise ValueError(f"cluster_config: unknown orchestrator keys {unknown}")
    data["orchestrator"].update(orchestrator)
    for path, value in (settings or {}).items():
        *parents, key = path.split(".")
        section = data
        for name in parents:
            if not isinstance(section.get(name), dict):
                raise ValueError(f"cluster_config: settings key {path!r}: {example} has no section {name!r} there")
            section = section[name]
        section[key] = value
    data["checkpoint"]["dir"] = str(Path(run_dir) / "checkpoints")
    data["logging"]["dir"] = str(Path(run_dir) / "logs")
    return parse_config(data)


@dataclass
class SimResult:
    """What one simulated run measured (simulated seconds unless named wall or CPU)."""

    steps: int
    step_end_s: list[float]  # simulated time of each step's end
    records: list[dict]  # the orchestrator's metrics records
    events: list[tuple]  # (time, kind, a, b) in order
    # (step, group, branch, oldest, newest version stamped on its action tokens) of every sample
    shipped: list[tuple[int, int, int, int, int]]
    orchestrator_cpu_s: float
    standin_cpu_s: float
    wall_s: float
    score_calls: list[tuple[int, int, bool]] = field(default_factory=list)
    score_request_bytes: int = 0
    score_reply_bytes: int = 0
    grid_bytes: dict = field(default_factory=dict)  # model -> bytes over the run
    grid_tokens: dict = field(default_factory=dict)  # model -> packed tokens over the run (padding included)
    grid_wall_s: dict = field(default_factory=dict)  # model -> wall seconds publish -> every ack
    grid_micro_steps: dict = field(default_factory=dict)  # model -> {step: [micro-steps per data rank]}
    version_at_ship: dict = field(default_factory=dict)  # step -> version live when its policy grid went
    # Inference (megatron_rl/sim/inference.py): generating means a first prefill or decoding, not a
    # weight update's pause nor a re-prefill after one.
    server_busy: float = 0.0  # fraction of the run a server had a request generating (mean over servers)
    server_slots: float = 0.0  # fraction of the slots generating (mean over servers)
    server_busy_steady: float = 0.0  # the same between the ends of step 1 and of the last step
    server_slots_steady: float = 0.0
    server_paused_steady: float = 0.0  # fraction of that window the servers were paused for updates
    server_reprefilling: float = 0.0  # fraction of the run a server re-prefilled after an update
    updates: list = field(default_factory=list)  # the weight updates (inference.Update: start, end, version)
    reprefilled_tokens: dict = field(default_factory=dict)  # update's version -> tokens prefilled again
    wasted_groups: list[int] = field(default_factory=list)  # consumed and never trained (stale, rejected)
    wasted_tokens: int = 0  # completion tokens of wasted_groups
    unconsumed_groups: int = 0  # in flight or finished, not consumed when the last step ended
    true_version_spans: list[int] = field(default_factory=list)  # of each trained group: versions that decoded its tokens
    parts: list = field(default_factory=list)  # interrupt: (group, version, first decode, end, tokens) of each part
    completion_tokens: list[int] = field(default_factory=list)
    params: dict = field(default_factory=dict)


class SimCluster:
    """The stand-ins around one Orchestrator; `run()` returns a SimResult."""

    def __init__(
        self,
        resolved: ResolvedConfig,
        model: ClusterModel | None = None,
        seed: int = 0,
        run_dir: str | Path | None = None,
    ):
        self.model = model or ClusterModel()
        self.model.check()
        self.resolved, self.seed = resolved, seed
        self.vocab_size = self.model.vocab_size or resolved.model.architecture.vocab_size
        self.ledger = CpuLedger()
        self.events: list[tuple] = []
        critic_config = resolved.value.model if resolved.value is not None else resolved.model
        epochs = resolved.value.epochs_per_step if resolved.value is not None else 1
        self.flops_per_gpu_s = seed_flops_per_gpu_s(self.model, critic_config, epochs)
        self.run_dir = Path(run_dir) if run_dir else Path(tempfile.mkdtemp(prefix="megatron_rl_sim_"))
        self.failure: BaseException | None = None

    def fail(self, exc: BaseException) -> None:
        """A stand-in's task failed: stop the run with it (else the orchestrator waits forever)."""
        if self.failure is None:
            self.failure = exc
            self._main_task.cancel()

    def event(self, kind: str, a, b) -> None:
        self.events.append((round(_now(), 9), kind, a, b))

    async def _main(self) -> SimResult:
        r, o = self.resolved, self.resolved.orchestrator
        self._main_task = asyncio.current_task()
        servers = self.model.num_servers or r.inference.num_servers
        self.inference = SimInference(self, servers, r.inference.update_mode)
        self.policy = SimPolicy(self, r)
        self.critic = SimCritic(self, r) if r.value is not None else None
        self.follower = VersionFollower(SimSync(self.policy), None)
        shipped, ends, records, integrals = [], [], [], []
        writer = MetricsWriter(self.run_dir / "logs", console=False, num_steps=o.num_steps)

        def record(metrics: dict) -> None:
            writer(metrics)
            records.append(metrics)
            ends.append(_now())
            for server in self.inference.servers:
                server.account()
            integrals.append((sum(s.busy_s for s in self.inference.servers), sum(s.slot_s for s in self.inference.servers)))

        # What ships, as a bounded record (five ints a sample): the step's samples as the algorithm
        # prepares them, recorded once the policy's grid is sent.
        preparing: list[tuple[int, int, int, int]] = []

        async def send_policy(step, grid) -> None:
            await self.policy.send(step, grid)
            shipped.extend((step, *sample) for sample in preparing)

        links = [self.policy.link] + ([self.critic.link] if self.critic else [])
        for link in links:
            link.start()
        if self.critic is not None:
            self.critic.connect()
        encoder = PromptEncoder(
            SimTokenizer(min(self.model.prompt_tokens, o.max_prompt_tokens), self.vocab_size), False
        )
        state = OrchestratorState(self.run_dir / "orchestrator" / "state.json", o.seed)
        orchestrator = Orchestrator(
            r, SimEnvironment(self.seed), encoder, self.inference, self.follower, self.critic, send_policy,
            state, record, Timeouts(batch_s=1e9, critic_s=1e9, weights_s=1e9),
        )  # fmt: skip
        prepare = orchestrator.algorithm.prepare_batch

        async def prepare_batch(groups, version=None):
            preparing[:] = [(s.group_id, s.branch_index, s.policy_version, int(s.versions()[s.loss_mask].max(initial=s.policy_version)))
                            for group in groups for s in group]  # fmt: skip
            return await prepare(groups, version)

        orchestrator.algorithm.prepare_batch = prepare_batch
        self.follower.start()
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            steps = await orchestrator.run()
            dispatcher = orchestrator.dispatcher  # its groups not consumed (cancelled, not yet removed)
            unconsumed = set(dispatcher.running) | set(dispatcher.done)
            await self.follower.wait_for(o.num_steps, 1e9)
        except asyncio.CancelledError:
            if self.failure is not None:
                raise RuntimeError(
                    f"simulated cluster: a stand-in failed: {self.failure!r}"
                ) from self.failure
            raise
        finally:
            cpu = time.process_time() - cpu
            wall = time.perf_counter() - wall
            self.follower.stop()
            if self.critic is not None:
                await self.critic.scorer.close()
            for link in links:
                link.close()
        total = _now()
        servers, inference = len(self.inference.servers), self.inference
        trained = {group for _, group, *_ in shipped}
        wasted = sorted(set(inference.tokens_by_group) - unconsumed - trained)
        window = ends[-1] - ends[1] if len(ends) > 2 else 0.0
        paused = sum(max(0.0, min(u.end, ends[-1]) - max(u.start, ends[1])) for u in inference.updates) if window else 0.0
        result = SimResult(
            steps=steps, step_end_s=ends, records=records, events=self.events, shipped=shipped,
            orchestrator_cpu_s=cpu - self.ledger.seconds, standin_cpu_s=self.ledger.seconds, wall_s=wall,
            grid_bytes={k.name: k.bytes for k in links}, grid_tokens={k.name: k.tokens for k in links}, grid_wall_s={k.name: k.wall_s for k in links},
            grid_micro_steps={k.name: k.micro_steps for k in links},
            version_at_ship=dict(self.policy.link.version_at_send),
            server_busy=float(np.mean([s.busy_s for s in inference.servers])) / total if total else 0.0,
            server_slots=float(np.mean([s.slot_s for s in inference.servers]))
            / (total * self.model.concurrency_per_server) if total else 0.0,
            server_busy_steady=(integrals[-1][0] - integrals[1][0]) / (servers * window) if window else 0.0,
            server_slots_steady=(integrals[-1][1] - integrals[1][1]) / (servers * window * self.model.concurrency_per_server)
            if window else 0.0,
            server_paused_steady=paused / window if window else 0.0,
            server_reprefilling=float(np.mean([s.reprefill_s for s in inference.servers])) / total if total else 0.0,
            updates=list(inference.updates), reprefilled_tokens=dict(inference.reprefilled_tokens),
            wasted_groups=wasted, wasted_tokens=sum(inference.tokens_by_group[g] for g in wasted),
            unconsumed_groups=len(unconsumed), parts=inference.parts,
            true_version_spans=[inference.true_span_by_group[g] for g in sorted(trained) if g in inference.true_span_by_group],
            completion_tokens=inference.completion_tokens,
        )  # fmt: skip
        if self.critic is not None:
            result.score_calls = self.critic.score_calls
            result.score_request_bytes, result.score_reply_bytes = (
                self.critic.request_bytes,
                self.critic.reply_bytes,
            )
        return result

    def run(self) -> SimResult:
        return run_virtual(self._main())


def steady_step_s(result: SimResult, skip: int = 1) -> float:
    """Median simulated time between consecutive step ends, after `skip` warm-up intervals."""
    gaps = [b - a for a, b in zip(result.step_end_s, result.step_end_s[1:])][skip:]
    if not gaps:
        raise ValueError(f"steady_step_s: {result.steps} steps leave no interval after {skip} warm-up ones")
    return float(np.median(gaps))
