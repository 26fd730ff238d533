"""`make bench`: every benchmark, one after another (each writes its section of docs/benchmarks.md).

They run sequentially on purpose: on a 2-core machine, two benchmarks at once measure each other.
"""

from __future__ import annotations

import sys
import time
from types import ModuleType

import bench.affinity
import bench.coalesce
import bench.engine
import bench.filter
import bench.filter_ab
import bench.llm
import bench.mesh
import bench.mesh_hosts
import bench.propagation
import bench.replicas
import bench.semantic_index
import bench.semantic_precision
import bench.stale

BENCHMARKS: tuple[ModuleType, ...] = (bench.filter, bench.filter_ab, bench.engine, bench.propagation, bench.mesh,
                                     bench.mesh_hosts,
                                     bench.replicas, bench.coalesce, bench.affinity, bench.stale, bench.llm,
                                     bench.semantic_precision, bench.semantic_index)


def main() -> int:
    failed = []
    for module in BENCHMARKS:
        name = module.__name__
        print(f"== {name}", flush=True)
        started = time.monotonic()
        saved_argv = sys.argv
        sys.argv = [name]
        try:
            module.main()
        except Exception as exc:  # noqa: BLE001 - report and go on with the others
            failed.append(name)
            print(f"== {name} failed: {exc!r}", flush=True)
        finally:
            sys.argv = saved_argv
        print(f"== {name}: {time.monotonic() - started:.0f} s", flush=True)
    if failed:
        print("failed: " + ", ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
