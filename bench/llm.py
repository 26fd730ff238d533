"""Chat completions through the local mesh (`python -m bench.llm`): exact misses and hits, stream
and non-stream, with the engine's LLM demo models (docs/llm.md). Writes the `llm` section of
docs/benchmarks.md.

One client (httpx) sends each of N fresh deterministic prompts twice to the client sidecar's app
port (plaintext HTTP/1.1; mTLS to the server sidecar with the filter; the engine on a miss): the
first is a miss, the second a hit. Tokens saved per second = the `usage` tokens (prompt +
completion) of the hits divided by the hits' wall time: what one client is served from the cache
instead of the engine. The semantic layer is not in the filter yet: its lookup cost and memory
are the `semantic-index` section (bench/semantic_index.py).
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
from meshcache.ctl.mesh.config import MeshConfig
from meshcache.ctl.mesh.demo_llm import Chat, chat
from meshcache.ctl.mesh.topology import Mesh


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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", type=int, default=40, help="prompts per case (each sent twice)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)
    rows = []
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
    body = "\n".join([
        f"`python -m bench.llm -n {args.n} --max-tokens {args.max_tokens}`: `llama3-70b-demo` (llama3-tiny, greedy) "
        "through the local mesh (client sidecar, mTLS, server sidecar with the Wasm filter, engine), one client, "
        f"each of {args.n} fresh prompts twice (a miss, then a hit). Load average "
        f"{os.getloadavg()[0]:.0f} at the end (2 cores shared with other work).", "",
        "| answer | miss p50 ms | miss p99 ms | hit p50 ms | hit p99 ms | tokens saved / s (one client) | "
        "tokens per answer |", "|---|---|---|---|---|---|---|",
        *(f"| {r[0]} | {r[1]:.1f} | {r[2]:.1f} | {r[3]:.2f} | {r[4]:.2f} | {r[5]:,.0f} | {r[6]:.0f} |" for r in rows),
        "", "A streamed miss is timed to its last event (the whole answer). Semantic hits are not measured "
        "through the mesh yet (the filter does not call the semantic index); the index's lookup cost is the "
        "`semantic-index` section.",
    ])
    print(body)
    if not args.no_write:
        write_section("llm", "LLM chat completions through the mesh: exact hits and misses", body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
