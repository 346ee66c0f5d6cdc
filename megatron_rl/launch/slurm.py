"""`megatron-rl slurm CONFIG [--out FILE] [--submit]`: one sbatch script for the config's layout.

Placement (`place`), per node of the allocation:

- inference servers first, `inference.tp` GPUs each, filling nodes in order; then the servers
  of a teacher and a judge the run serves (config/services.py), `serve.tp` GPUs each, the same way;
  a Megatron teacher (`distillation.teacher.megatron`: its own torchrun group, `megatron-rl
  teacher`) on the first node with `megatron.gpus` GPUs free, or on whole free nodes when it
  needs more than one (a multiple of gpus_per_node);
- **shared** (`deployment.num_value_gpus_per_train_node` = c): every training node gives c GPUs
  to the critic (its own torchrun group) and the rest, up to what the policy still needs, to the
  policy; the policy must get the same GPU count on each of its nodes (torchrun);
- **dedicated** (`deployment.num_value_nodes`): the last nodes run only the critic;
- **none** (GRPO): only the policy;
- the orchestrator (no GPU) runs on the policy's first node.

The script (a Jinja2 template, `templates/job.sbatch.j2`) runs with `set -euo pipefail`; every
component is its own `srun --exact --kill-on-bad-exit=1` step with explicit `--gpus-per-node`
(steps on disjoint GPUs of a node run concurrently; SLURM sets each step's
CUDA_VISIBLE_DEVICES; the training steps get what megatron needs on top, `srun --export`:
`launch.local.training_env`); hosts are the nodes' own addresses (never `localhost` across nodes), put
into the job's resolved config with `check-config --set`; inference steps first (the policy's and
each served model's), vllm-router on the first inference node only after every server answers
`/v1/models` (each served model's router on its own first server's node); rendezvous ports probed
on each group's first node (both groups together on a shared node). Then `wait -n`: the
orchestrator finishing ends the job with 0; any other step ending first (the policy's exit 0
excepted) ends the job with its code, naming the step. Stopping sends SIGTERM to the job's own
steps only (no broad pkill: critic GPUs may share nodes) and SIGKILL after the grace period.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from jinja2 import Environment, FileSystemLoader, StrictUndefined

from megatron_rl.config import Layout, LoggingConfig, ResolvedConfig, load_config
from megatron_rl.config.services import MEGATRON_TEACHER_KEY, megatron_service, vllm_services
from megatron_rl.launch.local import training_env


class SlurmError(RuntimeError):
    pass


@dataclass
class StepPlacement:
    name: str
    nodes: list[int]  # indices into the job's node list
    gpus_per_node: int


def place(resolved: ResolvedConfig) -> dict[str, StepPlacement | list[StepPlacement]]:
    deployment, inference, layout = resolved.deployment, resolved.inference, resolved.layout
    g, nodes = deployment.gpus_per_node, deployment.nodes
    free = [g] * nodes
    servers = []
    for i in range(inference.num_servers):
        node = next((n for n in range(nodes) if free[n] >= inference.tp), None)
        if node is None:
            raise SlurmError(
                f"inference server {i} (tp {inference.tp}) does not fit on any of {nodes} nodes of {g} GPUs"
            )
        free[node] -= inference.tp
        servers.append(StepPlacement(f"inference_{i}", [node], inference.tp))
    services: dict[str, list[StepPlacement]] = {}
    for name, service in vllm_services(layout.services).items():
        services[name] = []
        for i in range(service.num_servers):
            node = next((n for n in range(nodes) if free[n] >= service.tp), None)
            if node is None:
                raise SlurmError(f"{name} server {i} ({service.key}.serve.tp {service.tp}) does not fit on any of "
                                 f"{nodes} nodes of {g} GPUs after the inference servers")  # fmt: skip
            free[node] -= service.tp
            services[name].append(StepPlacement(f"{name}_{i}", [node], service.tp))
    style = layout.deployment_style
    teacher = _place_teacher(resolved, free, deployment.num_value_nodes if style == "dedicated" else 0)
    critic_nodes: list[int] = []
    if style == "dedicated":
        critic_nodes = list(range(nodes - deployment.num_value_nodes, nodes))
        if any(free[n] != g for n in critic_nodes):
            raise SlurmError(f"deployment.num_value_nodes: critic nodes {critic_nodes} must be whole nodes; "
                             f"inference servers use some of them")  # fmt: skip
        for n in critic_nodes:
            free[n] = 0
    reserve = deployment.num_value_gpus_per_train_node if style == "shared" else 0
    policy_left, policy_nodes, per_node = deployment.policy_gpus, [], []
    for n in range(nodes):
        if policy_left == 0:
            break
        if n in critic_nodes or free[n] <= reserve:
            continue
        take = min(free[n] - reserve, policy_left)
        policy_nodes.append(n)
        per_node.append(take)
        free[n] -= take + reserve
        policy_left -= take
    if policy_left:
        raise SlurmError(f"deployment: {policy_left} of {deployment.policy_gpus} policy GPUs do not fit after the "
                         f"inference servers and the critic on {nodes} nodes of {g} GPUs")  # fmt: skip
    if len(set(per_node)) > 1:
        raise SlurmError(f"deployment: the policy would get {per_node} GPUs on nodes {policy_nodes}; torchrun needs "
                         "the same count on every node (change policy_gpus or inference_gpus)")  # fmt: skip
    out: dict = {"inference": servers, "services": services,
                 "policy": StepPlacement("policy", policy_nodes, per_node[0])}  # fmt: skip
    if teacher is not None:
        out["teacher"] = teacher
    if style == "shared":
        out["critic"] = StepPlacement("critic", policy_nodes, reserve)
    elif style == "dedicated":
        out["critic"] = StepPlacement("critic", critic_nodes, g)
    if "critic" in out:
        critic = out["critic"]
        if critic.gpus_per_node * len(critic.nodes) != layout.value_gpus:
            raise SlurmError(f"the critic would get {critic.gpus_per_node} x {len(critic.nodes)} GPUs, "
                             f"the layout has {layout.value_gpus}")  # fmt: skip
    out["orchestrator"] = StepPlacement("orchestrator", [policy_nodes[0]], 0)
    return out


def _place_teacher(resolved: ResolvedConfig, free: list[int], critic_tail: int) -> StepPlacement | None:
    """The Megatron teacher's torchrun group (taking its GPUs from `free`): the first node with
    megatron.gpus free, or as many whole free nodes as it needs; never the dedicated critic's last
    `critic_tail` nodes."""
    teacher = megatron_service(resolved.layout.services)
    if teacher is None:
        return None
    g, nodes, need = resolved.deployment.gpus_per_node, resolved.deployment.nodes, teacher.gpus
    usable = range(nodes - critic_tail)
    if need <= g:
        node = next((n for n in usable if free[n] >= need), None)
        if node is None:
            raise SlurmError(f"the teacher ({MEGATRON_TEACHER_KEY}: {need} GPUs) does not fit on any node of {g} GPUs "
                             "after the inference servers")  # fmt: skip
        free[node] -= need
        return StepPlacement("teacher", [node], need)
    if need % g:
        raise SlurmError(f"{MEGATRON_TEACHER_KEY}.gpus ({need}): a teacher over more than one node takes whole nodes, "
                         f"a multiple of gpus_per_node ({g})")  # fmt: skip
    whole = [n for n in usable if free[n] == g][: need // g]
    if len(whole) < need // g:
        raise SlurmError(f"the teacher ({MEGATRON_TEACHER_KEY}: {need} GPUs) needs {need // g} whole nodes; "
                         f"{len(whole)} are free after the inference servers")  # fmt: skip
    for n in whole:
        free[n] = 0
    return StepPlacement("teacher", whole, g)


def rendezvous_probes(placement) -> list[tuple[int, list[str]]]:
    """(node, port variables) for each node where torchrun groups start (policy, critic, teacher):
    the groups that share a first node are probed together, so that they get different ports."""
    probes: dict[int, list[str]] = {}
    for name in ("policy", "critic", "teacher"):
        if name in placement:
            probes.setdefault(placement[name].nodes[0], []).append(f"{name.upper()}_PORT")
    return list(probes.items())


def gpu_use_per_node(placement) -> list[dict[str, int]]:
    """For each node, GPUs per step (the rendered script asks SLURM for exactly these)."""
    steps = [
        *placement["inference"],
        *(step for servers in placement.get("services", {}).values() for step in servers),
        placement["policy"],
        *([placement["critic"]] if "critic" in placement else []),
        *([placement["teacher"]] if "teacher" in placement else []),
    ]
    nodes = max(n for s in steps for n in s.nodes) + 1
    use = [{} for _ in range(nodes)]
    for step in steps:
        for n in step.nodes:
            use[n][step.name] = use[n].get(step.name, 0) + step.gpus_per_node
    return use


def template(name: str):
    """A script template of templates/ (Jinja2; `{# #}` is bash's, so comments are `<# #>`; the
    filter `q` shell-quotes)."""
    templates = Environment(loader=FileSystemLoader(Path(__file__).parent / "templates"), undefined=StrictUndefined,
                            keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True,
                            comment_start_string="<#", comment_end_string="#>")  # fmt: skip
    templates.filters["q"] = lambda value: shlex.quote(str(value))
    return templates.get_template(name)


def fixed_ports(layout: Layout) -> str:
    """The config's fixed ports (`layout.ports`), which a probed rendezvous port must not take."""
    return " ".join(str(p) for p in sorted(set(layout.ports.values())))


def srun_export(env: dict[str, str]) -> str:
    """srun's --export value: the job's environment plus `env`."""
    return ",".join(["ALL", *(f"{key}={value}" for key, value in sorted(env.items()))])


def render(resolved: ResolvedConfig, config_path: Path, partition: str | None = None,
           time_limit: str | None = None, python: str | None = None) -> str:  # fmt: skip
    placement = place(resolved)
    run_dir = Path(resolved.logging.dir).resolve()
    served = placement["services"]
    # every step of a node, plus probes and the routers
    steps_per_node = (2 + len(placement["inference"]) + 3 + sum(len(servers) + 1 for servers in served.values())
                      + ("teacher" in placement))  # fmt: skip
    services = [{"name": name, "key": resolved.layout.services[name].key, "servers": servers}
                for name, servers in served.items()]  # fmt: skip
    return template("job.sbatch.j2").render(
        job_name=f"megatron-rl-{resolved.algorithm.type}",
        nodes=resolved.deployment.nodes,
        gpus_per_node=resolved.deployment.gpus_per_node,
        tasks_per_node=steps_per_node,
        partition=partition,
        time_limit=time_limit,
        python=python or sys.executable,
        config=str(config_path.resolve()),
        run_dir=str(run_dir),
        inference=placement["inference"],
        services=services,
        policy=placement["policy"],
        critic=placement.get("critic"),
        teacher=placement.get("teacher"),
        teacher_key=MEGATRON_TEACHER_KEY,
        probes=rendezvous_probes(placement),
        orchestrator=placement["orchestrator"],
        policy_export=srun_export(training_env(resolved, "policy")),
        critic_export=srun_export(training_env(resolved, "critic")) if "critic" in placement else None,
        teacher_export=srun_export(training_env(resolved, "teacher")) if "teacher" in placement else None,
        fixed_ports=fixed_ports(resolved.layout),
        grace_s=int(resolved.deployment.stop_grace_s),
        style=resolved.layout.deployment_style,
    )


def render_and_submit(config: str, out: str | None, submit: bool, partition=None, time_limit=None) -> int:
    resolved = load_config(config)
    script = render(resolved, Path(config), partition, time_limit)
    what = f"{resolved.layout.deployment_style} layout, {resolved.deployment.nodes} node(s)"
    return write_and_submit(resolved.logging, script, out, "job.sbatch", what, submit)


def write_and_submit(logging_config: LoggingConfig, script: str, out: str | None, name: str, what: str,
                     submit: bool) -> int:  # fmt: skip
    """Writes `script` to `out` (default: logging.dir/`name`) and, with `submit`, sbatches it;
    the exit status of sbatch, 0 without it."""
    path = Path(out) if out else Path(logging_config.dir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(script)
    (Path(logging_config.dir) / "logs").mkdir(parents=True, exist_ok=True)  # sbatch --output opens it first
    print(f"wrote {path} ({what})")
    if submit:
        result = subprocess.run(["sbatch", str(path)], capture_output=True, text=True)
        print(result.stdout.strip() or result.stderr.strip())
        return result.returncode
    return 0
