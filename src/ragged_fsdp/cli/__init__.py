"""`python -m ragged_fsdp <subcommand>`: each subcommand lives in its own module and
registers itself through ``add_parser(subparsers)`` and ``run(args)``."""
from __future__ import annotations

import argparse
import importlib
import sys

from ._args import UsageError

# subcommand name -> module under ragged_fsdp.cli
SUBCOMMANDS = {"plan": "plan", "demo": "demo", "bench": "bench", "ckpt": "ckpt", "simulate": "simulate"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ragged_fsdp", description=__doc__.split(":")[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    modules = {}
    for name, mod in SUBCOMMANDS.items():
        modules[name] = importlib.import_module(f"ragged_fsdp.cli.{mod}")
        modules[name].add_parser(sub)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return int(modules[args.command].run(args) or 0)
    except UsageError as e:
        # exit code 2 as argparse; Python prints nothing for an integer code, so the line is ours
        print(f"{args.command}: error: {e}", file=sys.stderr)
        raise
