"""Filter throughput, side by side in one run (`python -m bench.filter`).

For 1 KiB, 64 KiB, 1 MiB and 8 MiB answers: Envoy proxying to a trivial origin without the
filter, the same Envoy config with the cache on misses and on hits in both hosts (the Wasm
filter Istio loads, `filter/dist/meshcache_filter.wasm`, and the Envoy dynamic module,
`filter/dist/libmeshcache_native.so`), and two anchors: nginx `proxy_cache` POST hits (outside
Envoy) and Envoy's own C++ cache filter (simple_http_cache) serving GET hits of the same answer
(inside Envoy: what a cache in Envoy can reach without POST keying; 1 KiB and 64 KiB). The
native host also runs as Istio 1.31 users get it (issue 37): the module's Envoy 1.39 build
(`libmeshcache_native-envoy-1.39.so`) on Envoy 1.39.3, with its own no-filter Envoy 1.39, so
its ratios are to plain proxying by the same Envoy (the two Envoys' plain speeds differ). HTTP/1.1
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
import os
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
# The mode prefixes of the cache's hosts (each also the name of its Envoy): the Wasm filter and the
# dynamic module on Envoy 1.40, and the module's 1.39 build on Envoy 1.39 (istio-proxy 1.31's).
CACHE_HOSTS = ("Wasm", "native", "native-1.39")
NO_FILTER = "no filter"
NO_FILTER_1_39 = "no filter (Envoy 1.39)"
# The Envoy (paths.ENVOYS) each bench Envoy runs: the 1.39 ones are measured against plain 1.39.
ENVOY_OF = {"plain-1.39": "1.39", "native-1.39": "1.39"}
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
        # "native": the dynamic-module host; "envoy-cache": Envoy's own cache filter, no meshcache;
        # "native-1.39" and its baseline "plain-1.39": Envoy 1.39.3 with the module's 1.39 build.
        setups = [("plain", False, True), ("Wasm", True, True), ("nohold", True, False), ("native", True, True),
                  ("plain-1.39", False, True), ("native-1.39", True, True)]
        if anchor_port is not None:
            setups.append(("envoy-cache", False, True))
        for name, with_filter, hold in setups:
            listen, admin = procs.free_port(), procs.free_port()
            cfg = CacheProxy(listen_port=listen, admin_port=admin,
                             http_upstream_port=anchor_port if name == "envoy-cache" else ports["http_port"],
                             grpc_upstream_port=ports["grpc_port"], wasm_path=require_filter_wasm(),
                             plugin_config={**policy, "hold_headers": hold}, with_filter=with_filter,
                             allow_on_headers_stop_iteration=hold,
                             native_module=require_filter_native(ENVOY_OF.get(name, "1.40"))
                             if name.startswith("native") else None)
            path = write(cfg, d / f"envoy-{name}.yaml")
            if name == "envoy-cache":
                with_envoy_cache_filter(path)
            proc = launchers.start_envoy(path, admin, d, name=f"envoy-{name}", envoy=ENVOY_OF.get(name, "1.40"))
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
            counted = envoy in ("nohold", *CACHE_HOSTS)
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
    measure("HTTP/1.1", NO_FILTER, lambda: wrk(url("plain", infer), fixed, seconds), "plain")
    measure("HTTP/1.1", NO_FILTER_1_39, lambda: wrk(url("plain-1.39", infer), fixed, seconds), "plain-1.39")
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
    measure("gRPC", NO_FILTER, lambda: h2load(url("plain", MODEL_INFER), req, grpc_headers, seconds), "plain")
    measure("gRPC", NO_FILTER_1_39, lambda: h2load(url("plain-1.39", MODEL_INFER), req, grpc_headers, seconds),
            "plain-1.39")
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


def baseline_mode(mode: str) -> str:
    """The no-filter row a mode's ratios are to: plain proxying by the same Envoy (the Envoy 1.39
    rows to Envoy 1.39's), and Envoy 1.39's own no-filter row to Envoy 1.40's."""
    return NO_FILTER_1_39 if mode.startswith("native-1.39") else NO_FILTER


PROTOCOLS = ("HTTP/1.1", "gRPC")
SMALL = ("1 KiB", "64 KiB")
# The hosts of the summary table: (host, its hit rows' modes, its miss rows' mode prefix or None).
SUMMARY_HOSTS = [
    ("Wasm", ("Wasm, hits", "Wasm, hits (single pass)"), "Wasm, misses"),
    ("Wasm without held headers", ("Wasm without held headers, hits (single pass)",), None),
    ("native", ("native, hits", "native, hits (single pass)"), "native, misses"),
    ("native-1.39", ("native-1.39, hits", "native-1.39, hits (single pass)"), "native-1.39, misses"),
]
# Issue 37's targets (quiet machine): (host, measure, protocol, answer) -> target ratio. Hits and
# misses are to plain proxying by the same Envoy; "Envoy cache filter" is hits to its GET hits.
TARGETS: dict[tuple[str, str, str, str], str] = {
    **{(h, "hits", p, a): "≥ 2.0x" for h in ("native", "native-1.39") for p in PROTOCOLS for a in SMALL},
    **{(h, "Envoy cache filter", "HTTP/1.1", a): "≥ 1.0x" for h in ("native", "native-1.39") for a in SMALL},
    **{(h, "hits", p, a): "≥ 1.0x" for h in ("Wasm", "Wasm without held headers") for p in PROTOCOLS
       for a in (*SMALL, "1 MiB")},
    ("Wasm", "hits", "HTTP/1.1", "1 KiB"): "≥ 1.3x",
    **{("Wasm", "misses", p, "1 KiB"): "≥ 0.55x" for p in PROTOCOLS},
    **{("Wasm", "misses", p, "64 KiB"): "≥ 0.35x" for p in PROTOCOLS},
}


def target(host: str, measure: str, protocol: str, answer: str) -> str:
    return TARGETS.get((host, measure, protocol, answer), "-")


def render(rows: list[Row], seconds: int, load: tuple[float, float] | None = None) -> str:
    """The section's tables. `load`: the 1-minute load average when the run started and ended."""
    def fmt(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}"

    def cpu(r: Row | None) -> str:
        return "-" if r is None or r.cpu_us is None else f"{r.cpu_us:.0f}"

    by_mode = {(r.protocol, r.size, r.mode): r for r in rows}

    def base(r: Row) -> Row:
        return by_mode[(r.protocol, r.size, baseline_mode(r.mode))]

    lines = []
    for r in rows:
        lines.append([r.protocol, r.size, r.mode, f"{r.result.rps:,.0f}", fmt(r.result.p50_ms), fmt(r.result.p99_ms),
                      fmt(r.result.mean_ms), f"{r.result.rps / base(r).result.rps:.2f}x", cpu(r), r.result.errors,
                      r.check])
    summary, envoys = [], []
    for (protocol, size) in dict.fromkeys((r.protocol, r.size) for r in rows):
        same = {r.mode: r for r in rows if (r.protocol, r.size) == (protocol, size)}
        nginx, anchor = same.get("nginx proxy_cache, hits"), same.get("Envoy cache filter, GET hits")
        plain = same[NO_FILTER]
        if NO_FILTER_1_39 in same:
            old = same[NO_FILTER_1_39]
            envoys.append(f"{protocol} {size} {old.result.rps / plain.result.rps:.2f}x ({cpu(old)} / {cpu(plain)})")
        for host, hit_modes, miss_prefix in SUMMARY_HOSTS:
            hit = next((same[m] for m in hit_modes if m in same), None)
            if hit is None:
                continue
            miss = next((r for m, r in same.items() if miss_prefix and m.startswith(miss_prefix)), None)
            rps = base(hit).result.rps
            summary.append([
                protocol, size, host,
                f"{hit.result.rps / rps:.2f}x", target(host, "hits", protocol, size),
                f"{miss.result.rps / rps:.2f}x" if miss else "-", target(host, "misses", protocol, size),
                f"{hit.result.rps / nginx.result.rps:.2f}x" if nginx else "-",
                f"{hit.result.rps / anchor.result.rps:.2f}x" if anchor else "-",
                target(host, "Envoy cache filter", protocol, size) if anchor else "-",
                f"{anchor.result.rps / plain.result.rps:.2f}x" if anchor else "-",
                f"{cpu(hit)} / {cpu(miss)} / {cpu(base(hit))}"])
    load_line = (f" 1-minute load average {load[0]:.2f} when the run started, {load[1]:.2f} when it ended, on "
                 f"{os.cpu_count()} cores (other work on the machine moves req/s more than CPU µs/req)."
                 if load else "")
    return (
        f"Each run: {seconds} s per mode and round, modes interleaved, mean of the rounds; 16 connections, one "
        "load-generator thread; Envoy `--concurrency 1` with the project's buffer limits; nginx 1 worker."
        + load_line + "\n"
        "Request body ~300 B JSON (HTTP) or a small ModelInferRequest (gRPC); answers of the size shown. "
        "On this VM, absolute numbers of two runs of the same build differ by up to ~20%: read the ratios "
        "within one run. 'Wasm' is the proxy-wasm filter (the one Istio loads), 'native' the Envoy dynamic "
        "module, both the same cache core and config, on Envoy 1.40; 'native-1.39' is the module's Envoy 1.39 "
        "build on Envoy 1.39.3 (istio-proxy 1.31's Envoy), and its 'vs no filter' is to 'no filter (Envoy "
        "1.39)', plain proxying by that same Envoy (that row's own ratio is Envoy 1.39's plain speed over "
        "1.40's); 'loaded, request ignored' is the floor each host costs here (Envoy's per-request callbacks "
        "into it). CPU: the Envoy process's user + system µs per request during the row.\n\n"
        + table(["protocol", "answer", "mode", "req/s", "p50 ms", "p99 ms", "mean ms", "vs no filter",
                 "Envoy CPU µs/req", "errors", "cache counters during run"], lines)
        + "\n\nRatios (targets from issue 37; hits and misses to plain proxying by the host's own Envoy; "
        "Envoy's own cache filter, on Envoy 1.40, serves GET hits of the same answer, HTTP only):\n\n"
        + table(["protocol", "answer", "host", "hits / no filter", "target", "misses / no filter", "target",
                 "hits / nginx hits", "hits / Envoy cache filter hits", "target", "Envoy cache filter / no filter",
                 "CPU µs/req: hits / misses / no filter"], summary)
        + ("\n\nPlain proxying, Envoy 1.39 over Envoy 1.40 in this run (req/s; CPU µs/req 1.39 / 1.40): "
           + ", ".join(envoys) + "." if envoys else "")
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--sizes", default="1024,65536,1048576,8388608", help="answer sizes in bytes")
    parser.add_argument("--no-write", action="store_true", help="print only; do not update docs/benchmarks.md")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="meshcache-bench-") as tmp:
        sizes = [int(x) for x in args.sizes.split(",")]
        rows = [row for size in sizes for row in run_size(size, args.seconds, Path(tmp), args.rounds)]
    text = render(rows, args.seconds, (load_before, os.getloadavg()[0]))
    print(text)
    if not args.no_write:
        base = {(r.protocol, r.size, r.mode): r for r in rows if r.mode in (NO_FILTER, NO_FILTER_1_39)}

        def baseline(r: Row) -> Row:
            return base[(r.protocol, r.size, baseline_mode(r.mode))]

        def round_ratios(r: Row) -> list[float]:
            """Each round's req/s over the same round's no-filter req/s (modes run interleaved)."""
            b = baseline(r).rounds_rps or []
            return [round(x / y, 3) for x, y in zip(r.rounds_rps or [], b, strict=False) if y]

        stored = [{"protocol": r.protocol, "answer": r.size, "mode": r.mode, "rps": round(r.result.rps, 1),
                   "p50_ms": r.result.p50_ms, "p99_ms": r.result.p99_ms, "mean_ms": r.result.mean_ms,
                   "vs_no_filter": round(r.result.rps / baseline(r).result.rps, 3),
                   "baseline": baseline_mode(r.mode),
                   "rounds_rps": [round(x, 1) for x in r.rounds_rps or []], "rounds_vs_no_filter": round_ratios(r),
                   "errors": r.result.errors, "counters": r.check, "envoy_cpu_us": r.cpu_us,
                   **({"quantiles_ms": r.result.quantiles_ms} if r.result.quantiles_ms else {})} for r in rows]
        publish("filter", "Filter: proxy throughput with and without the cache (`python -m bench.filter`)", text,
                {"seconds": args.seconds, "rows": stored, "load_average_1m_before": load_before})


if __name__ == "__main__":
    main()
