"""The dynamic-module host against the Wasm filter and plain proxying (`python -m bench.native`).

Phase 1 of issue 24: is a native host worth it? Three Envoys with one worker each behind one
nginx origin (bench.filter.start_origin): no filter, the Wasm filter (filter/dist/
meshcache_filter.wasm) and the dynamic module (filter/dist/libmeshcache_native.so), all with the
same policy; plus two anchors: nginx `proxy_cache` POST hits (outside Envoy) and Envoy's own
C++ cache filter (simple_http_cache) serving GET hits of the same answer (inside Envoy: what a
native cache can reach without the filter's POST keying). HTTP/1.1 with wrk and
bench.filter's script shape (-t1 -c16, one Lua `request()` building each body): hits repeat one
body, misses send a new body every time. Modes run interleaved, their order rotating from round
to round. Besides req/s, each Envoy's CPU time per request (user + system), which moves less
with the machine's other load. Prints its table (and `--json` writes the raw rounds); it does
not touch docs/benchmarks.md.

The native filter runs the same cache core as the Wasm filter (keys, request ids, response hash,
ETag, the same store); it does not coalesce misses yet (filter/native/DESIGN.md, phase 2
status). Numbers from before phase 2 (a throwaway key and store) are not comparable.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import httpx
import yaml

from bench import filter as bf
from bench.loadgen import LoadResult, wrk
from bench.report import table
from bench.stats import cpu_seconds
from meshcache.contract.headers import CACHE_STATUS_HEADER
from meshcache.contract.paths import require_filter_native, require_filter_wasm
from meshcache.ctl import launchers, procs
from meshcache.ctl.envoy_config import CacheProxy, write

# The in-Envoy anchor: Envoy's own C++ cache filter (simple_http_cache) answering GET hits of the
# same answer from its own origin (bench.filter's nginx answers every method alike, without
# Cache-Control; this one adds it, so the answer is cacheable).
ANCHOR_NGINX_CONF = """worker_processes 1;
user root;
daemon off;
pid {dir}/nginx.pid;
error_log {dir}/nginx-error.log warn;
events {{ worker_connections 1024; }}
http {{
  access_log off;
  keepalive_requests 1000000;
  server {{
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
POLICY = {"version": "bench", "max_entry_bytes": 9 * 1_048_576, "max_total_bytes": 256 * 1_048_576,
          "policies": [{"model_prefix": "bench", "ttl_s": 3600}]}
INFER = "/v2/models/bench-model/infer"
# (mode, envoy or "nginx", wrk script): the rows, in the first round's order.
MODES = (
    ("no filter", "plain", "fixed.lua"),
    ("Wasm, hits", "wasm", "fixed.lua"),
    ("native, hits", "native", "fixed.lua"),
    ("Wasm, misses", "wasm", "unique.lua"),
    ("native, misses", "native", "unique.lua"),
    ("nginx proxy_cache, hits", "nginx", "fixed.lua"),
    ("Envoy cache filter, GET hits", "envoy-cache", "get.lua"),
)


@dataclass
class Run:
    result: LoadResult
    cpu_us: float | None  # the Envoy's CPU µs per request (None for nginx)


def run_size(size: int, seconds: int, rounds: int, d: Path) -> dict[str, list[Run]]:
    d.mkdir(parents=True)
    (d / "fixed.lua").write_text(bf.REQUEST_LUA.format(body=bf.REQUEST_JSON, vary="0"))
    for n in range(rounds):
        # Each round's misses start where the last round's stopped: wrk restarts its counter, and a
        # body seen in an earlier round would be a hit (the stores keep every entry for an hour).
        (d / f"unique-{n}.lua").write_text(bf.REQUEST_LUA.format(body=bf.REQUEST_JSON, vary=f"n + {n * 10**9}"))
    (d / "get.lua").write_text(GET_LUA)
    out: dict[str, list[Run]] = {}
    started: list[procs.Proc] = []
    with procs.supervised(started):
        ports = bf.start_origin(d, started, size)
        urls = {"nginx": f"http://127.0.0.1:{ports['cache_port']}{INFER}"}
        anchor_port = start_anchor_origin(d / "anchor", d / "static", started)
        pids: dict[str, int] = {}
        for name in ("plain", "wasm", "native", "envoy-cache"):
            listen, admin = procs.free_port(), procs.free_port()
            cfg = CacheProxy(listen_port=listen, admin_port=admin,
                             http_upstream_port=anchor_port if name == "envoy-cache" else ports["http_port"],
                             grpc_upstream_port=ports["grpc_port"], wasm_path=require_filter_wasm(),
                             plugin_config=POLICY, with_filter=name in ("wasm", "native"),
                             native_module=require_filter_native() if name == "native" else None)
            path = write(cfg, d / f"envoy-{name}.yaml")
            if name == "envoy-cache":
                with_envoy_cache_filter(path)
            envoy = launchers.start_envoy(path, admin, d, name=f"envoy-{name}")
            started.append(envoy)
            pids[name] = envoy.popen.pid
            urls[name] = f"http://127.0.0.1:{listen}{INFER}"
        for name in ("wasm", "native", "nginx"):  # warm: the hits' one body stored
            httpx.post(urls[name], content=bf.FIXED_BODY, headers={"content-type": "application/json"}, timeout=60)
        httpx.get(urls["envoy-cache"], timeout=60)
        for n in range(rounds):
            order = MODES[n % len(MODES):] + MODES[:n % len(MODES)]
            for mode, target, script in order:
                pid = pids.get(target)
                before = cpu_seconds(pid) if pid else 0.0
                result = wrk(urls[target], d / script.replace("unique", f"unique-{n}"), seconds)
                cpu_us = (cpu_seconds(pid) - before) * 1e6 / max(1, result.requests) if pid else None
                out.setdefault(mode, []).append(Run(result, cpu_us))
                check_hits(mode, target, urls[target])
    return out


def start_anchor_origin(d: Path, static: Path, started: list[procs.Proc]) -> int:
    """nginx serving bench.filter's answer file to GET with Cache-Control (Envoy's cache filter's origin)."""
    d.mkdir(parents=True)
    port = procs.free_port()
    (d / "nginx.conf").write_text(ANCHOR_NGINX_CONF.format(dir=d, port=port, static=static))
    argv = [shutil.which("nginx") or "nginx", "-p", str(d), "-c", str(d / "nginx.conf")]
    nginx = procs.start("nginx-anchor", argv, d)
    started.append(nginx)
    procs.wait_until(nginx, procs.tcp_open(port))
    return port


def with_envoy_cache_filter(path: Path) -> None:
    """Puts Envoy's cache filter in front of the router of the bootstrap at `path`."""
    doc = yaml.safe_load(path.read_text())
    hcm = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["http_filters"].insert(0, ENVOY_CACHE_FILTER)
    path.write_text(yaml.safe_dump(doc, sort_keys=False))


def check_hits(mode: str, target: str, url: str) -> None:
    """After a hits run, the one body is still answered from the cache (so the run measured hits)."""
    if not mode.endswith("hits"):
        return
    if target == "envoy-cache":
        r = httpx.get(url, timeout=60)
        assert "age" in r.headers, (mode, dict(r.headers))  # Envoy's cache adds Age to what it serves
        return
    r = httpx.post(url, content=bf.FIXED_BODY, headers={"content-type": "application/json"}, timeout=60)
    seen = r.headers.get("x-cache") if target == "nginx" else r.headers.get(CACHE_STATUS_HEADER, "")
    assert seen == "HIT" or (seen or "").startswith("meshcache; hit"), (mode, seen)


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def render(results: dict[str, dict[str, list[Run]]], seconds: int, rounds: int) -> str:
    rows = []
    ratio_rows = []
    for label, by_mode in results.items():
        base = [r.result.rps for r in by_mode["no filter"]]
        rps_of: dict[str, float] = {}
        for mode, _, _ in MODES:
            runs = by_mode[mode]
            rps = [r.result.rps for r in runs]
            rps_of[mode] = mean(rps)
            per_round = [x / b for x, b in zip(rps, base, strict=True)]
            cpu = [r.cpu_us for r in runs if r.cpu_us is not None]
            rows.append([label, mode, f"{mean(rps):,.0f}", f"{mean(per_round):.2f}x",
                         f"{min(per_round):.2f}-{max(per_round):.2f}",
                         f"{mean(cpu):.0f}" if cpu else "-",
                         f"{mean([r.result.p50_ms or 0 for r in runs]):.2f}",
                         f"{mean([r.result.p99_ms or 0 for r in runs]):.2f}",
                         sum(r.result.errors for r in runs)])
        cpu_of = {m: mean([r.cpu_us for r in by_mode[m] if r.cpu_us is not None]) for m, t, _ in MODES if t != "nginx"}
        ratio_rows.append([label, f"{rps_of['native, hits'] / rps_of['Envoy cache filter, GET hits']:.2f}x",
                           f"{rps_of['native, hits'] / rps_of['Wasm, hits']:.2f}x",
                           f"{rps_of['native, misses'] / rps_of['Wasm, misses']:.2f}x",
                           f"{rps_of['native, hits'] / rps_of['nginx proxy_cache, hits']:.2f}x",
                           f"{cpu_of['native, hits']:.0f} / {cpu_of['Wasm, hits']:.0f} / {cpu_of['no filter']:.0f}",
                           f"{cpu_of['native, misses']:.0f} / {cpu_of['Wasm, misses']:.0f}"])
    return "\n".join([
        f"`python -m bench.native`: {rounds} rounds of {seconds} s per mode, modes interleaved (order rotating per "
        "round); wrk -t1 -c16; Envoy --concurrency 1, nginx 1 worker. 'vs no filter' is the mean of the per-round "
        "ratios (a round runs every mode within a minute), its range the lowest and highest round. CPU: the Envoy "
        "process's user + system µs per request. The machine is shared: absolute numbers are noise, read ratios.",
        "",
        table(["answer", "mode", "req/s", "vs no filter", "per round", "Envoy CPU µs/req", "p50 ms", "p99 ms",
               "errors"], rows),
        "",
        table(["answer", "native hits / Envoy cache filter GET hits", "native / Wasm hits", "native / Wasm misses",
               "native hits / nginx hits",
               "CPU µs/req hits: native / Wasm / no filter", "CPU µs/req misses: native / Wasm"], ratio_rows),
    ])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--seconds", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--sizes", default="1024,65536", help="answer sizes in bytes")
    parser.add_argument("--json", type=Path, help="write the raw per-round results here")
    args = parser.parse_args(argv)
    results: dict[str, dict[str, list[Run]]] = {}
    with tempfile.TemporaryDirectory(prefix="meshcache-bench-native-") as tmp:
        for size in (int(s) for s in args.sizes.split(",")):
            results[f"{size // 1024} KiB"] = run_size(size, args.seconds, args.rounds, Path(tmp) / f"s{size}")
    print(render(results, args.seconds, args.rounds))
    if args.json:
        raw: dict[str, object] = {label: {mode: [{"rps": r.result.rps, "cpu_us": r.cpu_us, "p50_ms": r.result.p50_ms,
                                                  "p99_ms": r.result.p99_ms, "errors": r.result.errors}
                                                 for r in runs] for mode, runs in by_mode.items()}
                                  for label, by_mode in results.items()}
        args.json.write_text(json.dumps(raw, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
