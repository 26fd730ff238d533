"""Run wrk (HTTP/1.1) and h2load (HTTP/2, gRPC) and parse what they report.

Both also give each run's latency distribution (`quantiles_ms`: 0, 1, ..., 100 %): wrk from its
own latency histogram (every request is recorded there; a `done()` hook appended to the caller's
script prints it), h2load from its per-request log.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from bench.stats import percentile, quantiles_ms, to_ms


@dataclass
class LoadResult:
    rps: float
    p50_ms: float | None
    p99_ms: float | None
    mean_ms: float | None
    errors: int
    requests: int
    quantiles_ms: list[float] | None = None


# Appended to a wrk script: prints wrk's recorded latency distribution (microseconds) at its end.
_WRK_QUANTILES = """
function done(summary, latency, requests)
  local q = {}
  for p = 0, 100 do
    local v = latency.min
    if p == 100 then v = latency.max elseif p > 0 then v = latency:percentile(p) end
    q[#q + 1] = string.format("%d", v)
  end
  io.write("meshcache-quantiles-us " .. table.concat(q, ",") .. "\\n")
end
"""


def require(tool: str) -> str:
    path = shutil.which(tool)
    if not path:
        raise SystemExit(f"{tool} not found: run `make setup` (Debian packages wrk, nghttp2-client)")
    return path


def wrk(url: str, script: Path, seconds: int = 5, connections: int = 16) -> LoadResult:
    text = script.read_text()
    if "function done" in text:
        raise ValueError(f"{script}: defines done(); the latency distribution hook needs it")
    with tempfile.NamedTemporaryFile("w", suffix=".lua", prefix="wrk-", delete=False) as f:
        f.write(text + _WRK_QUANTILES)
    try:
        out = subprocess.run(
            [require("wrk"), "-t1", f"-c{connections}", f"-d{seconds}s", "--latency", "-s", f.name, url],
            capture_output=True, text=True, timeout=seconds + 60, check=True,
        ).stdout
    finally:
        Path(f.name).unlink(missing_ok=True)
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    pct = {m[0]: to_ms(m[1], m[2]) for m in re.findall(r"^\s+(50|99)%\s+([\d.]+)(us|ms|s)\s*$", out, re.M)}
    mean = re.search(r"Latency\s+([\d.]+)(us|ms|s)", out)
    total = int(re.search(r"(\d+) requests in", out).group(1))  # type: ignore[union-attr]
    errors = 0
    if m := re.search(r"Non-2xx or 3xx responses: (\d+)", out):
        errors += int(m.group(1))
    if m := re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out):
        errors += sum(int(g) for g in m.groups())
    q = re.search(r"^meshcache-quantiles-us ([\d,]+)$", out, re.M)
    quantiles = [int(v) / 1000 for v in q.group(1).split(",")] if q else None
    return LoadResult(rps, pct.get("50"), pct.get("99"), to_ms(*mean.groups()) if mean else None, errors, total,
                      quantiles)


def h2load(url: str, data: Path, headers: list[str], seconds: int = 5, connections: int = 16,
           streams: int = 1, log_file: Path | None = None) -> LoadResult:
    """p50/p99 and the distribution come from h2load's per-request log (it prints no
    percentiles), kept at `log_file` if given, else in a temporary file."""
    if log_file is None:
        with tempfile.TemporaryDirectory(prefix="h2load-") as tmp:
            return h2load(url, data, headers, seconds, connections, streams, Path(tmp) / "requests.log")
    argv = [require("h2load"), "-c", str(connections), "-m", str(streams), "-t", "1", "-D", str(seconds),
            "-d", str(data)]
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
    p50 = p99 = quantiles = None
    done = sorted(int(cols[2]) / 1000 for line in log_file.read_text().splitlines()
                  if len(cols := line.split("\t")) >= 3 and cols[1] != "-1")
    if done:
        p50, p99 = percentile(done, 0.5), percentile(done, 0.99)
        quantiles = quantiles_ms([x / 1000 for x in done])
    return LoadResult(rps, p50, p99, to_ms(*mean.groups()) if mean else None, (total - ok) + bad, total,
                      quantiles)
