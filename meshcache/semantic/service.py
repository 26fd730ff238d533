"""The semantic index's HTTP API (FastAPI), for the filter to call on an exact miss (docs/llm.md).

POST /v1/semantic/lookup  {scope, text, threshold, shadow}  -> the scope's most similar entry
POST /v1/semantic/store   {policy, scope, text, key, ttl_s, response_hash}
POST /v1/semantic/purge   {policy} | {scope} | {all: true}
POST /v1/semantic/shadow  {policy, similarity, matched}     (shadow mode: did the answers match)
GET  /v1/semantic/stats, GET /healthz

It listens on loopback next to the cache; it holds no answers (only cache keys), so losing it
loses semantic hits only. Embedding failures are 503: the caller goes upstream (fails open).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import FastAPI, HTTPException, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from meshcache.semantic.embedder import Embedder, EmbedderError
from meshcache.semantic.index import SemanticIndex

MAX_BODY_BYTES = 128 * 1024
MAX_TEXT_CHARS = 32768  # the engine's own bound on one embedding input
MAX_TTL_S = 7 * 86400
SWEEP_INTERVAL_S = 10.0
MAX_SHADOW_POLICIES = 4096  # the filter's own bound on policies

Scope = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$", description="hex SHA-256 of the request's exact scope")]
Policy = Annotated[str, Field(min_length=1, max_length=256, description="the cache policy's model_prefix")]
Text = Annotated[str, Field(min_length=1, max_length=MAX_TEXT_CHARS, description="the last user message")]
Similarity = Annotated[float, Field(ge=-1.0, le=1.0)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class LookupRequest(_Strict):
    scope: Scope
    text: Text
    threshold: Annotated[float, Field(gt=0.0, le=1.0)]
    shadow: bool = False


class StoreRequest(_Strict):
    policy: Policy
    scope: Scope
    text: Text
    key: Annotated[str, Field(min_length=1, max_length=512, description="the exact cache key of the answer")]
    ttl_s: Annotated[int, Field(ge=1, le=MAX_TTL_S)]
    response_hash: Annotated[str, Field(pattern=r"^((xxh3-128:[0-9a-f]{32})|[0-9a-f]{64})?$")] = ""


class PurgeRequest(_Strict):
    policy: Policy | None = None
    scope: Scope | None = None
    all: bool = False

    @model_validator(mode="after")
    def _one(self) -> PurgeRequest:
        if (self.policy is not None) + (self.scope is not None) + self.all != 1:
            raise ValueError("give exactly one of policy, scope or all: true")
        return self


class ShadowReport(_Strict):
    policy: Policy
    similarity: Similarity
    matched: bool


@dataclass
class ShadowCounts:
    would_hit: int = 0
    matched: int = 0
    mismatched: int = 0
    min_mismatched_similarity: float | None = None


def create_app(index: SemanticIndex, embedder: Embedder) -> FastAPI:
    shadow: dict[str, ShadowCounts] = {}
    counts = {"lookups": 0, "hits": 0, "would_hit": 0, "stores": 0, "embedder_errors": 0}

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async def sweep() -> None:
            while True:
                await asyncio.sleep(SWEEP_INTERVAL_S)
                index.sweep()

        task = asyncio.create_task(sweep())
        yield
        task.cancel()
        await embedder.close()

    app = FastAPI(title="meshcache semantic index", lifespan=lifespan, docs_url=None, redoc_url=None)

    @app.middleware("http")
    async def bounded_body(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        length = request.headers.get("content-length")
        if request.method == "POST" and (length is None or not length.isdigit() or int(length) > MAX_BODY_BYTES):
            return JSONResponse({"detail": f"a body with a content-length up to {MAX_BODY_BYTES} bytes"},
                                status_code=413 if length and length.isdigit() else 411)
        return await call_next(request)

    async def embed(text: str) -> Any:
        try:
            return await embedder.embed(text)
        except EmbedderError as exc:
            counts["embedder_errors"] += 1
            raise HTTPException(503, str(exc)) from exc

    @app.post("/v1/semantic/lookup")
    async def lookup(req: LookupRequest) -> dict[str, Any]:
        counts["lookups"] += 1
        # A scope with no entries (most misses) needs no embedding.
        match = index.lookup(req.scope, await embed(req.text)) if index.has(req.scope) else None
        would_hit = match is not None and match.similarity >= req.threshold
        hit = would_hit and not req.shadow
        counts["would_hit"] += would_hit
        counts["hits"] += hit
        return {
            "hit": hit, "would_hit": would_hit, "shadow": req.shadow,
            # The best similarity in the scope even below the threshold (what shadow mode records).
            "similarity": None if match is None else round(match.similarity, 6),
            "key": match.key if would_hit and match else None,
            "response_hash": match.response_hash if would_hit and match else None,
            "ttl_left_s": round(match.ttl_left_s, 3) if would_hit and match else None,
        }

    @app.post("/v1/semantic/store")
    async def store(req: StoreRequest) -> dict[str, Any]:
        vector = await embed(req.text)
        try:
            index.store(req.policy, req.scope, vector, req.key, req.ttl_s, req.response_hash)
        except ValueError as exc:
            raise HTTPException(409, str(exc)) from exc
        counts["stores"] += 1
        return {"stored": True, "entries": len(index)}

    @app.post("/v1/semantic/purge")
    async def purge(req: PurgeRequest) -> dict[str, int]:
        return {"purged": index.purge(policy=req.policy, scope=req.scope)}

    @app.post("/v1/semantic/shadow")
    async def shadow_report(req: ShadowReport) -> dict[str, Any]:
        if req.policy not in shadow and len(shadow) >= MAX_SHADOW_POLICIES:
            raise HTTPException(429, f"shadow counts kept for at most {MAX_SHADOW_POLICIES} policies")
        c = shadow.setdefault(req.policy, ShadowCounts())
        c.would_hit += 1
        if req.matched:
            c.matched += 1
        else:
            c.mismatched += 1
            c.min_mismatched_similarity = min(c.min_mismatched_similarity or 1.0, req.similarity)
        return {"policy": req.policy, **vars(c)}

    @app.get("/v1/semantic/stats")
    async def stats() -> dict[str, Any]:
        return {"entries": len(index), "scopes": index.scopes(), "max_entries": index.max_entries,
                "max_per_scope": index.max_per_scope, "evicted": index.evicted, "expired": index.expired,
                **counts, "shadow": {p: vars(c) for p, c in sorted(shadow.items())}}

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    return app
