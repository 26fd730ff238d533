"""Statistics shared by every benchmark: one percentile, one millisecond column format, one
result type for closed-loop runs, a process's CPU time."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

_UNIT_MS = {"us": 0.001, "ms": 1.0, "s": 1000.0}


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest rank: the value at index floor(q * n) of the sorted values (the largest for q = 1)."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def quantiles_ms(values: Sequence[float]) -> list[float]:
    """Latency (seconds in) at 0, 1, ..., 100 % in milliseconds: a distribution small enough to store."""
    return [round(percentile(values, q / 100) * 1e3, 4) for q in range(101)]


def mean_quantiles(runs: Sequence[Sequence[float] | None]) -> list[float] | None:
    """Several runs' distributions (each `quantiles_ms`) as one: the mean at each quantile (the
    runs are rounds of one measurement, of equal length). None if no run has one."""
    have = [r for r in runs if r]
    if not have:
        return None
    return [round(sum(r[i] for r in have) / len(have), 4) for i in range(len(have[0]))]


def ms(seconds: float, digits: int = 2) -> str:
    """A duration in seconds as a milliseconds table cell."""
    return f"{seconds * 1e3:.{digits}f}"


def to_ms(value: str, unit: str) -> float:
    """A load generator's `12.3` + `us`/`ms`/`s` as milliseconds."""
    return float(value) * _UNIT_MS[unit]


@dataclass
class LatencyResult:
    """A closed-loop run: per-request latencies (seconds) over `seconds` of wall time. `requests`
    counts what was served when one call carries several (a batch); default one per latency."""

    latencies: list[float]
    seconds: float
    errors: int = 0
    requests: int | None = None

    @property
    def served(self) -> int:
        return self.requests if self.requests is not None else len(self.latencies)

    @property
    def throughput(self) -> float:
        return self.served / self.seconds

    def percentile(self, q: float) -> float:
        return percentile(self.latencies, q)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used (/proc/<pid>/stat fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
