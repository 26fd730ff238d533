"""Triton's perf_analyzer, the load tool Triton/KServe users benchmark with, run against the engine
(or anything serving the same protocol, such as the local mesh's app port).

It ships as a binary in the `tritonclient` wheel (installed into the venv's bin/) and needs
`libcudart.so.12` (PyPI `nvidia-cuda-runtime-cu12`) on LD_LIBRARY_PATH even on CPU-only machines,
plus Debian's libb64-0d. `python -m meshcache.engine.perf_analyzer --check` tells whether it runs here.
"""

from __future__ import annotations

import csv
import importlib.util
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path


class PerfAnalyzerError(RuntimeError):
    pass


def binary() -> Path:
    path = Path(sys.executable).parent / "perf_analyzer"
    if not path.is_file():
        raise PerfAnalyzerError(f"{path} is missing: install the dev extra (tritonclient) with scripts/setup.sh")
    return path


def environment() -> dict[str, str]:
    """The process environment with libcudart.so.12's directory on LD_LIBRARY_PATH."""
    spec = importlib.util.find_spec("nvidia.cuda_runtime")
    if spec is None or not spec.submodule_search_locations:
        raise PerfAnalyzerError("nvidia-cuda-runtime-cu12 is not installed (perf_analyzer needs libcudart.so.12)")
    lib = Path(list(spec.submodule_search_locations)[0]) / "lib"
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(lib), env.get("LD_LIBRARY_PATH", "")) if p)
    return env


@dataclass(frozen=True)
class Measurement:
    """One concurrency level of perf_analyzer's CSV (--verbose-csv); latencies in microseconds."""

    concurrency: int
    throughput: float
    p50_us: int
    p99_us: int
    avg_us: int
    server_queue_us: int
    server_compute_infer_us: int


def run(model: str, url: str, protocol: str, concurrency: list[int], extra: list[str] | None = None,
        measurement_ms: int = 2000, timeout: float = 300) -> list[Measurement]:
    """Runs perf_analyzer once per concurrency level (a closed loop of that many synchronous
    callers) and returns its measurements. `protocol` is "grpc" or "http"; `url` is host:port."""
    results = []
    with tempfile.TemporaryDirectory(prefix="perf-analyzer-") as tmp:
        for level in concurrency:
            out = Path(tmp) / f"c{level}.csv"
            argv = [str(binary()), "-m", model, "-u", url, "-i", protocol, "--concurrency-range", str(level),
                    "--measurement-interval", str(measurement_ms),
                    # Shared machines are noisy: its stability check (the last 3 windows within X% of
                    # each other) is effectively off; it reports the average of the last 3 windows.
                    "--stability-percentage", "999", "--max-trials", "10", "-f", str(out), "--verbose-csv",
                    *(extra or [])]
            result = subprocess.run(argv, env=environment(), capture_output=True, text=True, timeout=timeout)
            if result.returncode != 0 or not out.exists():
                raise PerfAnalyzerError(f"perf_analyzer exited with {result.returncode}:\n"
                                        f"{(result.stdout + result.stderr)[-3000:]}")
            with out.open() as f:
                results += [Measurement(int(r["Concurrency"]), float(r["Inferences/Second"]), int(r["p50 latency"]),
                                        int(r["p99 latency"]), int(r["Avg latency"]), int(r["Server Queue"]),
                                        int(r["Server Compute Infer"])) for r in csv.DictReader(f)]
    return results


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args != ["--check"]:
        print("usage: python -m meshcache.engine.perf_analyzer --check", file=sys.stderr)
        return 2
    try:
        result = subprocess.run([str(binary()), "--version"], env=environment(), capture_output=True, text=True,
                                timeout=30)
    except PerfAnalyzerError as exc:
        print(exc, file=sys.stderr)
        return 1
    print((result.stdout + result.stderr).strip())
    return 0 if result.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
