"""`meshcache`: the command-line entry point. Each area registers its own subcommands.

Stop signals (meshcache/ctl/interrupts.py) are handled from main's first line: the areas'
imports take a quarter of a second (seconds on a busy machine), and a Ctrl-C in them used to end
in a traceback. Every command ends on one with status 130 and one line; `up` stops what it started.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from types import ModuleType

from meshcache.ctl.interrupts import INTERRUPTED, stop_signals_interrupt


def _areas() -> tuple[ModuleType, ...]:
    # Imported here, not at the top: only once main's handlers are in place.
    from meshcache.ctl.istio import commands as istio_commands
    from meshcache.ctl.mesh import commands as mesh_commands

    # Each module's `register(subparsers)` adds subcommands that set `func(args) -> int`.
    return (mesh_commands, istio_commands)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshcache", description="Mesh-level cache for ML inference traffic")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for area in _areas():
        area.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    with stop_signals_interrupt():
        try:
            args = build_parser().parse_args(argv)
            func: Callable[[argparse.Namespace], int] = args.func
            return func(args)
        except KeyboardInterrupt as exc:
            print(f"meshcache: interrupted ({exc or 'SIGINT'})", file=sys.stderr)
            return INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
