"""The full local mesh with `resnet-mini` (`python -m bench.mesh`): misses, hits, cache disabled.

Every request takes the app's path: plaintext gRPC to the client sidecar, HTTP/2 + mTLS (TLS 1.3)
to the server sidecar with the meshcache filter, and on a miss the engine. The mesh is the one
`meshcache up` starts (one Envoy worker per sidecar), without the canary engine.

- miss: every request is new (its input tensor differs in one element; the request `id` would
  not do, the cache key leaves it out), so each one is forwarded to the engine and stored;
- hit: one stored input asked with 64 request ids cycled (each hit carries its caller's id);
- cache disabled: the same 64 requests with the model's policy `enabled: false` (the filter runs
  and bypasses; the engine answers every time).

Latency comes from a closed loop of C callers (grpc.aio, raw bytes) in this process; the load
generator shares the machine's cores with the mesh, as an app and its sidecar do. h2load (a C
client) repeats one request for hits and for the disabled cache, at 1 and 16 connections, so
the Python client's own cost can be told apart. Writes the `mesh` section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import itertools
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np

from bench.loadgen import LoadResult, h2load
from bench.report import publish, table
from bench.stats import LatencyResult, ms, quantiles_ms
from meshcache.contract.protos import grpc_predict_v2_pb2 as pb
from meshcache.ctl.mesh.config import MeshConfig
from meshcache.ctl.mesh.topology import SERVER_NODE, Mesh
from tests.helpers.kserve import MODEL_INFER, RESNET, resnet_request

TARGET_RATIO = 0.1


def request_with(base: pb.ModelInferRequest, request_id: str, first_value: float | None = None) -> bytes:
    """`base` with this request id and, if given, its tensor's first element replaced (a new key)."""
    request = pb.ModelInferRequest()
    request.CopyFrom(base)
    request.id = request_id
    if first_value is not None:
        raw = request.raw_input_contents[0]
        request.raw_input_contents[0] = np.float32(first_value).tobytes() + raw[4:]
    return request.SerializeToString()


def _status_kind(cache_status: str) -> str:
    """What the cache did, from Cache-Status: hit, stored (a miss it stored), bypass, other."""
    if "; hit" in cache_status:
        return "hit"
    if "fwd=miss; stored" in cache_status:
        return "stored"
    return "bypass" if "fwd=bypass" in cache_status else cache_status or "none"


async def closed_loop(target: str, payload: Callable[[int], bytes], concurrency: int, warmup: float,
                      duration: float, statuses: collections.Counter[str], authority: str = "") -> LatencyResult:
    """Closed loop of `concurrency` callers; counts the measured answers' Cache-Status kinds.
    `authority`: the `:authority` to send (the Service name a sidecar's egress routes on)."""
    latencies: list[float] = []
    errors = 0
    kinds: collections.Counter[str] = collections.Counter()
    counter = itertools.count()
    options = [("grpc.default_authority", authority)] if authority else []
    async with grpc.aio.insecure_channel(target, options=options) as channel:
        call = channel.unary_unary(MODEL_INFER)  # bytes in and out: no client-side protobuf work
        start = time.perf_counter()
        measure_from, stop_at = start + warmup, start + warmup + duration

        async def caller() -> None:
            nonlocal errors
            while True:
                body = payload(next(counter))
                sent = time.perf_counter()
                if sent >= stop_at:
                    return
                try:
                    pending = call(body, timeout=30)
                    await pending
                except grpc.aio.AioRpcError as exc:
                    errors += 1
                    kinds[f"{exc.code().name}: {(exc.details() or '')[:120]}"] += 1
                    continue
                if sent >= measure_from:
                    latencies.append(time.perf_counter() - sent)
                    metadata = dict(await pending.initial_metadata())
                    statuses[_status_kind(str(metadata.get("cache-status", "")))] += 1

        await asyncio.gather(*[caller() for _ in range(concurrency)])
    for kind, n in kinds.items():
        print(f"  {n} errors: {kind}", flush=True)
    return LatencyResult(latencies, duration, errors)


def _set_enabled(mesh: Mesh, enabled: bool) -> None:
    with mesh.api() as api:
        version = api.put(RESNET, {"ttl_s": 3600, "max_ttl_s": 3600, "enabled": enabled})["version"]
        api.wait_acked(SERVER_NODE, version)


def _h2load_levels(case: str, app: str, data: Path, tmp: Path, seconds: int) -> dict[int, LoadResult]:
    """One request body over and over (h2load cannot vary it): hits, or the disabled cache."""
    out = {}
    for c in (1, 16):
        print(f"{case}, h2load, {c} connection(s) ...", flush=True)
        out[c] = h2load(f"http://{app}{MODEL_INFER}", data, ["content-type: application/grpc", "te: trailers"],
                        seconds=seconds, connections=c, log_file=tmp / f"h2load-{case.replace(' ', '-')}-{c}.log")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--duration", type=float, default=6.0, help="measured seconds per case")
    parser.add_argument("--warmup", type=float, default=1.5)
    parser.add_argument("--levels", default="1,8", help="closed-loop concurrency levels")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = parser.parse_args(argv)
    levels = [int(c) for c in args.levels.split(",")]
    load_before = os.getloadavg()[0]
    base = resnet_request(7)
    run_tag = str(time.time_ns())  # ids never seen by a previous run's cache
    stored = [request_with(base, f"hit-{run_tag}-{i}") for i in range(64)]
    results: dict[tuple[str, int], LatencyResult] = {}
    seen: dict[tuple[str, int], collections.Counter[str]] = collections.defaultdict(collections.Counter)
    with tempfile.TemporaryDirectory(prefix="meshcache-bench-mesh-") as tmp:
        config = dataclasses.replace(MeshConfig(state_dir=Path(tmp)), canary_color="").with_free_ports()
        with Mesh(config, log=lambda m: print(f"  {m}", flush=True)) as mesh:
            app = mesh.endpoints()["app"]
            _set_enabled(mesh, True)
            store_it = closed_loop(app, lambda i: stored[i % len(stored)], 1, 0, 0.5, collections.Counter())  # warm
            asyncio.run(store_it)
            first = float(time.time_ns() % 1_000_000)  # inputs no previous run's cache holds
            cases: dict[str, Callable[[int], bytes]] = {
                "miss": lambda i: request_with(base, f"miss-{run_tag}-{i}", first + i),
                "hit": lambda i: stored[i % len(stored)],
            }
            for case, payload in cases.items():
                for c in levels:
                    print(f"{case}, concurrency {c} ...", flush=True)
                    results[(case, c)] = asyncio.run(
                        closed_loop(app, payload, c, args.warmup, args.duration, seen[(case, c)]))
            data = Path(tmp) / "request.bin"
            data.write_bytes(b"\0" + len(stored[0]).to_bytes(4, "big") + stored[0])  # one gRPC frame
            h2_cases = {"hit": _h2load_levels("hit", app, data, Path(tmp), int(args.duration))}
            _set_enabled(mesh, False)
            for c in levels:
                print(f"cache disabled, concurrency {c} ...", flush=True)
                results[("cache disabled", c)] = asyncio.run(closed_loop(
                    app, lambda i: stored[i % len(stored)], c, args.warmup, args.duration, seen[("cache disabled", c)]))
            h2_cases["cache disabled"] = _h2load_levels("cache disabled", app, data, Path(tmp), int(args.duration))
    rows, stored = [], []
    for (case, c), r in results.items():
        statuses = ", ".join(f"{kind} {n}" for kind, n in seen[(case, c)].most_common())
        rows.append([case, "grpc.aio", c, f"{r.throughput:.0f}", ms(r.percentile(0.5)), ms(r.percentile(0.99)),
                     r.errors, statuses])
        stored.append({"case": case, "client": "grpc.aio", "concurrency": c, "rps": round(r.throughput, 1),
                       "p50_ms": r.percentile(0.5) * 1e3, "p99_ms": r.percentile(0.99) * 1e3, "errors": r.errors,
                       "cache_status": dict(seen[(case, c)]), "quantiles_ms": quantiles_ms(r.latencies)})
    for case, by_level in h2_cases.items():
        for c, h in by_level.items():
            rows.append([case, "h2load", c, f"{h.rps:.0f}", f"{h.p50_ms:.2f}" if h.p50_ms else "",
                         f"{h.p99_ms:.2f}" if h.p99_ms else "", h.errors, ""])
            stored.append({"case": case, "client": "h2load", "concurrency": c, "rps": round(h.rps, 1),
                           "p50_ms": h.p50_ms, "p99_ms": h.p99_ms, "errors": h.errors,
                           **({"quantiles_ms": h.quantiles_ms} if h.quantiles_ms else {})})
    ratios = []
    for c in levels:
        ratio = results[("hit", c)].percentile(0.5) / results[("miss", c)].percentile(0.5)
        ratios.append([f"hit p50 / miss p50, concurrency {c}", f"{ratio:.3f}", f"<= {TARGET_RATIO}",
                       "yes" if ratio <= TARGET_RATIO else "no"])
    for c in (1, 16):
        hit, off = h2_cases["hit"][c], h2_cases["cache disabled"][c]
        if hit.p50_ms and off.p50_ms:
            ratio = hit.p50_ms / off.p50_ms
            ratios.append([f"hit p50 / cache-disabled p50 (h2load, {c} connection(s); the engine path without "
                           "the store)", f"{ratio:.3f}", "", ""])
    body = "\n".join([
        "`python -m bench.mesh`: gRPC `ModelInfer` for `resnet-mini` (1x3x32x32 FP32, raw contents) through the "
        "whole local mesh: app -> client sidecar (plaintext h2c) -> server sidecar (HTTP/2 over mTLS, TLS 1.3, "
        "meshcache filter from ECDS) -> engine on a miss. One Envoy worker per sidecar; engine with the demo "
        "config (dynamic batching, max_queue_delay 1 ms). Closed loop of C callers (Python grpc.aio, raw bytes) "
        f"in one process on the same machine; {args.duration:g} s measured per row after {args.warmup:g} s "
        "warm-up. miss = every request new (one tensor element differs; a new `id` alone would be a hit, the "
        "key leaves ids out), forwarded and stored; hit = one stored input asked with 64 request ids cycled; "
        "cache disabled = the same requests with the policy's `enabled: false`. The Cache-Status column "
        "counts what the cache said for each measured grpc.aio answer. h2load rows (one "
        "thread, C connections, one stream each; p50/p99 from its per-request log) repeat one stored request. "
        f"1-minute load average when the run started: {load_before:.2f} on {os.cpu_count()} cores.",
        "",
        table(["case", "client", "concurrency", "requests/s", "p50 ms", "p99 ms", "errors", "Cache-Status seen"], rows),
        "",
        table(["measure", "value", "target", "met"], ratios),
    ])
    print(body)
    if not args.no_write:
        publish("mesh", "Local mesh: misses, hits and cache disabled (resnet-mini, gRPC, mTLS)", body,
                {"rows": stored,
                 "measures": [dict(zip(("measure", "value", "target", "met"), m, strict=True)) for m in ratios]})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
