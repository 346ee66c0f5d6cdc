"""`megatron-rl run CONFIG`: the whole system on one machine.

Resolves the config (written to `logging.dir/resolved.json`), assigns devices from those
actually visible (`CUDA_VISIBLE_DEVICES` may be `2,5,7`; on CPU a "GPU" is a process),
disjoint per group (inference servers first, then the critic, then the policy), probes the
rendezvous ports of both torchrun groups together (free on the host address and on loopback,
none of the configured ports), then starts, in dependency order, each with its own log under
`logging.dir/logs/`:

1. the vLLM servers (one process group each): the policy's, then those of a teacher and a judge
   the run serves (`distillation.teacher` / `orchestrator.judge` without `url`: config/services.py,
   on devices of their own); the launcher waits until every one serves its model;
2. vllm-router over the policy's servers, and one over each served model's;
3. the Megatron teacher's torchrun group (`distillation.teacher.megatron`: `megatron-rl teacher`
   on devices of its own, log `teacher.log`; the orchestrator waits for its /health);
4. the critic's torchrun group (when there is a `value` section);
5. the policy's torchrun group;
6. the orchestrator (`megatron-rl orchestrate`, attached to the servers and router above).

It then supervises: the first component to fail (any exit of a server, the router or the critic;
a non-zero exit of the policy or the orchestrator) stops all of them (SIGTERM to each process
group, SIGKILL after `deployment.stop_grace_s`, which lets a checkpoint in progress finish) and
the command exits 1, naming the component and printing the last lines of its log. A torchrun
group that lost its rendezvous port between probe and bind is restarted on a new probe (up to
3 times). Ctrl-C stops everything (exit 130). The orchestrator finishing the configured steps
stops everything with exit 0. `--dry-run` prints every command, device set, port and log path.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from megatron_rl.config import ResolvedConfig, load_config
from megatron_rl.config.services import megatron_service, vllm_services
from megatron_rl.inference.pool import InferencePool, router_settings, served_model_dir
from megatron_rl.inference.router import router_command
from megatron_rl.inference.services import service_router_settings, service_servers
from megatron_rl.inference.vllm_control import VllmControl, VllmControlError
from megatron_rl.inference.vllm_server import log_tail, signal_group
from megatron_rl.launch.ports import lost_port, probe_ports
from megatron_rl.lifetime import bound_to_parent

# torchrun with its rendezvous store bound to --master_addr only (torch's binds every interface)
TORCHRUN = [sys.executable, "-m", "megatron_rl.launch.torchrun"]
CLI = ["-m", "megatron_rl.launch.cli"]


class LaunchError(RuntimeError):
    pass


@dataclass
class Component:
    name: str
    command: list[str]
    log: Path
    env: dict[str, str] = field(default_factory=dict)  # on top of the launcher's environment
    devices: list[str] | None = None
    ports: dict[str, int] = field(default_factory=dict)
    may_finish: bool = False  # exit 0 is normal (the policy after its last step)
    url: str | None = None  # an inference server's address (readiness: GET /v1/models)
    api_key: str | None = None  # an inference server's API key (inference.api_key_env)
    model: str | None = None  # the model an inference server must serve to be ready (None: the policy's)
    torchrun: bool = False  # a torchrun agent whose ranks each lead a process session of their own
    process: subprocess.Popen | None = None
    restarts: int = 0

    def start(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "a") as log:
            self.process = subprocess.Popen(
                bound_to_parent(self.command), env={**os.environ, **self.env}, stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip

    def signal(self, sig: int) -> None:
        """`sig` to the component's process group. A torchrun group's ranks lead sessions of
        their own, out of reach of that: SIGKILL goes to them as well, and SIGTERM goes to them
        *instead* of the agent, so that ranks which stop cleanly (the critic after its current
        command) let torchrun exit 0, rather than torchrun turning the signal into a
        SignalException traceback in the log. A vLLM server's SIGTERM goes to its API server only."""
        if self.process is None or self.process.poll() is not None:
            return
        if sig == signal.SIGTERM and self.url is not None:
            # A vLLM server: the API server stops its engine itself (SIGTERM to the engine as
            # well would make it log an EngineDeadError traceback).
            os.kill(self.process.pid, sig)
            return
        ranks = _children(self.process.pid) if self.torchrun else []
        targets = ranks if (ranks and sig == signal.SIGTERM) else [self.process.pid, *ranks]
        for pid in targets:
            try:
                os.killpg(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def describe(self) -> str:
        lines = [f"[{self.name}]", f"  log:     {self.log}"]
        if self.devices is not None:
            lines.append(f"  devices: {','.join(self.devices) if self.devices else '(cpu processes)'}")
        if self.ports:
            lines.append("  ports:   " + ", ".join(f"{k}={v}" for k, v in self.ports.items()))
        if self.env:
            lines.append(
                "  env:     " + " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()))
            )
        lines.append(f"  command: {shlex.join(self.command)}")
        return "\n".join(lines)


def _children(pid: int) -> list[int]:
    """The direct children of `pid` (Linux /proc)."""
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except (OSError, ValueError):
        return []


def visible_devices(resolved: ResolvedConfig) -> list[str]:
    """The devices this launch may use: CUDA_VISIBLE_DEVICES as given, else every GPU; on CPU
    one pseudo-device per process."""
    deployment = resolved.deployment
    needed = deployment.inference_gpus + deployment.policy_gpus + resolved.layout.value_gpus + _served_gpus(resolved)
    if deployment.device == "cpu":
        return [f"cpu{i}" for i in range(needed)]
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [d.strip() for d in listed.split(",") if d.strip()]
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return []
    return [str(i) for i, line in enumerate(out.splitlines()) if line.startswith("GPU")]


def _served_gpus(resolved: ResolvedConfig) -> int:
    return sum(service.gpus for service in resolved.layout.services.values())


def assign_devices(resolved: ResolvedConfig, visible: list[str]) -> dict[str, list[str]]:
    """Disjoint device lists: `inference_{i}` (inference.tp each), then `teacher_{i}` and
    `judge_{i}` of served models (their serve.tp each), or `teacher` (a Megatron teacher's
    megatron.gpus), `critic`, `policy`."""
    deployment, inference, services = resolved.deployment, resolved.inference, resolved.layout.services
    needed = deployment.inference_gpus + deployment.policy_gpus + resolved.layout.value_gpus + _served_gpus(resolved)
    if len(visible) < needed:
        served = "".join(f", {name} {service.gpus}" for name, service in services.items())
        raise LaunchError(
            f"the config needs {needed} devices (inference {deployment.inference_gpus}{served}, critic "
            f"{resolved.layout.value_gpus}, policy {deployment.policy_gpus}) but {len(visible)} are visible: {visible}"
        )
    out, cursor = {}, 0
    for i in range(inference.num_servers):
        out[f"inference_{i}"] = visible[cursor : cursor + inference.tp]
        cursor += inference.tp
    for name, service in services.items():
        if not service.is_vllm:  # the Megatron teacher: one torchrun group
            out[name] = visible[cursor : cursor + service.gpus]
            cursor += service.gpus
            continue
        for i in range(service.num_servers):
            out[f"{name}_{i}"] = visible[cursor : cursor + service.tp]
            cursor += service.tp
    if resolved.value is not None:
        out["critic"] = visible[cursor : cursor + resolved.layout.value_gpus]
        cursor += resolved.layout.value_gpus
    out["policy"] = visible[cursor : cursor + deployment.policy_gpus]
    return out


def training_env(resolved: ResolvedConfig, role: str) -> dict[str, str]:
    """What megatron needs in the environment of a role's ranks ("policy", "critic", or "teacher",
    the Megatron teacher's):
    on CUDA with TP > 1, CUDA_DEVICE_MAX_CONNECTIONS=1. Megatron's tensor-parallel linear layers
    issue the sequence-parallel all-gather and reduce-scatter, or the input-gradient all-reduce,
    asynchronously and rely on that setting to have the GPU schedule them before the weight-
    gradient matmul they overlap with (megatron/core/tensor_parallel/layers.py; it warns when
    unset). The SLURM script sets the same (launch/slurm.py)."""
    if role == "teacher":
        layout = resolved.layout.services["teacher"].megatron
    else:
        layout = resolved.layout.policy if role == "policy" else resolved.layout.critic
    if resolved.deployment.device == "cuda" and layout.tp > 1:
        return {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    return {}


def _role_env(resolved: ResolvedConfig, role: str, devices: list[str]) -> dict[str, str]:
    if resolved.deployment.device == "cpu":
        return {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    return {"CUDA_VISIBLE_DEVICES": ",".join(devices), **training_env(resolved, role)}


def torchrun_command(nproc: int, port: int, role_args: list[str]) -> list[str]:
    return [*TORCHRUN, "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1",
            "--master_port", str(port), *CLI, *role_args]  # fmt: skip


def plan_local(
    resolved: ResolvedConfig, resolved_path: Path, devices: dict[str, list[str]], ports: dict[str, int]
) -> list[Component]:
    """The components of one local run, in start order. `ports`: `policy_rendezvous`,
    `critic_rendezvous` (with a value section), `teacher_rendezvous` (with a Megatron teacher),
    `router_metrics`."""
    logs = Path(resolved.logging.dir) / "logs"
    inference, layout = resolved.inference, resolved.layout
    try:
        served_model_dir(resolved)
    except ValueError as exc:
        raise LaunchError(str(exc)) from None
    cpu = resolved.deployment.device == "cpu"
    servers = InferencePool.from_config(
        resolved, [devices[f"inference_{i}"] for i in range(inference.num_servers)], logs, launch=False
    )
    components = []
    for i, server in enumerate(servers):
        extra = {k: v for k, v in server.env.items() if os.environ.get(k) != v}
        components.append(Component(f"inference_{i}", server.command, logs / f"inference_{i}.log", extra,
                                    devices[f"inference_{i}"], {"http": server.port}, url=server.url,
                                    api_key=server.api_key))  # fmt: skip
    router_port = inference.router_port
    command = router_command([s.url for s in servers], inference.host, router_port, ports["router_metrics"],
                             router_settings(resolved))  # fmt: skip
    components.append(Component("router", command, logs / "router.log",
                                ports={"http": router_port, "metrics": ports["router_metrics"]}))  # fmt: skip
    components += served_components(resolved, devices, ports, logs)
    config = ["--config", str(resolved_path)]
    teacher = megatron_service(layout.services)
    if teacher is not None:
        components.append(Component(
            "teacher", torchrun_command(teacher.gpus, ports["teacher_rendezvous"], ["teacher", *config]),
            logs / "teacher.log", _role_env(resolved, "teacher", devices["teacher"]), devices["teacher"],
            {"rendezvous": ports["teacher_rendezvous"], "service": teacher.ports[0]}, torchrun=True,
        ))  # fmt: skip
    if resolved.value is not None:
        components.append(Component(
            "critic", torchrun_command(layout.value_gpus, ports["critic_rendezvous"], ["critic", *config]),
            logs / "critic.log", _role_env(resolved, "critic", devices["critic"]), devices["critic"],
            {"rendezvous": ports["critic_rendezvous"], "service": resolved.value.service.port,
             "zmq": resolved.transport.critic_port}, torchrun=True,
        ))  # fmt: skip
    components.append(Component(
        "policy", torchrun_command(resolved.deployment.policy_gpus, ports["policy_rendezvous"], ["train-policy", *config]),
        logs / "policy.log", _role_env(resolved, "policy", devices["policy"]), devices["policy"],
        {"rendezvous": ports["policy_rendezvous"], "zmq": resolved.transport.policy_port}, may_finish=True,
        torchrun=True,
    ))  # fmt: skip
    components.append(Component("orchestrator", [sys.executable, *CLI, "orchestrate", *config],
                                logs / "orchestrator.log", {"OMP_NUM_THREADS": "1"} if cpu else {},
                                may_finish=True))  # fmt: skip
    return components


def served_components(resolved: ResolvedConfig, devices: dict[str, list[str]], ports: dict[str, int],
                      logs: Path) -> list[Component]:  # fmt: skip
    """The servers and the router of each model the run serves with vLLM (teacher, judge):
    `NAME_{i}` on devices `NAME_{i}`, and `NAME_router` on its serve.router_port (metrics:
    `NAME_router_metrics`)."""
    components = []
    for name, service in vllm_services(resolved.layout.services).items():
        servers = service_servers(resolved, name, [devices[f"{name}_{i}"] for i in range(service.num_servers)], logs)
        for i, server in enumerate(servers):
            extra = {k: v for k, v in server.env.items() if os.environ.get(k) != v}
            components.append(Component(f"{name}_{i}", server.command, logs / f"{name}_{i}.log", extra,
                                        devices[f"{name}_{i}"], {"http": server.port}, url=server.url,
                                        api_key=server.api_key, model=service.served_model_name))  # fmt: skip
        router_port = int(service.url.rsplit(":", 1)[1])
        host = service.url.removeprefix("http://").rsplit(":", 1)[0]
        command = router_command(service.server_urls, host, router_port, ports[f"{name}_router_metrics"],
                                 service_router_settings(resolved, name))  # fmt: skip
        components.append(Component(f"{name}_router", command, logs / f"{name}_router.log",
                                    ports={"http": router_port, "metrics": ports[f"{name}_router_metrics"]}))  # fmt: skip
    return components


def probe_launch_ports(resolved: ResolvedConfig) -> dict[str, int]:
    """Every torchrun group's rendezvous port and the routers' metrics ports (the policy's, and each
    served model's), chosen together, free on the host address and loopback, none of the
    configured ports."""
    services = resolved.layout.services
    names = ["policy_rendezvous", "router_metrics"] + (
        ["critic_rendezvous"] if resolved.value is not None else []
    ) + (["teacher_rendezvous"] if megatron_service(services) is not None else []
    ) + [f"{name}_router_metrics" for name in vllm_services(services)]
    hosts = {"127.0.0.1", resolved.transport.host, resolved.inference.host}
    hosts |= {s.url.removeprefix("http://").rsplit(":", 1)[0] for s in resolved.layout.services.values()}
    found = probe_ports(len(names), hosts, exclude=set(resolved.layout.ports.values()))
    return dict(zip(names, found, strict=True))


class Supervisor:
    """Starts components in order and stops them all when one fails or the run finishes."""

    def __init__(
        self, components: list[Component], grace_s: float = 60.0, out=None, reprobe=None, on_tick=None
    ):
        self.components, self.grace_s = components, grace_s
        self.on_tick = on_tick  # called twice a second while the run is up (a progress display)
        self.out = out or sys.stdout
        self.reprobe = reprobe  # component -> new command after a lost rendezvous port
        self.interrupted = False

    def say(self, text: str) -> None:
        print(f"[megatron-rl run] {text}", file=self.out, flush=True)

    def start(self, component: Component) -> None:
        component.start()
        self.say(f"started {component.name} (pid {component.process.pid}, log {component.log})")

    def failure(self, component: Component) -> str:
        code = component.process.returncode
        return (f"component '{component.name}' exited with code {code}; last lines of {component.log}:\n"
                f"{log_tail(component.log)}")  # fmt: skip

    def check(self, running: list[Component]) -> str | None:
        """None while all is well; 'done' when the orchestrator finished; else a failure message."""
        for component in running:
            code = component.process.poll()
            if code is None:
                continue
            if code == 0 and component.name == "orchestrator":
                return "done"
            if code == 0 and component.may_finish:
                continue
            if (
                code != 0
                and self.reprobe is not None
                and component.torchrun  # a lost rendezvous port; any other lost port is a failure
                and component.restarts < 3
                and lost_port(component.log.read_text(errors="replace"))
            ):
                component.restarts += 1
                component.command = self.reprobe(component)
                self.say(f"{component.name} lost its rendezvous port; restarting on a new probe")
                self.start(component)
                continue
            return self.failure(component)
        return None

    def wait_ready(self, servers: list[Component], model_name: str, running, timeout_s: float) -> str | None:
        deadline = time.monotonic() + timeout_s
        pending = list(servers)
        while pending:
            problem = self.check(running)
            if problem is not None:
                return problem
            still = []
            for server in pending:
                try:
                    if (server.model or model_name) not in VllmControl(server.url, api_key=server.api_key).models(timeout_s=2):
                        still.append(server)
                except VllmControlError:
                    still.append(server)
            pending = still
            if pending and time.monotonic() > deadline:
                return f"{', '.join(s.name for s in pending)} not ready within {timeout_s:.0f}s (inference.startup_timeout_s)"
            if pending:
                time.sleep(1.0 if not self.interrupted else 0)
            if self.interrupted:
                return "interrupted"
        return None

    def stop_all(self) -> None:
        for component in reversed(self.components):  # the orchestrator first, the servers last
            component.signal(signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        for component in self.components:
            if component.process is None:
                continue
            try:
                component.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                component.signal(signal.SIGKILL)
                component.process.wait()
            signal_group(component.process, signal.SIGKILL)  # what the component left in its group

    def run(self, model_name: str, startup_timeout_s: float) -> int:
        previous = signal.signal(signal.SIGINT, self._interrupt)
        previous_term = signal.signal(signal.SIGTERM, self._interrupt)
        running: list[Component] = []
        try:
            servers = [c for c in self.components if c.url is not None]  # every vLLM server, started together
            for server in servers:
                self.start(server)
                running.append(server)
            problem = self.wait_ready(servers, model_name, running, startup_timeout_s)
            if problem is None:
                for component in [c for c in self.components if c.url is None]:
                    self.start(component)
                    running.append(component)
                while problem is None and not self.interrupted:
                    problem = self.check(running)
                    if self.on_tick is not None:
                        self.on_tick()
                    time.sleep(0.5)
            if self.interrupted:
                self.say("interrupted: stopping every component")
                return 130
            if problem == "done":
                self._let_finish(running)
                self.say("the orchestrator finished its steps: stopping every component")
                return 0
            self.say(problem)
            self.say("stopping every component")
            return 1
        finally:
            self.stop_all()
            signal.signal(signal.SIGINT, previous)
            signal.signal(signal.SIGTERM, previous_term)

    def _let_finish(self, running: list[Component]) -> None:
        """The policy ends its last step (metrics, checkpoint) by itself: wait for it, up to the grace period."""
        deadline = time.monotonic() + self.grace_s
        for component in running:
            if component.may_finish and component.process.poll() is None:
                try:
                    component.process.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass

    def _interrupt(self, *_):
        self.interrupted = True


def run_local(config_path: str, dry_run: bool = False, out=None, on_tick=None, overrides: list[str] = ()) -> int:
    """Starts the whole run of the YAML config at `config_path` (with `KEY=VALUE` overrides, as
    `--set` gives them) on this machine; `dry_run` prints the plan and starts nothing."""
    out = out or sys.stdout
    resolved = load_config(config_path, list(overrides))
    run_dir = Path(resolved.logging.dir)
    resolved_path = run_dir / "resolved.json"
    devices = assign_devices(resolved, visible_devices(resolved))
    ports = probe_launch_ports(resolved)
    components = plan_local(resolved, resolved_path.resolve(), devices, ports)
    if dry_run:
        print(f"# megatron-rl run {config_path} (dry run): resolved config -> {resolved_path}", file=out)
        for component in components:
            print(component.describe(), file=out)
        return 0
    run_dir.mkdir(parents=True, exist_ok=True)
    resolved_path.write_text(resolved.to_json())

    def reprobe(component: Component) -> list[str]:
        new_port = probe_ports(
            1, {"127.0.0.1", resolved.transport.host}, exclude=set(resolved.layout.ports.values())
        )[0]
        command = list(component.command)
        command[command.index("--master_port") + 1] = str(new_port)
        component.ports["rendezvous"] = new_port
        return command

    supervisor = Supervisor(components, resolved.deployment.stop_grace_s, out, reprobe, on_tick)
    return supervisor.run(resolved.inference.served_model_name, resolved.inference.startup_timeout_s)
