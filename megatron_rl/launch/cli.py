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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron-rl", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser(
        "check-config", help="validate a YAML config and print it resolved (with the derived layout) as JSON"
    )
    check.add_argument("config", help="a YAML config file")
    check.add_argument("--out", help="also write the resolved JSON here")
    check.set_defaults(func=_check_config)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
