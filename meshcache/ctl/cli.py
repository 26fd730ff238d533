"""`meshcache`: the command-line entry point. Each area registers its own subcommands."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from meshcache.ctl.istio import commands as istio_commands
from meshcache.ctl.mesh import commands as mesh_commands

# Each module's `register(subparsers)` adds subcommands that set `func(args) -> int`.
AREAS = (mesh_commands, istio_commands)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshcache", description="Mesh-level cache for ML inference traffic")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for area in AREAS:
        area.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    return func(args)


if __name__ == "__main__":
    sys.exit(main())
