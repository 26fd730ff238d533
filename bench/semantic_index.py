"""The semantic index's memory per 10k entries and its lookup latency (docs/benchmarks.md, section
`semantic-index`): the index alone (numpy, in process), and the service over HTTP with the real
engine embedding each lookup's text (what an exact miss of a semantic policy waits for).

    .venv/bin/python -m bench.semantic_index
"""

from __future__ import annotations

import argparse
import hashlib
import os
import tempfile
import time
import tracemalloc
from pathlib import Path

import httpx
import numpy as np

from bench.report import write_section
from meshcache.ctl import launchers, procs
from meshcache.semantic import DIMS
from meshcache.semantic.index import SemanticIndex

ENTRIES = 10_000


def _hex(n: int) -> str:
    return hashlib.sha256(str(n).encode()).hexdigest()


def _unit(rng: np.random.Generator, n: int) -> np.ndarray:
    v = rng.standard_normal((n, DIMS)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def memory_per_10k(per_scope: int) -> float:
    """Bytes the index holds for ENTRIES entries, `per_scope` in each scope (keys and hashes 64 hex)."""
    rng = np.random.default_rng(0)
    vectors = _unit(rng, ENTRIES)
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    index = SemanticIndex(DIMS, max_entries=ENTRIES, max_per_scope=per_scope)
    for i in range(ENTRIES):
        index.store("llama3-", _hex(i // per_scope), vectors[i], _hex(i + 10**6), 600, _hex(i + 10**7))
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    assert len(index) == ENTRIES
    return used * 10_000 / ENTRIES


def quantiles(ms: list[float]) -> tuple[float, float]:
    return float(np.percentile(ms, 50)), float(np.percentile(ms, 99))


def index_lookup_ms(per_scope: int, n: int = 2000) -> tuple[float, float]:
    rng = np.random.default_rng(1)
    index = SemanticIndex(DIMS, max_entries=per_scope, max_per_scope=per_scope)
    for i, v in enumerate(_unit(rng, per_scope)):
        index.store("llama3-", _hex(0), v, _hex(i), 600)
    queries = _unit(rng, n)
    ms = []
    for q in queries:
        t0 = time.perf_counter()
        index.lookup(_hex(0), q)
        ms.append((time.perf_counter() - t0) * 1000)
    return quantiles(ms)


def service_lookup_ms(engine_url: str, log_dir: Path, n: int = 300) -> dict[str, tuple[float, float]]:
    """p50/p99 of POST /v1/semantic/lookup: a scope without entries (no embedding) and one with 100."""
    service = launchers.start_semantic(engine_url, log_dir)
    out: dict[str, tuple[float, float]] = {}
    with procs.supervised([service.proc]), httpx.Client(base_url=service.url, timeout=30) as http:
        full, empty = _hex(1), _hex(2)
        for i in range(100):
            http.post("/v1/semantic/store", json={"policy": "llama3-", "scope": full, "text": f"question {i} about "
                      f"topic {i * 7 % 13}", "key": _hex(i), "ttl_s": 600}).raise_for_status()
        for name, scope in (("empty scope (no embedding)", empty), ("scope of 100 entries (embedding + search)", full)):
            ms = []
            for i in range(n):
                body = {"scope": scope, "text": f"how would I ask question number {i}?", "threshold": 0.999}
                t0 = time.perf_counter()
                http.post("/v1/semantic/lookup", json=body).raise_for_status()
                ms.append((time.perf_counter() - t0) * 1000)
            out[name] = quantiles(ms)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)
    memory = {per_scope: memory_per_10k(per_scope) for per_scope in (1, 100, 1000)}
    alone = {per_scope: index_lookup_ms(per_scope) for per_scope in (100, 1000)}
    with tempfile.TemporaryDirectory(prefix="meshcache-semantic-index-") as tmp:
        repo = launchers.init_demo_models(Path(tmp) / "models", llm=True)
        engine = launchers.start_engine(repo, Path(tmp) / "logs")
        with procs.supervised([engine.proc]):
            served = service_lookup_ms(engine.http_url, Path(tmp) / "logs")
    lines = [
        "`python -m bench.semantic_index`. Memory: Python heap (tracemalloc) of the index holding 10,000 "
        f"entries of {DIMS} float32 dimensions (1,536 bytes of vector each), 64-hex scope, key and response "
        "hash, by entries per scope:", "",
        "| entries per scope | bytes per 10k entries | bytes per entry |", "|---|---|---|",
        *(f"| {k} | {v / 2**20:.1f} MiB | {v / 10_000:.0f} |" for k, v in memory.items()),
        "", f"Lookup latency (p50 / p99, one client, 2 cores shared with other work: load average "
            f"{os.getloadavg()[0]:.0f} at the end of the run):", "",
        "| what | p50 ms | p99 ms |", "|---|---|---|",
        *(f"| index alone, a scope of {k} entries | {a:.3f} | {b:.3f} |" for k, (a, b) in alone.items()),
        *(f"| service over HTTP, {k} | {a:.2f} | {b:.2f} |" for k, (a, b) in served.items()),
        "", "A lookup in a scope with entries embeds the text on the engine first (all-minilm-l6-v2, one "
        "sentence); that is most of its time. A scope with no entries (every first prompt of a conversation "
        "shape) answers without embedding.",
    ]
    body = "\n".join(lines)
    print(body)
    if not args.no_write:
        write_section("semantic-index", "Semantic index: memory per 10k entries, lookup latency", body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
