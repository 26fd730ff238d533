"""Run wrk (HTTP/1.1) and h2load (HTTP/2, gRPC) and parse what they report."""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from bench.stats import percentile, to_ms


@dataclass
class LoadResult:
    rps: float
    p50_ms: float | None
    p99_ms: float | None
    mean_ms: float | None
    errors: int
    requests: int


def require(tool: str) -> str:
    path = shutil.which(tool)
    if not path:
        raise SystemExit(f"{tool} not found: run `make setup` (Debian packages wrk, nghttp2-client)")
    return path


def wrk(url: str, script: Path, seconds: int = 5, connections: int = 16) -> LoadResult:
    out = subprocess.run(
        [require("wrk"), "-t1", f"-c{connections}", f"-d{seconds}s", "--latency", "-s", str(script), url],
        capture_output=True, text=True, timeout=seconds + 60, check=True,
    ).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    pct = {m[0]: to_ms(m[1], m[2]) for m in re.findall(r"^\s+(50|99)%\s+([\d.]+)(us|ms|s)\s*$", out, re.M)}
    mean = re.search(r"Latency\s+([\d.]+)(us|ms|s)", out)
    total = int(re.search(r"(\d+) requests in", out).group(1))  # type: ignore[union-attr]
    errors = 0
    if m := re.search(r"Non-2xx or 3xx responses: (\d+)", out):
        errors += int(m.group(1))
    if m := re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out):
        errors += sum(int(g) for g in m.groups())
    return LoadResult(rps, pct.get("50"), pct.get("99"), to_ms(*mean.groups()) if mean else None, errors, total)


def h2load(url: str, data: Path, headers: list[str], seconds: int = 5, connections: int = 16,
           streams: int = 1, log_file: Path | None = None) -> LoadResult:
    """With `log_file`, p50/p99 come from h2load's per-request log (it prints no percentiles)."""
    argv = [require("h2load"), "-c", str(connections), "-m", str(streams), "-t", "1", "-D", str(seconds),
            "-d", str(data)]
    if log_file is not None:
        log_file.unlink(missing_ok=True)  # h2load appends to an existing log
        argv.append(f"--log-file={log_file}")
    for h in headers:
        argv += ["-H", h]
    out = subprocess.run(argv + [url], capture_output=True, text=True, timeout=seconds + 60, check=True).stdout
    rps = float(re.search(r"finished in [\d.]+\w+, ([\d.]+) req/s", out).group(1))  # type: ignore[union-attr]
    req = re.search(r"requests: (\d+) total, \d+ started, \d+ done, (\d+) succeeded, (\d+) failed, (\d+) errored", out)
    total, ok = int(req.group(1)), int(req.group(2))  # type: ignore[union-attr]
    status = re.search(r"status codes: (\d+) 2xx, (\d+) 3xx, (\d+) 4xx, (\d+) 5xx", out)
    bad = int(status.group(3)) + int(status.group(4)) if status else 0
    mean = re.search(r"time for request:\s+\S+\s+\S+\s+([\d.]+)(us|ms|s)", out)
    p50 = p99 = None
    if log_file is not None:
        done = sorted(int(cols[2]) / 1000 for line in log_file.read_text().splitlines()
                      if len(cols := line.split("\t")) >= 3 and cols[1] != "-1")
        if done:
            p50, p99 = percentile(done, 0.5), percentile(done, 0.99)
    return LoadResult(rps, p50, p99, to_ms(*mean.groups()) if mean else None, (total - ok) + bad, total)
