"""The `megatron-rl` command line."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from megatron_rl.config import ConfigError, InferenceConfig, LoggingConfig, load_config, load_resolved
from megatron_rl.launch.preflight import REGISTRY as PREFLIGHT_CHECKS
from megatron_rl.launch.preflight.flags import add_network_flag


def configure_logging(logging_config: LoggingConfig) -> None:
    """Every process of a run logs at `logging.level`, one format."""
    logging.basicConfig(level=logging_config.level, format="%(asctime)s %(name)s %(message)s", force=True)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise


def _check_config(args: argparse.Namespace) -> int:
    if args.explain is not None:
        return _explain(args.explain)
    if args.config is None:
        print("check-config: give a config file (or --explain KEY)", file=sys.stderr)
        return 2
    try:
        resolved = load_config(args.config, args.set)
    except ConfigError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    from megatron_rl.config.memory_plan import format_plan, memory_plan

    text = resolved.to_json()
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)
    print(format_plan(resolved, memory_plan(resolved)), file=sys.stderr)  # stdout stays JSON
    return 0


def _explain(key: str) -> int:
    from megatron_rl.config.reference import UnknownKey, explain

    try:
        print(explain(key))
    except UnknownKey as exc:
        print(f"check-config --explain: {exc}", file=sys.stderr)
        return 2
    return 0


def _config_reference(args: argparse.Namespace) -> int:
    from megatron_rl.config.reference import missing, render

    gaps = missing()
    if gaps:  # the page would have empty entries: every key needs a description
        print("config-reference: the models lack\n" + "\n".join(f"  - {g}" for g in gaps), file=sys.stderr)
        return 2
    text = render()
    if args.out:
        from pathlib import Path

        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


def _run_role(args: argparse.Namespace, role: str) -> int:
    import megatron_rl.compat  # noqa: F401  (before megatron-core)

    try:
        resolved = load_resolved(args.config)
    except ConfigError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    configure_logging(resolved.logging)
    if role == "policy":
        from megatron_rl.policy.trainer import run_policy

        run_policy(resolved)
    elif role == "teacher":
        from megatron_rl.teacher.worker import run_teacher

        if resolved.distillation is None or resolved.distillation.teacher.megatron is None:
            print(f"{args.config}: the config has no Megatron teacher (distillation.teacher.megatron), so there is "
                  "no teacher to run", file=sys.stderr)  # fmt: skip
            return 2
        run_teacher(resolved)
    else:
        from megatron_rl.critic.worker import run_critic

        if resolved.value is None:
            print(
                f"{args.config}: the config has no value section, so there is no critic to run",
                file=sys.stderr,
            )
            return 2
        run_critic(resolved)
    return 0


def _orchestrate(args: argparse.Namespace) -> int:
    try:
        resolved = load_resolved(args.config)
    except ConfigError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    configure_logging(resolved.logging)
    from megatron_rl.inference.pool import InferencePool
    from megatron_rl.orchestrator.loop import OrchestratorError
    from megatron_rl.orchestrator.run import attach_pool, orchestrate

    if args.start_inference:
        devices = _inference_devices(resolved.inference, args.inference_devices)
        pool = InferencePool.from_config(resolved, devices, f"{resolved.logging.dir}/logs")
    else:
        pool = attach_pool(resolved)
    try:
        asyncio.run(orchestrate(resolved, pool))
    except OrchestratorError as exc:
        print(f"orchestrator: {exc}", file=sys.stderr)
        return 1
    finally:
        pool.stop()
    return 0


def _inference_devices(inference: InferenceConfig, spec: str | None) -> list[list[str]]:
    """Device ids per server from '2,5;7,0'; on CPU (no spec) a "GPU" is a process: `inference.tp`
    of them for each of `inference.num_servers`."""
    if spec:
        return [group.split(",") for group in spec.split(";")]
    return [["cpu"] * inference.tp for _ in range(inference.num_servers)]


def _eval(args: argparse.Namespace) -> int:
    from megatron_rl.config import load_config

    try:
        resolved = load_config(args.config, args.set)
    except ConfigError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    configure_logging(resolved.logging)
    import time

    from megatron_rl.conversion.checkpoint_io import CheckpointError
    from megatron_rl.conversion.hf_mapping import ConversionError
    from megatron_rl.inference.pool import InferencePool, served_model_dir
    from megatron_rl.models.tokenizer import load_tokenizer
    from megatron_rl.orchestrator.chat import ChatTemplateError
    from megatron_rl.orchestrator.eval_only import (
        EvalError,
        check_sets,
        eval_model_dir,
        evaluate,
        write_metrics,
    )
    from megatron_rl.orchestrator.run import attach_pool

    try:
        check_sets(resolved.orchestrator)
        if args.attach and (args.model or args.checkpoint):
            raise EvalError("--attach evaluates what the running servers serve; --model and --checkpoint start servers")
        if args.attach:
            model_dir, label = served_model_dir(resolved), "the running servers"
        else:
            model_dir, label = eval_model_dir(resolved, args.model, args.checkpoint)
    except (EvalError, CheckpointError, ConversionError, ValueError) as exc:
        print(f"eval: {exc}", file=sys.stderr)
        return 2
    try:
        tokenizer = load_tokenizer(model_dir, resolved.model.trust_remote_code)
    except ValueError as exc:  # TokenizerError: a directory whose tokenizer is code, the key off
        print(f"eval: {exc}", file=sys.stderr)
        return 2
    if args.attach:
        pool = attach_pool(resolved)
    else:
        devices = _inference_devices(resolved.inference, args.inference_devices)
        pool = InferencePool.from_config(
            resolved, devices, f"{resolved.logging.dir}/logs", model_dir=model_dir
        )
    try:
        started = time.monotonic()
        results = asyncio.run(evaluate(resolved, pool.router_url, pool.model_name, pool.worker_urls, tokenizer))
    except (ChatTemplateError, ValueError) as exc:
        print(f"eval: {exc}", file=sys.stderr)
        return 2
    finally:
        pool.stop()
    path = write_metrics(resolved.logging, label, results, time.monotonic() - started)
    width = max(len(key) for key in results)
    print(f"eval of {label}:")
    for key, value in results.items():
        print(f"  {key:<{width}}  {value}")
    print(f"appended to {path}")
    failed = [key for key in results if key.endswith("/error")]
    return 1 if failed else 0


def _export_lora(args: argparse.Namespace) -> int:
    try:
        resolved = load_config(args.config, args.set)
    except ConfigError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    from pathlib import Path

    import megatron_rl.compat  # noqa: F401  (before megatron-core)

    from megatron_rl.conversion.checkpoint_io import CheckpointError
    from megatron_rl.conversion.hf_mapping import ConversionError
    from megatron_rl.trainer.atomic_dir import latest
    from megatron_rl.transforms.lora_export import export_lora

    step_dir = Path(args.checkpoint)
    if not (step_dir / "meta.json").is_file():  # a role's checkpoint directory: its newest step
        found = latest(step_dir, "meta.json") if step_dir.is_dir() else None
        if found is None:
            print(f"export-lora: {step_dir}: neither a checkpoint step directory (meta.json) nor a directory of "
                  "complete steps", file=sys.stderr)  # fmt: skip
            return 2
        step_dir = found
    try:
        for line in export_lora(resolved, step_dir, args.out, merged=args.merged):
            print(line)
    except (CheckpointError, ConversionError, ValueError, OSError) as exc:
        print(f"export-lora: {exc}", file=sys.stderr)
        return 2
    return 0


def _run(args: argparse.Namespace) -> int:
    from megatron_rl.launch.local import LaunchError, run_local

    try:
        return run_local(args.config, dry_run=args.dry_run, overrides=args.set)
    except (ConfigError, LaunchError) as exc:
        print(str(exc), file=sys.stderr)
        return 2


def _plot(args: argparse.Namespace) -> int:
    from megatron_rl.demo.plot import main as plot_main  # matplotlib: seconds to import

    return plot_main(args.rest)


def _slurm(args: argparse.Namespace) -> int:
    from megatron_rl.launch.slurm import SlurmError, render_and_submit

    try:
        return render_and_submit(args.config, args.out, args.submit, args.partition, args.time)
    except (ConfigError, SlurmError) as exc:
        print(str(exc), file=sys.stderr)
        return 2


def _preflight(args: argparse.Namespace) -> int:
    from megatron_rl.launch.preflight import context_for, run_checks

    if args.list:
        for check in PREFLIGHT_CHECKS:
            print(f"{check.name:<13} {check.limit_s:>3} s  {check.shows}")
        return 0
    if args.config is None:
        print("preflight: give a config file (or --list)", file=sys.stderr)
        return 2
    try:
        resolved = load_config(args.config, args.set)
    except ConfigError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    if args.slurm:
        from pathlib import Path

        from megatron_rl.launch.preflight import sbatch
        from megatron_rl.launch.slurm import SlurmError, write_and_submit

        try:
            script = sbatch.render(resolved, Path(args.config), args.set, args.partition, args.time, only=args.only,
                                   network_gbytes_per_s=args.network_gbytes_per_s)
        except SlurmError as exc:
            print(str(exc), file=sys.stderr)
            return 2
        what = f"preflight on {resolved.deployment.nodes} node(s)"
        return write_and_submit(resolved.logging, script, args.out, "preflight.sbatch", what, args.submit)
    context = context_for(resolved, cpu=args.cpu, inference_url=args.inference_url)
    print(f"preflight of {args.config} on {context.backend} ({'CUDA' if context.cuda else 'CPU: the gloo twins'})")
    results = run_checks(context, args.only, echo=lambda line: print(line, flush=True))
    failed = [r.name for r in results if r.status == "FAIL"]
    print(f"{len(results) - len(failed)} of {len(results)} checks did not fail" + (f"; FAIL: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


def _job_step(args: argparse.Namespace) -> int:
    from megatron_rl.launch import job_steps

    try:
        resolved = load_resolved(args.config)
    except ConfigError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    configure_logging(resolved.logging)
    if args.command == "inference-server":
        job_steps.exec_inference_server(resolved, args.index, args.service)
    elif args.command == "router":
        job_steps.exec_router(resolved, args.service)
    return job_steps.wait_inference(resolved)


def _add_set(command: argparse.ArgumentParser) -> None:
    command.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a key (dotted path, YAML value; repeatable), e.g. transport.host=10.0.0.5",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron-rl", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser(
        "check-config", help="validate a YAML config and print it resolved (with the derived layout) as JSON"
    )
    check.add_argument("config", nargs="?", help="a YAML config file")
    check.add_argument("--out", help="also write the resolved JSON here")
    _add_set(check)
    check.add_argument(
        "--explain", metavar="KEY",
        help="print one key's entry of the configuration reference (type, default, range, description, "
        "rules), e.g. orchestrator.dynamic_sampling.max_extra_groups; no config needed",
    )  # fmt: skip
    check.set_defaults(func=_check_config)
    reference = commands.add_parser(
        "config-reference",
        help="the configuration reference (every key, its type, default, range and description; the "
        "cross-field rules), generated from the config models, as Markdown",
    )
    reference.add_argument("--out", help="write it here (e.g. docs/reference/configuration.md); default: stdout")
    reference.set_defaults(func=_config_reference)
    roles = {
        "train-policy": ("policy", "the policy trainer (run under torchrun on the policy's ranks)"),
        "critic": ("critic", "the critic: scoring service on rank 0 plus value training from ZMQ (run under "
                   "torchrun on the critic's ranks; stops on SIGTERM/SIGINT)"),
        "teacher": ("teacher", "the Megatron teacher of distillation (distillation.teacher.megatron): forward-only "
                    "log-probabilities behind an HTTP service on rank 0 (run under torchrun on the teacher's ranks; "
                    "stops on SIGTERM/SIGINT)"),
    }  # fmt: skip
    for command, (role, text) in roles.items():
        role_parser = commands.add_parser(command, help=text)
        role_parser.add_argument("--config", required=True, help="resolved config JSON (check-config --out)")
        role_parser.set_defaults(func=lambda a, role=role: _run_role(a, role))
    orchestrate = commands.add_parser(
        "orchestrate",
        help="the orchestrator: rollouts through the inference pool, TrainSink, scoring, the critic and policy "
        "grids, weight sync (one process, asyncio)",
    )
    orchestrate.add_argument("--config", required=True, help="resolved config JSON (check-config --out)")
    orchestrate.add_argument(
        "--start-inference", action="store_true",
        help="start the vLLM servers and the router here (default: attach to running ones)",
    )  # fmt: skip
    orchestrate.add_argument(
        "--inference-devices", default=None,
        help="device ids per server, e.g. '2,5;7,0' (GPU; default on CPU: one process per server)",
    )  # fmt: skip
    orchestrate.set_defaults(func=_orchestrate)
    evaluate = commands.add_parser(
        "eval",
        help="the config's evaluation sets (orchestrator.eval) on one model, without training: the config's "
        "model, an HF directory (--model) or a policy checkpoint step (--checkpoint); metrics to "
        "LOGGING_DIR/eval_metrics.jsonl",
    )
    evaluate.add_argument("config", help="a YAML config file")
    evaluate.add_argument("--model", default=None, help="an HF directory to evaluate (weights, config, tokenizer)")
    evaluate.add_argument(
        "--checkpoint", default=None, metavar="latest|STEP|DIR",
        help="a step of the run's policy checkpoints (checkpoint.dir/policy), converted to HF first",
    )  # fmt: skip
    evaluate.add_argument("--attach", action="store_true", help="use the running servers and router as they are")
    evaluate.add_argument("--inference-devices", default=None, help="device ids per server, e.g. '2,5;7,0'")
    _add_set(evaluate)
    evaluate.set_defaults(func=_eval)
    run = commands.add_parser(
        "run",
        help="the whole system on one machine: inference servers and router, critic, policy, orchestrator "
        "(first failure stops all; Ctrl-C is clean)",
    )
    run.add_argument("config", help="a YAML config file")
    run.add_argument(
        "--dry-run", action="store_true", help="print every command, device set, port and log path"
    )
    _add_set(run)
    run.set_defaults(func=_run)
    export = commands.add_parser(
        "export-lora",
        help="a LoRA training checkpoint (adapters + the base's identity) as a PEFT adapter directory "
        "(adapter_config.json, adapter_model.safetensors), or with --merged as HF weights with the adapters folded in",
    )
    export.add_argument("checkpoint", help="a checkpoint step directory (e.g. CHECKPOINT_DIR/policy/step_00000009), or "
                        "a role's checkpoint directory (its newest complete step)")  # fmt: skip
    export.add_argument("--config", required=True, help="the run's YAML config (its lora, base model.checkpoint, HF files)")
    export.add_argument("--out", required=True, help="the directory to write (must not exist or be empty)")
    export.add_argument("--merged", action="store_true", help="merged HF weights W + (alpha / rank) B A under plain HF "
                        "names, with config and tokenizer files, instead of the PEFT adapter")  # fmt: skip
    _add_set(export)
    export.set_defaults(func=_export_lora)
    plot = commands.add_parser(
        "plot", help="figure and summary of one or several runs (overlaid)", add_help=False
    )
    plot.add_argument("rest", nargs=argparse.REMAINDER)
    plot.set_defaults(func=_plot)
    slurm = commands.add_parser("slurm", help="render (and optionally submit) the sbatch script of a config")
    slurm.add_argument("config", help="a YAML config file")
    slurm.add_argument("--out", help="write the script here (default: LOGGING_DIR/job.sbatch)")
    slurm.add_argument("--submit", action="store_true", help="sbatch the rendered script")
    slurm.add_argument("--partition", default=None)
    slurm.add_argument("--time", default=None, help="SLURM time limit, e.g. 24:00:00")
    slurm.set_defaults(func=_slurm)
    preflight = commands.add_parser(
        "preflight",
        help="check this allocation before a long job: versions, TE, ports, memory, collectives over the layout's "
        "groups, a forward/backward of the layer spec, a weight update into vLLM; one PASS/FAIL/NOT RUN line each, "
        "exit 1 on any FAIL",
    )
    preflight.add_argument("config", nargs="?", help="a YAML config file")
    _add_set(preflight)
    preflight.add_argument("--cpu", action="store_true", help="the gloo twins on the CPU even where CUDA is present")
    preflight.add_argument("--only", nargs="+", metavar="CHECK", choices=[check.name for check in PREFLIGHT_CHECKS],
                           help="run these checks only (--list names them)")  # fmt: skip
    preflight.add_argument("--list", action="store_true", help="the checks, their limits and what each shows")
    preflight.add_argument(
        "--inference-url", default=None, metavar="URL",
        help="a running vLLM server of the config's model (http://HOST:PORT) for the weight-update check",
    )  # fmt: skip
    preflight.add_argument("--slurm", action="store_true", help="render an sbatch script that runs preflight on "
                           "every node of the config's allocation, then each training role's collectives across the "
                           "nodes it spans (LOGGING_DIR/preflight.sbatch)")  # fmt: skip
    add_network_flag(preflight, help="with --slurm: the inter-node network's nominal bandwidth per GPU in gigabytes "
                     "per second (GB/s: 50 for one 400 Gb/s NIC per GPU); groups across nodes below 20%% of it FAIL "
                     "(default: printed, not judged)")  # fmt: skip
    preflight.add_argument("--out", help="with --slurm: write the script here")
    preflight.add_argument("--submit", action="store_true", help="with --slurm: sbatch the script")
    preflight.add_argument("--partition", default=None, help="with --slurm")
    preflight.add_argument("--time", default=None, help="with --slurm: SLURM time limit")
    preflight.set_defaults(func=_preflight)
    for name, text in [("inference-server", "one vLLM server of the config (a SLURM job step; execs vLLM)"),
                       ("router", "vllm-router over the config's servers (a SLURM job step; execs the router)"),
                       ("wait-inference", "wait until every inference server serves the model")]:  # fmt: skip
        step = commands.add_parser(name, help=text)
        step.add_argument("--config", required=True, help="resolved config JSON")
        if name == "inference-server":
            step.add_argument("--index", type=int, required=True)
        if name in ("inference-server", "router"):
            step.add_argument("--service", choices=["teacher", "judge"], default=None,
                              help="a model the run serves beside the policy (default: the policy's inference)")  # fmt: skip
        step.set_defaults(func=_job_step)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
