"""Filter throughput, side by side in one run (`python -m bench.filter`).

For 1 KiB, 64 KiB, 1 MiB and 8 MiB answers: Envoy proxying to a trivial origin without the
filter, the same Envoy config with the cache on misses and on hits in both hosts (the Wasm
filter Istio loads, `filter/dist/meshcache_filter.wasm`, and the Envoy dynamic module,
`filter/dist/libmeshcache_native.so`), and two anchors: nginx `proxy_cache` POST hits (outside
Envoy) and Envoy's own C++ cache filter (simple_http_cache) serving GET hits of the same answer
(inside Envoy: what a cache in Envoy can reach without POST keying; 1 KiB and 64 KiB). HTTP/1.1
with wrk, gRPC with h2load. Every HTTP mode uses the same wrk script shape (a Lua `request()`
that builds each body; only whether the body changes per request differs), since a per-request
script is itself slower than a fixed body. gRPC hits are the single-pass design, with held
request headers and (Istio's WasmPlugin mode) without. 1 MiB and 8 MiB misses are streamed
(larger than a miss holds back). Modes run interleaved in rounds; the table shows the mean of
the rounds. The trivial origin is nginx answering every POST with a static file (for gRPC: a
framed message with a `grpc-status: 0` trailer), so the proxy, not the origin, is what is
measured. Envoy runs with one worker and nginx with one worker process, the load generator with
one thread: one core each on this 2-core machine. Besides req/s each Envoy mode records the
Envoy process's CPU time per request (user + system), which moves less with the machine's other
load than throughput does. Misses use bodies no earlier round sent (each round's counter starts
past the last one's), so a miss row never measures hits.

Request-id rows (issue 17): KServe clients send a fresh `id` per call, which the key leaves out
and hits put back. "misses, request ids": every request has new inputs and a new id (the answer
is scanned for an echoed id before it is stored). "hits, request ids": the same inputs with a new
id per request, served from an entry whose answer echoed the id (`"id":"warm"`), so every hit
splices the caller's id in. gRPC: h2load repeats one body, so its id is fixed ("bench", which the
origin echoes); the filter's work per request is the same for any id.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from bench.loadgen import LoadResult, h2load, wrk
from bench.report import publish, table
from bench.stats import cpu_seconds, mean_quantiles
from meshcache.contract.headers import CACHE_STATUS_HEADER
from meshcache.contract.paths import require_filter_native, require_filter_wasm
from meshcache.ctl import launchers, procs
from meshcache.ctl.envoy_config import CacheProxy, write
from tests.helpers.kserve import MODEL_INFER

PIDS: dict[tuple[str, str], int] = {}  # (answer size, envoy name) -> pid, for profiling
CACHE_HOSTS = ("Wasm", "native")  # the mode prefixes whose rows show the cache's counters
REQUEST_JSON = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 32], "data": list(range(32))}]})

FIXED_BODY = '{"n": 0, "x": [[' + REQUEST_JSON + ']]}'  # what REQUEST_LUA sends with vary=0
# One script shape for every HTTP mode: `v` is the per-request counter (every request differs:
# misses) or 0 (every request is the same: hits, and the baselines).
REQUEST_LUA = """local n = 0
request = function()
  n = n + 1
  local v = {vary}
  return wrk.format("POST", nil, {{["Content-Type"] = "application/json"}}, '{{"n": ' .. v .. ', "x": [[{body}]]}}')
end
"""
# New inputs and a new request id every time: misses that carry ids (counting from `start`).
UNIQUE_ID_LUA = """local n = {start}
request = function()
  n = n + 1
  return wrk.format("POST", nil, {{["Content-Type"] = "application/json"}},
                    '{{"id": "req-' .. n .. '", "n": ' .. n .. ', "x": [[{body}]]}}')
end
"""
# The same inputs with a new request id every time: hits whose answers get the caller's id.
NEW_ID_LUA = """local n = 0
request = function()
  n = n + 1
  return wrk.format("POST", nil, {{["Content-Type"] = "application/json"}}, '{{"id": "req-' .. n .. '", {rest}')
end
"""

# One nginx worker, no access log, long keep-alive: the start of both origins' configs.
NGINX_HEAD = """worker_processes 1;
user root;
daemon off;
pid {dir}/nginx.pid;
error_log {dir}/nginx-error.log warn;
events {{ worker_connections 1024; }}
http {{
  access_log off;
  keepalive_requests 1000000;
"""
NGINX_CONF = NGINX_HEAD + """  client_body_buffer_size 128k;
  proxy_cache_path {dir}/cache levels=1:2 keys_zone=bench:16m max_size=512m inactive=60m use_temp_path=off;
  server {{
    listen 127.0.0.1:{http_port};
    location / {{ error_page 405 =200 /static/reply.json; return 405; }}
    # An answer that echoes the request id "warm", as a KServe server would for that request.
    location /v2/models/bench-id/ {{ error_page 405 =200 /static/reply-id.json; return 405; }}
    location /static/ {{ internal; root {dir}; default_type application/json; }}
  }}
  server {{
    listen 127.0.0.1:{grpc_port} http2;
    http2_max_requests 1000000;
    location / {{ error_page 405 =200 /static/reply.grpc; return 405; }}
    location /static/ {{ internal; root {dir}; default_type application/grpc; add_trailer grpc-status 0 always; }}
  }}
  server {{
    listen 127.0.0.1:{cache_port};
    location / {{
      proxy_pass http://127.0.0.1:{http_port};
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_cache bench;
      proxy_cache_methods POST;
      proxy_cache_key "$request_uri|$request_body";
      proxy_cache_valid 200 60m;
      add_header X-Cache $upstream_cache_status;
    }}
  }}
}}
"""

# The in-Envoy anchor's origin: the same answer file to GET, with Cache-Control so that Envoy's
# cache filter stores it (the main origin answers without it).
ANCHOR_NGINX_CONF = NGINX_HEAD + """  server {{
    listen 127.0.0.1:{port};
    location / {{ add_header Cache-Control "max-age=3600"; default_type application/json;
                 root {static}; rewrite ^ /reply.json break; }}
  }}
}}
"""
GET_LUA = """request = function()
  return wrk.format("GET", nil, nil, nil)
end
"""
ENVOY_CACHE_FILTER = {
    "name": "envoy.filters.http.cache",
    "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.cache.v3.CacheConfig",
        "typed_config": {"@type": "type.googleapis.com/envoy.extensions.http.cache.simple_http_cache.v3."
                                  "SimpleHttpCacheConfig"},
    },
}


GRPC_ID = b"\x1a\x05bench"  # ModelInferRequest/ModelInferResponse id (field 3) "bench"


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def grpc_reply(size: int) -> bytes:
    """A framed protobuf message (id "bench", field 5 bytes) whose frame is `size` bytes in all."""
    room = size - 5 - len(GRPC_ID) - 1  # the payload and its length varint
    payload_len = next(n for n in range(room, 0, -1) if n + len(_varint(n)) == room)
    message = GRPC_ID + b"\x2a" + _varint(payload_len) + bytes(i % 251 for i in range(payload_len))
    return b"\x00" + len(message).to_bytes(4, "big") + message


def infer_request(model: str, with_id: bool = True) -> bytes:
    message = b"\x0a" + bytes([len(model)]) + model.encode() + (GRPC_ID if with_id else b"")
    return b"\x00" + len(message).to_bytes(4, "big") + message


@dataclass
class Row:
    protocol: str
    size: str
    mode: str
    result: LoadResult
    check: str
    rounds_rps: list[float] | None = None  # each round's req/s, in round order
    cpu_us: float | None = None  # the Envoy's CPU µs per request (None: not an Envoy)


def start_origin(d: Path, started: list[procs.Proc], size: int = 1024) -> dict[str, int]:
    """The trivial origin in directory `d`, added to `started`: nginx answering every POST with a
    `size`-byte JSON (`reply-id.json`: the same echoing the request id "warm") or a framed gRPC
    message, plus its proxy_cache port. Returns http_port, grpc_port and cache_port."""
    (d / "static").mkdir(parents=True)
    body = json.dumps({"outputs": "x" * size})[:size - 2] + '"}'
    (d / "static" / "reply.json").write_text(body)
    (d / "static" / "reply-id.json").write_text('{"id":"warm",' + body[1:])
    (d / "static" / "reply.grpc").write_bytes(grpc_reply(size))
    ports = {k: procs.free_port() for k in ("http_port", "grpc_port", "cache_port")}
    (d / "nginx.conf").write_text(NGINX_CONF.format(dir=d, **ports))
    nginx = procs.start("nginx", [shutil.which("nginx") or "nginx", "-p", str(d), "-c", str(d / "nginx.conf")], d)
    started.append(nginx)
    procs.wait_until(nginx, procs.tcp_open(ports["cache_port"]))
    return ports


def start_anchor_origin(d: Path, static: Path, started: list[procs.Proc]) -> int:
    """nginx serving the answer file in `static` to GET with Cache-Control (Envoy's cache filter's origin)."""
    d.mkdir(parents=True)
    port = procs.free_port()
    (d / "nginx.conf").write_text(ANCHOR_NGINX_CONF.format(dir=d, port=port, static=static))
    nginx = procs.start("nginx-anchor", [shutil.which("nginx") or "nginx", "-p", str(d), "-c", str(d / "nginx.conf")],
                        d)
    started.append(nginx)
    procs.wait_until(nginx, procs.tcp_open(port))
    return port


def with_envoy_cache_filter(path: Path) -> None:
    """Puts Envoy's cache filter in front of the router of the bootstrap at `path` (a bench-only
    Envoy: no project config carries Envoy's cache filter)."""
    doc = yaml.safe_load(path.read_text())
    hcm = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["http_filters"].insert(0, ENVOY_CACHE_FILTER)
    path.write_text(yaml.safe_dump(doc, sort_keys=False))


def run_size(size: int, seconds: int, workdir: Path, rounds: int) -> list[Row]:
    label = f"{size // 1024} KiB" if size < 1_048_576 else f"{size // 1_048_576} MiB"
    d = workdir / f"s{size}"
    d.mkdir(parents=True)
    (d / "fixed.lua").write_text(REQUEST_LUA.format(body=REQUEST_JSON, vary="0"))
    for n in range(rounds):
        # Each round's misses start where the last round's stopped: wrk restarts its counter, and a
        # body an earlier round sent would be a hit (the caches keep every entry for an hour).
        (d / f"unique-{n}.lua").write_text(REQUEST_LUA.format(body=REQUEST_JSON, vary=f"n + {n * 10**9}"))
        (d / f"unique-id-{n}.lua").write_text(UNIQUE_ID_LUA.format(body=REQUEST_JSON, start=n * 10**9))
    (d / "new-id.lua").write_text(NEW_ID_LUA.format(rest=REQUEST_JSON[1:]))
    (d / "get.lua").write_text(GET_LUA)
    (d / "grpc-request.bin").write_bytes(infer_request("bench-model"))
    (d / "grpc-request-no-id.bin").write_bytes(infer_request("bench-model", with_id=False))
    policy = {"version": "bench", "max_entry_bytes": 9 * 1_048_576, "max_total_bytes": 256 * 1_048_576,
              "policies": [{"model_prefix": "bench", "ttl_s": 3600}]}
    large = size > 65536
    rows: list[Row] = []
    started: list[procs.Proc] = []
    with procs.supervised(started):
        ports = start_origin(d, started, size)
        anchor_port = None if large else start_anchor_origin(d / "anchor", d / "static", started)
        envoys = {}
        # "Wasm": the Wasm host holding request headers (the project's Envoy configs); "nohold":
        # the Wasm host as Istio's WasmPlugin runs it (no allow_on_headers_stop_iteration);
        # "native": the dynamic-module host; "envoy-cache": Envoy's own cache filter, no meshcache.
        setups = [("plain", False, True), ("Wasm", True, True), ("nohold", True, False), ("native", True, True)]
        if anchor_port is not None:
            setups.append(("envoy-cache", False, True))
        for name, with_filter, hold in setups:
            listen, admin = procs.free_port(), procs.free_port()
            cfg = CacheProxy(listen_port=listen, admin_port=admin,
                             http_upstream_port=anchor_port if name == "envoy-cache" else ports["http_port"],
                             grpc_upstream_port=ports["grpc_port"], wasm_path=require_filter_wasm(),
                             plugin_config={**policy, "hold_headers": hold}, with_filter=with_filter,
                             allow_on_headers_stop_iteration=hold,
                             native_module=require_filter_native() if name == "native" else None)
            path = write(cfg, d / f"envoy-{name}.yaml")
            if name == "envoy-cache":
                with_envoy_cache_filter(path)
            proc = launchers.start_envoy(path, admin, d, name=f"envoy-{name}")
            started.append(proc)
            envoys[name] = (listen, admin)
            PIDS[(label, name)] = proc.popen.pid

        def stats(envoy: str) -> dict[str, int]:
            time.sleep(0.45)  # the Wasm host flushes its counters every 200 ms
            return launchers.envoy_stats(envoys[envoy][1], "wasmcustom.meshcache")

        def url(name: str, path: str) -> str:
            return f"http://127.0.0.1:{envoys[name][0]}{path}"

        def measure(protocol: str, mode: str, run: object, envoy: str | None = None) -> None:
            """One row: `run()` against Envoy `envoy` (None: not an Envoy, e.g. nginx)."""
            counted = envoy in ("Wasm", "nohold", "native")
            before = stats(envoy) if counted else {}  # type: ignore[arg-type]
            cpu_before = cpu_seconds(PIDS[(label, envoy)]) if envoy else 0.0
            result: LoadResult = run()  # type: ignore[operator]
            cpu_us = (cpu_seconds(PIDS[(label, envoy)]) - cpu_before) * 1e6 / max(1, result.requests) if envoy \
                else None
            check = "-"
            if counted:
                after = stats(envoy)  # type: ignore[arg-type]
                delta = {k.rsplit(".", 1)[-1]: after.get(k, 0) - before.get(k, 0)
                         for k in ("wasmcustom.meshcache.hits", "wasmcustom.meshcache.misses",
                                   "wasmcustom.meshcache.stores")}
                check = f"hits {delta['hits']}, misses {delta['misses']}, stores {delta['stores']}"
            rows.append(Row(protocol, label, mode, result, check, cpu_us=cpu_us))

        for n in range(rounds):
            measure_round(measure, url, n, d, ports, seconds, large)
    return average_rounds(rows)


def measure_round(measure: Any, url: Any, n: int, d: Path, ports: dict[str, int], seconds: int, large: bool) -> None:
    """Round `n`, every mode once, for one answer size. `url(envoy, path)`,
    `measure(protocol, mode, run, envoy)`."""
    infer = "/v2/models/bench-model/infer"
    fixed, unique = d / "fixed.lua", d / f"unique-{n}.lua"
    measure("HTTP/1.1", "no filter", lambda: wrk(url("plain", infer), fixed, seconds), "plain")
    for host in CACHE_HOSTS:
        if not large:
            # The floor: the filter loaded but the request not an inference request (only the
            # per-request callbacks Envoy always makes into the filter).
            measure("HTTP/1.1", f"{host}, loaded, request ignored",
                    lambda host=host: wrk(url(host, "/other"), fixed, seconds), host)
        miss_mode = f"{host}, misses (streamed)" if large else f"{host}, misses"
        measure("HTTP/1.1", miss_mode, lambda host=host: wrk(url(host, infer), unique, seconds), host)
        warm = httpx.post(url(host, infer), content=FIXED_BODY, headers={"content-type": "application/json"},
                          timeout=60)
        assert warm.status_code == 200, warm.text
        measure("HTTP/1.1", f"{host}, hits", lambda host=host: wrk(url(host, infer), fixed, seconds), host)
        check_hit(url(host, infer), host)
    if not large:
        unique_id, new_id = d / f"unique-id-{n}.lua", d / "new-id.lua"
        measure("HTTP/1.1", "Wasm, misses, request ids", lambda: wrk(url("Wasm", infer), unique_id, seconds), "Wasm")
        id_url = url("Wasm", infer.replace("bench-model", "bench-id"))
        warm = httpx.post(id_url, content='{"id": "warm", ' + REQUEST_JSON[1:])
        assert warm.headers.get(CACHE_STATUS_HEADER, "").endswith("stored") or \
            warm.headers.get(CACHE_STATUS_HEADER, "").startswith("meshcache; hit"), warm.headers
        measure("HTTP/1.1", "Wasm, hits, request ids", lambda: wrk(id_url, new_id, seconds), "Wasm")
        cache_url = f"http://127.0.0.1:{ports['cache_port']}{infer}"
        httpx.post(cache_url, content=FIXED_BODY)
        measure("HTTP/1.1", "nginx proxy_cache, hits", lambda: wrk(cache_url, fixed, seconds))
        check_hit(cache_url, "nginx")
        anchor_url = url("envoy-cache", infer)
        httpx.get(anchor_url, timeout=60)
        measure("HTTP/1.1", "Envoy cache filter, GET hits", lambda: wrk(anchor_url, d / "get.lua", seconds),
                "envoy-cache")
        check_hit(anchor_url, "envoy-cache")

    grpc_headers = ["content-type: application/grpc", "te: trailers"]
    req = d / "grpc-request.bin"
    measure("gRPC", "no filter", lambda: h2load(url("plain", MODEL_INFER), req, grpc_headers, seconds), "plain")
    for host in CACHE_HOSTS:
        # h2load repeats one request body: `no-cache` makes each one skip the lookup and store
        # the answer again, which is the miss path's full cost (copy, hash, store).
        measure("gRPC", f"{host}, misses (no-cache)" + (", streamed" if large else ""),
                lambda host=host: h2load(url(host, MODEL_INFER), req, [*grpc_headers, "cache-control: no-cache"],
                                         seconds), host)
        measure("gRPC", f"{host}, hits (single pass)",
                lambda host=host: h2load(url(host, MODEL_INFER), req, grpc_headers, seconds), host)
    if not large:
        # Warm the Istio-mode Envoy's own cache first (each Envoy has its own store).
        h2load(url("nohold", MODEL_INFER), req, grpc_headers, 1)
        measure("gRPC", "Wasm without held headers, hits (single pass)",
                lambda: h2load(url("nohold", MODEL_INFER), req, grpc_headers, seconds), "nohold")
        no_id = d / "grpc-request-no-id.bin"
        measure("gRPC", "Wasm, hits, no request id",
                lambda: h2load(url("Wasm", MODEL_INFER), no_id, grpc_headers, seconds), "Wasm")


def check_hit(url: str, target: str) -> None:
    """After a hits run, the one request is still answered from that cache (so the run measured hits)."""
    if target == "envoy-cache":
        r = httpx.get(url, timeout=60)
        assert "age" in r.headers, (target, dict(r.headers))  # Envoy's cache adds Age to what it serves
        return
    r = httpx.post(url, content=FIXED_BODY, headers={"content-type": "application/json"}, timeout=60)
    seen = r.headers.get("x-cache") if target == "nginx" else r.headers.get(CACHE_STATUS_HEADER, "")
    assert seen == "HIT" or (seen or "").startswith("meshcache; hit"), (target, seen)


def average_rounds(rows: list[Row]) -> list[Row]:
    """One row per mode: the mean req/s and latencies of its rounds, errors summed."""
    out: dict[tuple[str, str, str], list[Row]] = {}
    for r in rows:
        out.setdefault((r.protocol, r.size, r.mode), []).append(r)

    def mean(values: list[float | None]) -> float | None:
        vs = [v for v in values if v is not None]
        return sum(vs) / len(vs) if vs else None

    merged = []
    for (protocol, size, mode), rs in out.items():
        res = LoadResult(
            rps=sum(r.result.rps for r in rs) / len(rs),
            p50_ms=mean([r.result.p50_ms for r in rs]), p99_ms=mean([r.result.p99_ms for r in rs]),
            mean_ms=mean([r.result.mean_ms for r in rs]),
            errors=sum(r.result.errors for r in rs), requests=sum(r.result.requests for r in rs),
            quantiles_ms=mean_quantiles([r.result.quantiles_ms for r in rs]))
        merged.append(Row(protocol, size, mode, res, rs[-1].check, [r.result.rps for r in rs],
                          mean([r.cpu_us for r in rs])))
    return merged


# Targets, from the filter issues: (host, protocol or answer, kind) -> target ratio.
TARGETS = {
    ("Wasm", "HTTP/1.1", "hits"): "≥ 1.5x", ("Wasm", "gRPC", "hits"): "≥ 1.2x",
    ("Wasm", "1 KiB", "misses"): "≥ 0.6x", ("Wasm", "64 KiB", "misses"): "≥ 0.4x",
    ("native", "HTTP/1.1", "hits"): "≥ 2.0x", ("native", "gRPC", "hits"): "≥ 2.0x",
    ("native", "1 KiB", "misses"): "≥ 0.85x", ("native", "64 KiB", "misses"): "≥ 0.6x",
    ("native", "", "nginx"): "≥ 0.7x",
}


def render(rows: list[Row], seconds: int) -> str:
    def fmt(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}"

    def cpu(r: Row | None) -> str:
        return "-" if r is None or r.cpu_us is None else f"{r.cpu_us:.0f}"

    base = {(r.protocol, r.size): r.result.rps for r in rows if r.mode == "no filter"}
    lines = []
    for r in rows:
        ratio = r.result.rps / base[(r.protocol, r.size)]
        lines.append([r.protocol, r.size, r.mode, f"{r.result.rps:,.0f}", fmt(r.result.p50_ms), fmt(r.result.p99_ms),
                      fmt(r.result.mean_ms), f"{ratio:.2f}x", cpu(r), r.result.errors, r.check])
    summary = []
    for (protocol, size), rps in base.items():
        same = {r.mode: r for r in rows if (r.protocol, r.size) == (protocol, size)}
        nginx, anchor = same.get("nginx proxy_cache, hits"), same.get("Envoy cache filter, GET hits")
        for host in CACHE_HOSTS:
            hit = next(r for m, r in same.items() if m in (f"{host}, hits", f"{host}, hits (single pass)"))
            miss = next(r for m, r in same.items() if m.startswith(f"{host}, misses"))
            summary.append([
                protocol, size, host,
                f"{hit.result.rps / rps:.2f}x", TARGETS.get((host, protocol, "hits"), "-"),
                f"{miss.result.rps / rps:.2f}x", TARGETS.get((host, size, "misses"), "-"),
                f"{hit.result.rps / nginx.result.rps:.2f}x" if nginx else "-",
                TARGETS.get((host, "", "nginx"), "-") if nginx else "-",
                f"{hit.result.rps / anchor.result.rps:.2f}x" if anchor else "-",
                f"{anchor.result.rps / rps:.2f}x" if anchor else "-",
                f"{cpu(hit)} / {cpu(miss)} / {cpu(same['no filter'])}"])
    return (
        f"Each run: {seconds} s per mode and round, modes interleaved, mean of the rounds; 16 connections, one "
        "load-generator thread; Envoy `--concurrency 1` with the project's buffer limits; nginx 1 worker.\n"
        "Request body ~300 B JSON (HTTP) or a small ModelInferRequest (gRPC); answers of the size shown. "
        "On this VM, absolute numbers of two runs of the same build differ by up to ~20%: read the ratios "
        "within one run. 'Wasm' is the proxy-wasm filter (the one Istio loads), 'native' the Envoy dynamic "
        "module, both the same cache core and config; 'loaded, request ignored' is the floor each host "
        "costs here (Envoy's per-request callbacks into it). CPU: the Envoy process's user + system µs per "
        "request during the row.\n\n"
        + table(["protocol", "answer", "mode", "req/s", "p50 ms", "p99 ms", "mean ms", "vs no filter",
                 "Envoy CPU µs/req", "errors", "cache counters during run"], lines)
        + "\n\nRatios (targets from the filter issues; Envoy's own cache filter serves GET hits of the same "
        "answer, HTTP only):\n\n"
        + table(["protocol", "answer", "host", "hits / no filter", "target", "misses / no filter", "target",
                 "hits / nginx hits", "target", "hits / Envoy cache filter hits", "Envoy cache filter / no filter",
                 "CPU µs/req: hits / misses / no filter"], summary)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--sizes", default="1024,65536,1048576,8388608", help="answer sizes in bytes")
    parser.add_argument("--no-write", action="store_true", help="print only; do not update docs/benchmarks.md")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="meshcache-bench-") as tmp:
        sizes = [int(x) for x in args.sizes.split(",")]
        rows = [row for size in sizes for row in run_size(size, args.seconds, Path(tmp), args.rounds)]
    text = render(rows, args.seconds)
    print(text)
    if not args.no_write:
        base = {(r.protocol, r.size): r for r in rows if r.mode == "no filter"}

        def round_ratios(r: Row) -> list[float]:
            """Each round's req/s over the same round's no-filter req/s (modes run interleaved)."""
            b = base[(r.protocol, r.size)].rounds_rps or []
            return [round(x / y, 3) for x, y in zip(r.rounds_rps or [], b, strict=False) if y]

        stored = [{"protocol": r.protocol, "answer": r.size, "mode": r.mode, "rps": round(r.result.rps, 1),
                   "p50_ms": r.result.p50_ms, "p99_ms": r.result.p99_ms, "mean_ms": r.result.mean_ms,
                   "vs_no_filter": round(r.result.rps / base[(r.protocol, r.size)].result.rps, 3),
                   "rounds_rps": [round(x, 1) for x in r.rounds_rps or []], "rounds_vs_no_filter": round_ratios(r),
                   "errors": r.result.errors, "counters": r.check, "envoy_cpu_us": r.cpu_us,
                   **({"quantiles_ms": r.result.quantiles_ms} if r.result.quantiles_ms else {})} for r in rows]
        publish("filter", "Filter: proxy throughput with and without the cache (`python -m bench.filter`)", text,
                {"seconds": args.seconds, "rows": stored})


if __name__ == "__main__":
    main()
