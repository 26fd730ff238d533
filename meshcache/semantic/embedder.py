"""Embeddings from an OpenAI-compatible `/v1/embeddings` (the engine's all-minilm-l6-v2)."""

from __future__ import annotations

import httpx
import numpy as np


class EmbedderError(Exception):
    """The embedder did not answer with one vector of the expected size."""


class Embedder:
    def __init__(self, base_url: str, model: str, dims: int, timeout_s: float = 2.0) -> None:
        self.model, self.dims = model, dims
        # Bounded: one pool, a short timeout (the caller is a request waiting on an exact miss).
        self.http = httpx.AsyncClient(base_url=base_url, timeout=timeout_s,
                                      limits=httpx.Limits(max_connections=16, max_keepalive_connections=16))

    async def embed(self, text: str) -> np.ndarray:
        try:
            r = await self.http.post("/v1/embeddings", json={"model": self.model, "input": text})
        except httpx.HTTPError as exc:
            raise EmbedderError(f"embedder unreachable: {exc!r}") from exc
        if r.status_code != 200:
            raise EmbedderError(f"embedder answered {r.status_code}: {r.text[:200]}")
        try:
            vector = np.asarray(r.json()["data"][0]["embedding"], dtype=np.float32)
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise EmbedderError(f"embedder answer unreadable: {exc!r}") from exc
        if vector.shape != (self.dims,):
            raise EmbedderError(f"embedder gave {vector.shape} numbers, expected {self.dims}")
        return vector

    async def close(self) -> None:
        await self.http.aclose()
