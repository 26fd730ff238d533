"""`python -m meshcache.semantic`: run the semantic index service (docs/llm.md)."""

from __future__ import annotations

import argparse

import uvicorn

from meshcache.semantic.embedder import Embedder
from meshcache.semantic.index import SemanticIndex
from meshcache.semantic.service import create_app


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m meshcache.semantic", description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8090)
    p.add_argument("--embedder-url", default="http://127.0.0.1:8000",
                   help="an OpenAI-compatible server with /v1/embeddings (the engine)")
    p.add_argument("--embedder-model", default="all-minilm-l6-v2")
    p.add_argument("--dims", type=int, default=384)
    p.add_argument("--max-entries", type=int, default=100_000, help="entries in all scopes (oldest evicted)")
    p.add_argument("--max-per-scope", type=int, default=1_000, help="entries in one scope (oldest evicted)")
    args = p.parse_args(argv)
    try:
        index = SemanticIndex(args.dims, args.max_entries, args.max_per_scope)
    except ValueError as exc:
        p.error(str(exc))
    app = create_app(index, Embedder(args.embedder_url, args.embedder_model, args.dims))
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
