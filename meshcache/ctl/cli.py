"""`meshcache`: the command-line entry point. Each area registers its own subcommands."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable

# Modules exposing `register(subparsers)`; each adds subcommands that set `func(args) -> int`.
SUBCOMMAND_MODULES = ("meshcache.mesh.commands", "meshcache.istio.commands")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshcache", description="Mesh-level cache for ML inference traffic")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            continue  # an area not present in this build
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    return func(args)


if __name__ == "__main__":
    sys.exit(main())
