"""The `megatron-rl` command line."""

from __future__ import annotations

import argparse
import sys

from megatron_rl.config import ConfigError, load_config


def _check_config(args: argparse.Namespace) -> int:
    try:
        resolved = load_config(args.config)
    except ConfigError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    text = resolved.to_json()
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)
    return 0


def _train_policy(args: argparse.Namespace) -> int:
    import logging

    import megatron_rl.compat  # noqa: F401  (before megatron-core)
    from megatron_rl.config import load_resolved
    from megatron_rl.trainer.policy import run_policy

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        resolved = load_resolved(args.config)
    except ConfigError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    run_policy(resolved)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron-rl", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser(
        "check-config", help="validate a YAML config and print it resolved (with the derived layout) as JSON"
    )
    check.add_argument("config", help="a YAML config file")
    check.add_argument("--out", help="also write the resolved JSON here")
    check.set_defaults(func=_check_config)
    policy = commands.add_parser(
        "train-policy", help="the policy trainer (run under torchrun on the policy's ranks)"
    )
    policy.add_argument("--config", required=True, help="resolved config JSON (check-config --out)")
    policy.set_defaults(func=_train_policy)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
