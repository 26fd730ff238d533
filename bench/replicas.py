"""Hit ratio vs replicas (`python -m bench.replicas`): each sidecar caches on its own.

A model served by N replicas has N sidecars, each with its own cache (Envoy shared data is per
Envoy process). Requests spread over the replicas round-robin (as a Kubernetes Service or
Envoy's ROUND_ROBIN does), so a request repeated k times can miss once per replica it reaches.
Here: N Envoys with the filter (one worker each) in front of one trivial origin (nginx, the
same as bench.filter), the same request sequence for every N: R requests drawn from K distinct
bodies with Zipf-distributed popularity (fixed seed). Hits and misses are the filter's own
answers (Cache-Status), checked against its counters.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from bench.filter import start_origin
from bench.report import publish, table
from meshcache.contract.headers import CACHE_STATUS_HEADER
from meshcache.contract.paths import require_filter_wasm
from meshcache.ctl import launchers, procs
from meshcache.ctl.envoy_config import CacheProxy, write

REPLICAS = (1, 2, 4, 8)


def request_sequence(requests: int, distinct: int, zipf_s: float, seed: int) -> list[int]:
    """Which of `distinct` bodies each request sends: rank r has weight 1 / r**s."""
    weights = 1.0 / np.arange(1, distinct + 1) ** zipf_s
    rng = np.random.default_rng(seed)
    return [int(i) for i in rng.choice(distinct, size=requests, p=weights / weights.sum())]


def run_replicas(n: int, envoys: list[tuple[int, int]], sequence: list[int]) -> dict[str, float]:
    """Send `sequence` round-robin over the first n Envoys; the model name is new for each n."""
    model = f"bench-n{n}"
    evictions_before = _evictions(envoys[:n])
    clients = [httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) for port, _ in envoys[:n]]
    hits = misses = other = 0
    try:
        for i, key in enumerate(sequence):
            body = json.dumps({"inputs": [{"name": "x", "datatype": "INT64", "shape": [1], "data": [key]}]})
            r = clients[i % n].post(f"/v2/models/{model}/infer", content=body,
                                    headers={"content-type": "application/json"})
            status = r.headers.get(CACHE_STATUS_HEADER, "")
            if status.startswith("meshcache; hit"):
                hits += 1
            elif "fwd=miss" in status:
                misses += 1
            else:
                other += 1
    finally:
        for c in clients:
            c.close()
    # Expected misses if each replica misses exactly once per distinct body it sees.
    seen = {(i % n, key) for i, key in enumerate(sequence)}
    return {"replicas": n, "requests": len(sequence), "distinct": len(set(sequence)), "hits": hits,
            "misses": misses, "other": other, "hit_ratio": hits / max(1, hits + misses),
            "expected_misses": len(seen), "evictions": _evictions(envoys[:n]) - evictions_before}


def _evictions(envoys: list[tuple[int, int]]) -> int:
    time.sleep(0.45)  # the filter flushes its counters every 200 ms
    return sum(launchers.envoy_stats(admin, "wasmcustom.meshcache").get("wasmcustom.meshcache.evictions", 0)
               for _, admin in envoys)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=4000)
    p.add_argument("--distinct", type=int, default=500)
    p.add_argument("--zipf", type=float, default=1.1)
    p.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = p.parse_args(argv)
    sequence = request_sequence(args.requests, args.distinct, args.zipf, seed=15)
    policy = {"version": "bench", "policies": [{"model_prefix": f"bench-n{n}", "ttl_s": 3600} for n in REPLICAS]}
    rows = []
    with tempfile.TemporaryDirectory(prefix="meshcache-bench-replicas-") as tmp:
        d = Path(tmp)
        started: list[procs.Proc] = []
        with procs.supervised(started):
            origin = start_origin(d, started)
            http_port, grpc_port = origin["http_port"], origin["grpc_port"]
            envoys = []
            for k in range(max(REPLICAS)):
                listen, admin = procs.free_port(), procs.free_port()
                cfg = CacheProxy(listen_port=listen, admin_port=admin, http_upstream_port=http_port,
                                 grpc_upstream_port=grpc_port, wasm_path=require_filter_wasm(),
                                 plugin_config=policy)
                started.append(launchers.start_envoy(write(cfg, d / f"envoy-{k}.yaml"), admin, d, name=f"envoy-{k}"))
                envoys.append((listen, admin))
            for n in REPLICAS:
                print(f"{n} replica(s) ...", flush=True)
                rows.append(run_replicas(n, envoys, sequence))
    single = rows[0]["hit_ratio"]
    body = "\n\n".join([
        f"`python -m bench.replicas`: {args.requests} HTTP requests drawn from {args.distinct} distinct bodies "
        f"(Zipf s={args.zipf}, fixed seed; {rows[0]['distinct']} distinct ones occur), the same sequence for "
        "every replica count, sent round-robin over N Envoys with the filter (each its own cache, as each "
        "replica's sidecar has), one trivial origin. TTL 1 h, nothing expires and the byte/entry "
        "limits are far away, so a miss is a replica seeing a body for the first time ('first sightings': the "
        "(replica, body) pairs of the sequence) or a slot collision: the store is direct-mapped (16384 slots by "
        "default), so two bodies hashing to one slot evict each other (the filter counts evictions).",
        table(["replicas", "requests", "hits", "misses", "first sightings", "evictions", "hit ratio",
               "vs 1 replica"],
              [[r["replicas"], r["requests"], r["hits"], r["misses"], r["expected_misses"], r["evictions"],
                f"{r['hit_ratio']:.3f}", f"{r['hit_ratio'] / single:.2f}x"] for r in rows]),
    ])
    print(body)
    bad = [r for r in rows if r["other"] or r["misses"] > r["expected_misses"] + r["evictions"]]
    if bad:
        print(f"unexpected answers: {bad}")
        return 1
    if not args.no_write:
        publish("replicas", "Hit ratio vs replicas (one cache per sidecar)", body,
                {"rows": rows, "requests": args.requests, "distinct": args.distinct, "zipf_s": args.zipf})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
