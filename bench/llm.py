"""Chat completions through the local mesh (`python -m bench.llm`): exact misses and hits, stream
and non-stream, with the engine's LLM demo models (docs/llm.md). Writes the `llm` section of
docs/benchmarks.md.

One client (httpx) sends each of N fresh deterministic prompts twice to the client sidecar's app
port (plaintext HTTP/1.1; mTLS to the server sidecar with the filter; the engine on a miss): the
first is a miss, the second a hit. Tokens saved per second = the `usage` tokens (prompt +
completion) of the hits divided by the hits' wall time: what one client is served from the cache
instead of the engine.

The semantic layer (the LLM demo policies turn it on at the shipped threshold; the mesh runs the
semantic index service): each of N fresh prompts, then the same prompt in capitals (an exact
miss the embedder scores 1.0), gives the semantic hit latency; the same misses with the policy's
`semantic` off give the lookup's added latency on a miss (p50/p99, on minus off). Whether the
filter made semantic lookups at all is read from the service's own counters: when it made none
(a filter build without the semantic layer), the rows say so and the lookup's cost is measured
against the service directly (POST /v1/semantic/lookup on a scope holding the N prompts: embed +
search, what the filter would wait for). The index's memory per 10k entries is the
`semantic-index` section (bench/semantic_index.py).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from bench.report import write_section
from meshcache.contract.filter_config import DEMO_POLICIES, LLM_DEMO_POLICIES
from meshcache.ctl.mesh.api_client import PolicyApi
from meshcache.ctl.mesh.config import MeshConfig
from meshcache.ctl.mesh.demo_llm import Chat, chat
from meshcache.ctl.mesh.topology import SERVER_NODE, Mesh
from meshcache.semantic import DEFAULT_THRESHOLD

POLICY = "llama3-"
INDEX_WAIT_S = 2.0


def _body(i: int, tag: int, stream: bool, max_tokens: int) -> dict[str, object]:
    return {"model": "llama3-70b-demo", "temperature": 0, "max_tokens": max_tokens,
            **({"stream": True, "stream_options": {"include_usage": True}} if stream else {}),
            "messages": [{"role": "system", "content": "You are terse."},
                         {"role": "user", "content": f"question {tag}-{i}: what is the river near the harbor?"}]}


def run(http: httpx.Client, n: int, stream: bool, max_tokens: int, tag: int) -> tuple[list[Chat], list[Chat]]:
    misses, hits = [], []
    for i in range(n):
        body = _body(i, tag, stream, max_tokens)
        first, again = chat(http, body), chat(http, body)
        if "; hit" in first.cache_status or "; hit" not in again.cache_status or first.body != again.body:
            raise RuntimeError(f"expected a miss then the same answer as a hit: {first.cache_status!r}, "
                               f"{again.cache_status!r}")
        misses.append(first)
        hits.append(again)
    return misses, hits


def _p(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


def _lookups(semantic: httpx.Client) -> int:
    return int(semantic.get("/v1/semantic/stats").json()["lookups"])


def _entries(semantic: httpx.Client) -> int:
    return int(semantic.get("/v1/semantic/stats").json()["entries"])


def _wait_entries(semantic: httpx.Client, above: int) -> bool:
    deadline = time.monotonic() + INDEX_WAIT_S
    while time.monotonic() < deadline:
        if _entries(semantic) > above:
            return True
        time.sleep(0.02)
    return False


def semantic_rows(http: httpx.Client, semantic: httpx.Client, api: PolicyApi, n: int, max_tokens: int,
                  stream: bool) -> dict[str, object]:
    """Misses with the layer on (each then asked again in capitals: a semantic hit if the filter
    makes lookups), then misses with it off; the service's counters say whether it was used."""
    tag = time.time_ns()
    lookups0 = _lookups(semantic)
    on_misses: list[Chat] = []
    semantic_hits: list[Chat] = []
    for i in range(n):
        body = _body(i, tag, stream, max_tokens)
        before = _entries(semantic)
        on_misses.append(chat(http, body))
        _wait_entries(semantic, before)
        upper = {**body, "messages": [body["messages"][0],  # type: ignore[index]
                                      {"role": "user", "content": body["messages"][1]["content"].upper()}]}  # type: ignore[index]
        again = chat(http, upper)
        if "detail=semantic" in again.cache_status:
            semantic_hits.append(again)
    made = _lookups(semantic) - lookups0
    version = api.patch(POLICY, {"semantic": None})["version"]
    api.wait_acked(SERVER_NODE, version)
    try:
        off_misses = [chat(http, _body(i, tag + 1, stream, max_tokens)) for i in range(n)]
    finally:
        version = api.patch(POLICY, {"semantic": LLM_DEMO_POLICIES[POLICY]["semantic"]})["version"]
        api.wait_acked(SERVER_NODE, version)
    tokens = sum(c.usage["prompt_tokens"] + c.usage["completion_tokens"] for c in semantic_hits if c.usage)
    hit_ms = [c.ms for c in semantic_hits]
    return {"kind": "stream" if stream else "non-stream", "lookups": made, "n": n, "hits": len(semantic_hits),
            "hit_p50": _p(hit_ms, 50), "hit_p99": _p(hit_ms, 99),
            "tokens_per_s": tokens / (sum(hit_ms) / 1000) if hit_ms else float("nan"),
            "on_p50": _p([c.ms for c in on_misses], 50), "on_p99": _p([c.ms for c in on_misses], 99),
            "off_p50": _p([c.ms for c in off_misses], 50), "off_p99": _p([c.ms for c in off_misses], 99)}


def direct_lookup_ms(semantic: httpx.Client, n: int) -> tuple[float, float]:
    """The lookup the filter would make on a miss, against the service directly: a scope holding
    n prompts, looked up with n others (embedding on the engine + search), over HTTP."""
    scope = f"{time.time_ns():064x}"[-64:]
    for i in range(n):
        semantic.post("/v1/semantic/store", json={"policy": POLICY, "scope": scope, "ttl_s": 600, "key": f"k{i}",
                                                  "text": f"question {i}: what is the river near the harbor?"}
                      ).raise_for_status()
    ms = []
    for i in range(n):
        t0 = time.perf_counter()
        semantic.post("/v1/semantic/lookup", json={"scope": scope, "threshold": DEFAULT_THRESHOLD,
                                                   "text": f"question {i + n}: which river is near the harbor?"}
                      ).raise_for_status()
        ms.append((time.perf_counter() - t0) * 1000)
    semantic.post("/v1/semantic/purge", json={"scope": scope}).raise_for_status()
    return _p(ms, 50), _p(ms, 99)


def _semantic_lines(sem: list[dict[str, object]], direct: tuple[float, float]) -> list[str]:
    used = [r for r in sem if r["lookups"]]
    lines = ["", "Semantic layer (`llama3-` policy, threshold "
             f"{DEFAULT_THRESHOLD}; each prompt then the same prompt in capitals, an exact miss):", ""]
    if used:
        lines += ["| answer | semantic lookups | semantic hits | semantic hit p50 ms | hit p99 ms | tokens saved / s "
                  "(semantic hits) | miss p50 ms, layer on / off | miss p99 ms, on / off | added p50 / p99 ms |",
                  "|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['kind']} | {r['lookups']} | {r['hits']} of {r['n']} | {r['hit_p50']:.2f} | {r['hit_p99']:.2f} "
                  f"| {r['tokens_per_s']:,.0f} | {r['on_p50']:.1f} / {r['off_p50']:.1f} | {r['on_p99']:.1f} / "
                  f"{r['off_p99']:.1f} | {r['on_p50'] - r['off_p50']:+.1f} / {r['on_p99'] - r['off_p99']:+.1f} |"
                  for r in sem]  # type: ignore[operator]
    else:
        lines += ["The filter in this build made **no semantic lookups** (the semantic index service counted 0 "
                  "during the run): no semantic hits to time, and the misses with the layer on and off differ "
                  "only by noise (" + "; ".join(f"{r['kind']} miss p50 {r['on_p50']:.1f} / {r['off_p50']:.1f} ms"
                                                for r in sem) + ")."]
    lines += ["", f"The lookup measured against the service directly (what a miss of a semantic policy waits for: "
              f"embedding on the engine + search, over HTTP, a scope of prompts): p50 {direct[0]:.2f} ms, p99 "
              f"{direct[1]:.2f} ms. Memory per 10k index entries: the `semantic-index` section."]
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", type=int, default=40, help="prompts per case (each sent twice)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)
    rows = []
    sem: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory(prefix="meshcache-bench-llm-") as tmp:
        config = MeshConfig(state_dir=Path(tmp), canary_color="", llm=True,
                            policies={**DEMO_POLICIES, **LLM_DEMO_POLICIES}).with_free_ports()
        with Mesh(config, log=lambda m: print(f"  {m}", flush=True)) as mesh, \
                httpx.Client(base_url=f"http://{mesh.endpoints()['app']}", timeout=60) as http:
            chat(http, _body(-1, 0, False, 4))  # connections and the models' first run
            for stream in (False, True):
                misses, hits = run(http, args.n, stream, args.max_tokens, time.time_ns())
                m, h = np.asarray([c.ms for c in misses]), np.asarray([c.ms for c in hits])
                tokens = sum(c.usage["prompt_tokens"] + c.usage["completion_tokens"] for c in hits if c.usage)
                rows.append((("stream" if stream else "non-stream"), float(np.percentile(m, 50)),
                             float(np.percentile(m, 99)), float(np.percentile(h, 50)), float(np.percentile(h, 99)),
                             tokens / (h.sum() / 1000), tokens / len(hits)))
            with httpx.Client(base_url=mesh.endpoints()["semantic"], timeout=30) as semantic, mesh.api() as api:
                sem = [semantic_rows(http, semantic, api, args.n, args.max_tokens, stream) for stream in (False, True)]
                direct = direct_lookup_ms(semantic, args.n)
    body = "\n".join([
        f"`python -m bench.llm -n {args.n} --max-tokens {args.max_tokens}`: `llama3-70b-demo` (llama3-tiny, greedy) "
        "through the local mesh (client sidecar, mTLS, server sidecar with the Wasm filter, engine), one client, "
        f"each of {args.n} fresh prompts twice (a miss, then a hit). Load average "
        f"{os.getloadavg()[0]:.0f} at the end (2 cores shared with other work).", "",
        "| answer | miss p50 ms | miss p99 ms | hit p50 ms | hit p99 ms | tokens saved / s (one client) | "
        "tokens per answer |", "|---|---|---|---|---|---|---|",
        *(f"| {r[0]} | {r[1]:.1f} | {r[2]:.1f} | {r[3]:.2f} | {r[4]:.2f} | {r[5]:,.0f} | {r[6]:.0f} |" for r in rows),
        "", "A streamed miss is timed to its last event (the whole answer); the exact misses above are of a "
        "policy with the semantic layer on.",
        *_semantic_lines(sem, direct),
    ])
    print(body)
    if not args.no_write:
        write_section("llm", "LLM chat completions through the mesh: exact and semantic hits, misses", body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
