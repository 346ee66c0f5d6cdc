"""A long run of the demo's tiny CPU stack: does anything grow with the step count that should not?

    python benchmarks/long_run.py [--steps 300] [--sample-at 50,300] [--rollouts 64] [--out runs/long-run]
                                  [--seed 0] [--set KEY=VALUE ...]

Runs the SAO demo (`megatron_rl.demo.run`: its tiny model, checkpoints and run config, then
`megatron-rl run`; ports probed free instead of the demo's fixed ones) for `--steps` steps. When
the orchestrator has logged each step of `--sample-at`, it records for every component (the
launcher's children: inference server, router, critic, policy, orchestrator) its resident memory
(RSS, the component and all its child processes together) and its open file descriptors (also
summed over its processes), the disk use of the run directory split into checkpoints (policy,
critic, policy snapshots), published versions, logs, metrics (the JSONL files), state (the
orchestrator's state file) and inputs (the model and its converted checkpoints), and the size of
the orchestrator's state file and of each metrics file. It then prints a table and writes
`benchmarks/results/long_run.json`:

- figure: the stack's total RSS at the last sample; reference: the same at the first sample;
  ratio: their quotient (goal: within 10%, i.e. at most 1.10). Per component, the RSS and FD
  ratios between the first and last sample; the FDs also split into sockets and the rest (files,
  pipes, event fds). `within_10_percent`: the RSS and the non-socket FDs at most 10% above the
  first sample, and the sockets not growing (the last sample not more than 10% above every
  earlier one): sockets are the connections open at the instant and rise and fall with the
  requests in flight (the router's went 85, 58, 54, 62, 43, 62 at steps 50-300 of a 64-rollout
  run), so last against first would measure which requests happened to be running.
- for the state file and each metrics file, bytes per step at each sample, the bytes added per
  step between the first and last sample, and whether the file grows linearly (bytes per step
  at the last sample within 10% of those at the first), the expected behaviour for one line /
  one entry per step. A file's constant part (a JSON header) weighs on bytes per step at small
  step counts: at 12 steps sampled at 4 the orchestrator state (83 bytes at step 4) is not
  "linear" by this rule; from step 50 on it is.
- RSS and FDs jump once when the trainers write their first checkpoint (megatron's checkpoint
  writer starts helper processes: 2 -> 4 per trainer at 12 steps): sample after the first `checkpoint.save_interval` (10 in the
  demo config) to see growth rather than that step.

Validated at a small step count (12 steps sampled at 4 and 12); the 300-step run is the figure.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import psutil
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._results import write_result  # noqa: E402
from megatron_rl.demo.run import demo_config, prepare  # noqa: E402
from megatron_rl.launch.local import run_local  # noqa: E402
from megatron_rl.parallel import free_port  # noqa: E402

METRICS_FILES = ("orchestrator_metrics.jsonl", "policy_metrics.jsonl", "critic_metrics.jsonl")
TOLERANCE = 0.10  # the goal: within 10% from the first sample to the last


def component_name(process: psutil.Process) -> str:
    """The launcher's name for one of its children, from its command line."""
    command = " ".join(process.cmdline())
    for marker, name in (  # the router and vLLM rename their processes: their titles too
        ("megatron_rl.inference.router", "router"),
        ("vllm-router", "router"),
        ("vllm::router", "router"),
        ("vllm.entrypoints.openai.api_server", "inference"),
        ("APIServer", "inference"),
        (" critic ", "critic"),
        ("train-policy", "policy"),
        ("orchestrate", "orchestrator"),
    ):
        if marker in command + " ":
            return name
    return f"other:{process.pid}"


def sockets_of(pid: int) -> int:
    """How many of the process's open descriptors are sockets (Linux: /proc/PID/fd links)."""
    count, fd_dir = 0, Path(f"/proc/{pid}/fd")
    for entry in fd_dir.iterdir():
        try:
            count += entry.readlink().name.startswith("socket:")
        except OSError:  # closed meanwhile
            continue
    return count


def process_figures(root: psutil.Process) -> dict:
    """RSS bytes and open file descriptors of `root` and all its descendants, summed; the
    descriptors also split into sockets (one per open connection: they rise and fall with the
    requests in flight at the instant) and the rest (files, pipes, event fds: what a leak of
    handles would grow)."""
    rss = fds = sockets = count = 0
    for process in [root, *root.children(recursive=True)]:
        try:
            rss += process.memory_info().rss
            fds += process.num_fds()
            sockets += sockets_of(process.pid)
            count += 1
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied, FileNotFoundError):
            continue
    return {"rss_bytes": rss, "open_fds": fds, "sockets": sockets, "other_fds": fds - sockets, "processes": count}


def tree_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    if not path.exists():
        return 0
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def disk_use(out: Path, checkpoint_dir: Path, publish_dir: Path) -> dict:
    """Bytes of the run directory by kind; `other` is whatever is not in a named kind."""
    state = checkpoint_dir / "orchestrator"
    kinds = {
        "checkpoints": tree_bytes(checkpoint_dir) - tree_bytes(state),
        "published": tree_bytes(publish_dir),
        "logs": tree_bytes(out / "logs"),
        "metrics": sum(tree_bytes(out / name) for name in METRICS_FILES),
        "state": tree_bytes(state),
        "inputs": sum(
            tree_bytes(out / name) for name in ("model", "model-random", "megatron-policy", "megatron-value")
        ),
    }
    kinds["other"] = tree_bytes(out) - sum(kinds.values())
    return kinds


class Sampler:
    """The supervisor's tick: once the orchestrator has logged `step` steps for each sample step,
    records the figures of every component, the disk use and the file sizes."""

    def __init__(self, out: Path, checkpoint_dir: Path, publish_dir: Path, sample_at: list[int]):
        self.out, self.checkpoint_dir, self.publish_dir = out, checkpoint_dir, publish_dir
        self.pending = sorted(sample_at)
        self.samples: list[dict] = []
        self.launcher = psutil.Process()

    def steps_done(self) -> int:
        path = self.out / "orchestrator_metrics.jsonl"
        return len(path.read_text().splitlines()) if path.is_file() else 0

    def __call__(self) -> None:
        if not self.pending:
            return
        done = self.steps_done()
        if done < self.pending[0]:
            return
        while self.pending and self.pending[0] <= done:
            self.pending.pop(0)
        components: dict[str, dict] = {}
        for child in self.launcher.children():
            try:
                name = component_name(child)
            except (psutil.NoSuchProcess, psutil.ZombieProcess):
                continue
            figures = process_figures(child)
            if name in components:  # two inference servers: summed under one name
                for key, value in figures.items():
                    components[name][key] += value
            else:
                components[name] = figures
        files = {name: tree_bytes(self.out / name) for name in METRICS_FILES}
        files["state.json"] = tree_bytes(self.checkpoint_dir / "orchestrator" / "state.json")
        sample = {
            "step": done,
            "time": time.time(),
            "components": components,
            "disk_bytes": disk_use(self.out, self.checkpoint_dir, self.publish_dir),
            "file_bytes": files,
        }
        self.samples.append(sample)
        total = sum(c["rss_bytes"] for c in components.values()) / 2**20
        print(
            f"[long_run] sample at step {done}: total RSS {total:.0f} MiB, disk {sample['disk_bytes']}",
            flush=True,
        )


def growth(first: float, last: float) -> float | None:
    return None if not first else last / first


def summarise(samples: list[dict]) -> dict:
    """Per component RSS / FD ratios (last / first sample) and per file bytes per step."""
    first, last = samples[0], samples[-1]
    components = {}
    for name in sorted(set(first["components"]) & set(last["components"])):
        a, b = first["components"][name], last["components"][name]
        rss, fds = growth(a["rss_bytes"], b["rss_bytes"]), growth(a["open_fds"], b["open_fds"])
        others = growth(a["other_fds"], b["other_fds"])
        sockets = [s["components"][name]["sockets"] for s in samples if name in s["components"]]
        # sockets follow the connections open at the instant: growth is the last sample above
        # every earlier one by more than the tolerance, not the last against the first
        sockets_growing = len(sockets) > 1 and sockets[-1] > (1 + TOLERANCE) * max(sockets[:-1])
        components[name] = {
            "rss_mib": [a["rss_bytes"] / 2**20, b["rss_bytes"] / 2**20], "rss_ratio": rss,
            "open_fds": [a["open_fds"], b["open_fds"]], "fd_ratio": fds,
            "other_fds": [a["other_fds"], b["other_fds"]], "other_fd_ratio": others,
            "sockets": sockets, "sockets_growing": sockets_growing,
            "within_10_percent": all(r is not None and r <= 1 + TOLERANCE for r in (rss, others))
            and not sockets_growing,
        }  # fmt: skip
    files = {}
    for name in first["file_bytes"]:
        per_step = [s["file_bytes"][name] / s["step"] for s in samples]
        ratio = growth(per_step[0], per_step[-1])
        files[name] = {
            "bytes": [s["file_bytes"][name] for s in samples],
            "bytes_per_step": per_step,
            # the growth between the first and last sample, per step (a file's constant part cancels)
            "added_bytes_per_step": (last["file_bytes"][name] - first["file_bytes"][name])
            / (last["step"] - first["step"]),
            "per_step_ratio": ratio,
            "linear": ratio is not None and abs(ratio - 1) <= TOLERANCE,
        }
    return {"components": components, "files": files}


def print_table(samples: list[dict], summary: dict) -> None:
    steps = [s["step"] for s in samples]
    print(
        f"\n{'component':<14}"
        + "".join(f"{f'RSS@{s} MiB':>14}{f'FDs@{s}':>12}" for s in steps)
        + f"{'RSS x':>8}{'FD x':>8}{'other FD x':>12}  sockets growing"
    )
    for name, row in summary["components"].items():
        cells = "".join(
            f"{s['components'][name]['rss_bytes'] / 2**20:>14.0f}"
            f"{str(s['components'][name]['other_fds']) + '+' + str(s['components'][name]['sockets']):>12}"
            for s in samples
        )
        print(f"{name:<14}{cells}{row['rss_ratio']:>8.3f}{row['fd_ratio']:>8.3f}{row['other_fd_ratio']:>12.3f}"
              f"  {row['sockets_growing']}")  # fmt: skip
    print("(FDs: other + sockets; other: files, pipes, event fds; sockets: the connections open at the instant)")
    print(f"\n{'file':<28}" + "".join(f"{f'B/step@{s}':>14}" for s in steps) + f"{'ratio':>8}  linear")
    for name, row in summary["files"].items():
        cells = "".join(f"{b:>14.0f}" for b in row["bytes_per_step"])
        ratio = "-" if row["per_step_ratio"] is None else f"{row['per_step_ratio']:.3f}"
        print(f"{name:<28}{cells}{ratio:>8}  {row['linear']}")
    print(f"\n{'disk (MiB)':<14}" + "".join(f"{f'@{s}':>10}" for s in steps))
    for kind in samples[0]["disk_bytes"]:
        print(f"{kind:<14}" + "".join(f"{s['disk_bytes'][kind] / 2**20:>10.2f}" for s in samples))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--sample-at", default=None, help="comma-separated steps (default: 50 and --steps)")
    parser.add_argument("--rollouts", type=int, default=64, help="rollouts per step (the demo's 64)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("runs/long-run"))
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    sample_at = (
        [int(s) for s in args.sample_at.split(",")] if args.sample_at else [min(50, args.steps), args.steps]
    )
    if (
        len(sample_at) < 2
        or any(s <= 0 or s > args.steps for s in sample_at)
        or len(set(sample_at)) != len(sample_at)
    ):
        parser.error(f"--sample-at {sample_at}: at least two distinct steps in 1..--steps ({args.steps})")
    out = args.out.resolve()
    if (out / "orchestrator_metrics.jsonl").exists():
        parser.error(f"--out {out} holds a run already: a long run starts from an empty directory")
    out.mkdir(parents=True, exist_ok=True)
    model, policy_ckpt, value_ckpt = prepare(out, args.seed, 0, "count")
    ports = [
        f"inference.base_port={free_port()}", f"inference.router_port={free_port()}",
        f"inference.weight_broadcast_port={free_port()}", f"transport.policy_port={free_port()}",
        f"transport.critic_port={free_port()}", f"value.service.port={free_port()}", "logging.console=false",
    ]  # fmt: skip
    config = demo_config(out, "sao", args.steps, args.seed, policy_ckpt, value_ckpt, model,
                         rollouts=args.rollouts, overrides=ports + args.overrides)  # fmt: skip
    config_path = out / "config.yaml"
    config_path.write_text(yaml.safe_dump(config))
    sampler = Sampler(
        out, Path(config["checkpoint"]["dir"]), Path(config["inference"]["publish_dir"]), sample_at
    )
    began = time.monotonic()
    code = run_local(str(config_path), on_tick=sampler)
    seconds = time.monotonic() - began
    if code != 0 or len(sampler.samples) < 2:
        print(
            f"[long_run] the run ended with exit code {code} after {len(sampler.samples)} samples",
            file=sys.stderr,
        )
        return code or 1
    summary = summarise(sampler.samples)
    print_table(sampler.samples, summary)
    first, last = sampler.samples[0], sampler.samples[-1]
    total = [sum(c["rss_bytes"] for c in s["components"].values()) for s in (first, last)]
    path = write_result(
        "long_run", figure=total[1], reference=total[0], ratio=total[1] / total[0],
        params={"steps": args.steps, "sample_at": sample_at, "rollouts": args.rollouts, "seed": args.seed,
                "algorithm": "sao", "overrides": args.overrides, "run_seconds": seconds},
        units="figure/reference: total RSS bytes of the stack at the last/first sample",
        within_10_percent=total[1] / total[0] <= 1 + TOLERANCE and all(
            c["within_10_percent"] for c in summary["components"].values()),
        samples=sampler.samples, **summary,
    )  # fmt: skip
    print(
        f"\n[long_run] total RSS x{total[1] / total[0]:.3f} from step {first['step']} to {last['step']}; {path}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
