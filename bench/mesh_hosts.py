"""gRPC hits through istiod-configured sidecars, the Wasm host against the native host, in one run
(`python -m bench.mesh_hosts`).

Two local istiod meshes up at once (meshcache/ctl/istiod/mesh.py, what `meshcache up --istiod
[--filter native]` starts): the Wasm one (every Istio's host; sidecars on Envoy 1.40, the Wasm
filter from istiod over ECDS) and the native one (Istio 1.31's: sidecars on Envoy 1.39.3, the
module's 1.39 build from the native mode's EnvoyFilters). Each has its own istiod, control plane,
Redis, engine and loopback /24, so both run side by side. The app's call: plaintext gRPC to the
client pod's sidecar, HTTP/2 over mTLS to the engine pod's sidecar, where the cache answers a hit;
a miss goes on to the engine (resnet-mini, 1x3x32x32 FP32).

One resnet-mini input is stored by one warm request, then asked with 64 request ids cycled (every
hit splices its caller's id in). Rounds interleave the two meshes (the order alternates per round);
each round measures, per mesh and concurrency C: hits from a closed loop of C grpc.aio callers,
hits from h2load (C connections, one stream each: a C client, so less of the latency is the
client's), and misses (every input new) from the grpc.aio loop, for scale. Each row also records
the engine pod's sidecar Envoy's CPU time per request (steadier than req/s on a shared machine).
Writes the `mesh-hosts` section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import itertools
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from bench.loadgen import h2load
from bench.mesh import closed_loop, request_with
from bench.report import publish, table
from bench.stats import cpu_seconds, mean_quantiles, quantiles_ms
from meshcache.ctl.istiod.mesh import IstiodMesh, IstiodMeshConfig, check_prerequisites
from tests.helpers.kserve import MODEL_INFER, RESNET, grpc_call, resnet_request

HOSTS = ("wasm", "native")  # IstiodMeshConfig.filter
HOST_LABEL = {"wasm": "Wasm (Envoy 1.40)", "native": "native (Envoy 1.39)"}
POLICIES = {RESNET: {"ttl_s": 3600, "max_ttl_s": 3600}}  # no entry expires during a run


@dataclass
class Measured:
    """One row: a case (hit, miss) through one mesh with one client at one concurrency."""

    host: str
    case: str
    client: str
    concurrency: int
    rps: float
    p50_ms: float | None
    p99_ms: float | None
    errors: int
    cpu_us: float | None  # the engine pod's sidecar Envoy, user + system µs per request
    statuses: dict[str, int] = field(default_factory=dict)  # Cache-Status kinds seen (grpc.aio only)
    quantiles_ms: list[float] | None = None
    rounds_rps: list[float] = field(default_factory=list)


def merge_rounds(rows: list[Measured]) -> list[Measured]:
    """One row per (host, case, client, concurrency): the mean of its rounds' req/s, p50, p99 and
    CPU, errors and Cache-Status counts summed, each round's req/s kept (in round order)."""
    groups: dict[tuple[str, str, str, int], list[Measured]] = {}
    for r in rows:
        groups.setdefault((r.host, r.case, r.client, r.concurrency), []).append(r)

    def mean(values: list[float | None]) -> float | None:
        have = [v for v in values if v is not None]
        return sum(have) / len(have) if have else None

    merged = []
    for (host, case, client, c), rs in groups.items():
        statuses: collections.Counter[str] = collections.Counter()
        for r in rs:
            statuses.update(r.statuses)
        merged.append(Measured(host, case, client, c, sum(r.rps for r in rs) / len(rs),
                               mean([r.p50_ms for r in rs]), mean([r.p99_ms for r in rs]),
                               sum(r.errors for r in rs), mean([r.cpu_us for r in rs]), dict(statuses),
                               mean_quantiles([r.quantiles_ms for r in rs]), [r.rps for r in rs]))
    return merged


def host_ratios(rows: list[Measured]) -> list[list[str]]:
    """Native over Wasm for hits, per client and concurrency: p50, p99, req/s, sidecar CPU."""
    by = {(r.host, r.case, r.client, r.concurrency): r for r in rows}
    out = []
    for (host, case, client, c), wasm in by.items():
        native = by.get(("native", case, client, c))
        if host != "wasm" or case != "hit" or native is None:
            continue

        def ratio(a: float | None, b: float | None) -> str:
            return f"{a / b:.2f}" if a is not None and b else "-"

        out.append([client, str(c), ratio(native.p50_ms, wasm.p50_ms), ratio(native.p99_ms, wasm.p99_ms),
                    ratio(native.rps, wasm.rps), ratio(native.cpu_us, wasm.cpu_us)])
    return out


def _cell(v: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if v is None else fmt.format(v)


def render(rows: list[Measured], duration: float, warmup: float, rounds: int, load: tuple[float, float]) -> str:
    lines = [[HOST_LABEL[r.host], r.case, r.client, r.concurrency, f"{r.rps:.0f}", _cell(r.p50_ms), _cell(r.p99_ms),
              _cell(r.cpu_us, "{:.0f}"), r.errors, ", ".join(f"{k} {n}" for k, n in sorted(r.statuses.items()))]
             for r in rows]
    return "\n".join([
        "`python -m bench.mesh_hosts`: gRPC `ModelInfer` for `resnet-mini` through two local istiod meshes up at "
        "once (`meshcache up --istiod` and `meshcache up --istiod --filter native`): app -> client sidecar "
        "(plaintext h2c) -> engine pod's sidecar (HTTP/2 over mTLS, the cache from istiod) -> engine on a miss. "
        "Wasm = the proxy-wasm filter on Envoy 1.40 sidecars (what every Istio runs); native = the dynamic "
        "module's 1.39 build on Envoy 1.39.3 sidecars (Istio 1.31's Envoy). So each row is a whole Istio "
        "stack, Envoy version included, not the filter alone (bench.filter compares the hosts on one Envoy). "
        "One Envoy worker per sidecar, one engine replica each. hit = one input stored by one warm request, "
        "asked with 64 request ids cycled; miss = every input new (forwarded and stored), for scale. "
        f"Rounds: {rounds}, the meshes interleaved (order alternating), mean of the rounds; {duration:g} s "
        f"measured per row (grpc.aio after a {warmup:g} s warm-up run). grpc.aio = a closed loop of C callers "
        "(Python, raw bytes) in the benchmark's process; h2load = C connections, one stream each. Sidecar CPU "
        "= the engine pod's sidecar Envoy's user + system µs per request during the row. The load generator "
        "shares the machine with both meshes. 1-minute load average "
        f"{load[0]:.2f} when the run started, {load[1]:.2f} when it ended, on {os.cpu_count()} cores.",
        "",
        table(["host (sidecar Envoy)", "case", "client", "concurrency", "requests/s", "p50 ms", "p99 ms",
               "sidecar CPU µs/req", "errors", "Cache-Status seen"], lines),
        "",
        "Hits, native over Wasm (below 1 = native faster for latency and CPU; above 1 = more req/s):",
        "",
        table(["client", "concurrency", "p50", "p99", "requests/s", "sidecar CPU µs/req"], host_ratios(rows)),
    ])


def _start(stack: contextlib.ExitStack, tmp: Path, host: str) -> IstiodMesh:
    check_prerequisites(host)
    print(f"starting the {host} istiod mesh ...", flush=True)
    started = time.monotonic()
    mesh = stack.enter_context(IstiodMesh(IstiodMeshConfig(work_dir=tmp / host, canary_color="", policies=POLICIES,
                                                           filter=host), log=lambda m: print(f"  {m}", flush=True)))
    print(f"{host} mesh up in {time.monotonic() - started:.0f} s", flush=True)
    return mesh


def _sidecar_pid(mesh: IstiodMesh) -> int:
    sidecar = mesh.engines[0].sidecar
    assert sidecar is not None
    return sidecar.envoy.popen.pid


def _call(mesh: IstiodMesh, request: bytes) -> str:
    """One call through the client sidecar; its Cache-Status."""
    return grpc_call(mesh.app_grpc, request, authority=f"{mesh.service_authority}:8001", timeout=30)[1]


def measure_round(mesh: IstiodMesh, host: str, n: int, levels: list[int], hit: Callable[[int], bytes],
                  miss: Callable[[int], bytes], frame: Path, duration: float, warmup: float) -> list[Measured]:
    """Round `n` through one mesh: per concurrency, grpc.aio hits, h2load hits, grpc.aio misses."""
    authority = f"{mesh.service_authority}:8001"
    pid = _sidecar_pid(mesh)
    out = []
    for c in levels:
        for case, payload in (("hit", hit), ("miss", miss)):
            print(f"round {n + 1}, {host}, {case}, grpc.aio, concurrency {c} ...", flush=True)
            statuses: collections.Counter[str] = collections.Counter()
            # Warm up apart from the measured loop, so the sidecar's CPU is read around measured calls only.
            asyncio.run(closed_loop(mesh.app_grpc, payload, c, 0, warmup, collections.Counter(), authority))
            cpu = cpu_seconds(pid)
            r = asyncio.run(closed_loop(mesh.app_grpc, payload, c, 0, duration, statuses, authority))
            cpu_us = (cpu_seconds(pid) - cpu) * 1e6 / max(1, len(r.latencies) + r.errors)
            p50, p99 = (r.percentile(0.5) * 1e3, r.percentile(0.99) * 1e3) if r.latencies else (None, None)
            out.append(Measured(host, case, "grpc.aio", c, r.throughput, p50, p99, r.errors, cpu_us, dict(statuses),
                                quantiles_ms(r.latencies) if r.latencies else None))
            if case == "hit":
                print(f"round {n + 1}, {host}, hit, h2load, {c} connection(s) ...", flush=True)
                cpu = cpu_seconds(pid)
                h = h2load(f"http://{mesh.app_grpc}{MODEL_INFER}", frame,
                           ["content-type: application/grpc", "te: trailers", f":authority: {authority}"],
                           seconds=max(1, int(duration)), connections=c)
                cpu_us = (cpu_seconds(pid) - cpu) * 1e6 / max(1, h.requests)
                seen = _call(mesh, hit(0))  # the h2load run measured hits: the request still is one
                if "; hit" not in seen:
                    raise AssertionError(f"{host}: after h2load's run the request is not a hit: {seen!r}")
                out.append(Measured(host, "hit", "h2load", c, h.rps, h.p50_ms, h.p99_ms, h.errors, cpu_us, {},
                                    h.quantiles_ms))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--duration", type=float, default=5.0, help="measured seconds per row")
    parser.add_argument("--warmup", type=float, default=1.0, help="grpc.aio warm-up seconds per row")
    parser.add_argument("--levels", default="1,8", help="closed-loop concurrency levels")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = parser.parse_args(argv)
    levels = [int(c) for c in args.levels.split(",")]
    load_before = os.getloadavg()[0]
    base = resnet_request(7)
    tag = str(time.time_ns())  # ids and inputs no earlier run's cache holds
    stored = [request_with(base, f"hit-{tag}-{i}") for i in range(64)]
    first = float(time.time_ns() % 1_000_000)
    fresh = itertools.count()  # every miss of the run a new input (float32 holds integers to 2^24 exactly)
    rows: list[Measured] = []
    with tempfile.TemporaryDirectory(prefix="meshcache-bench-mesh-hosts-") as tmp, contextlib.ExitStack() as stack:
        meshes = {host: _start(stack, Path(tmp), host) for host in HOSTS}
        frame = Path(tmp) / "request.bin"
        frame.write_bytes(b"\0" + len(stored[0]).to_bytes(4, "big") + stored[0])  # one gRPC frame
        for host, mesh in meshes.items():
            warm = _call(mesh, stored[0])
            again = _call(mesh, stored[1])  # another request id: the same entry
            if "stored" not in warm or "; hit" not in again:
                raise AssertionError(f"{host}: warming gave {warm!r}, then {again!r}")

        def miss(_: int) -> bytes:
            k = next(fresh)
            return request_with(base, f"miss-{tag}-{k}", first + k)

        for n in range(args.rounds):
            for host in HOSTS if n % 2 == 0 else tuple(reversed(HOSTS)):
                rows += measure_round(meshes[host], host, n, levels, lambda i: stored[i % len(stored)], miss, frame,
                                      args.duration, args.warmup)
    merged = sorted(merge_rounds(rows), key=lambda r: (r.case != "hit", r.client, r.concurrency, HOSTS.index(r.host)))
    body = render(merged, args.duration, args.warmup, args.rounds, (load_before, os.getloadavg()[0]))
    print(body)
    if not args.no_write:
        stored_rows = [{"host": r.host, "case": r.case, "client": r.client, "concurrency": r.concurrency,
                        "rps": round(r.rps, 1), "rounds_rps": [round(x, 1) for x in r.rounds_rps],
                        "p50_ms": r.p50_ms, "p99_ms": r.p99_ms, "errors": r.errors, "sidecar_cpu_us": r.cpu_us,
                        "cache_status": r.statuses, **({"quantiles_ms": r.quantiles_ms} if r.quantiles_ms else {})}
                       for r in merged]
        publish("mesh-hosts", "Istio meshes: gRPC hits through istiod-configured sidecars, Wasm vs native "
                "(`python -m bench.mesh_hosts`)", body,
                {"rows": stored_rows, "rounds": args.rounds, "load_average_1m_before": load_before,
                 "ratios": [dict(zip(("client", "concurrency", "p50", "p99", "rps", "cpu"), m, strict=True))
                            for m in host_ratios(merged)]})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
