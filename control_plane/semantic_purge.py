"""Purging a policy also drops its entries from the semantic index service (docs/llm.md).

The index holds only exact cache keys, and its scopes include the policy's generation, so after a
purge its old entries can no longer match (the new generation is a new scope): this call only
frees their memory early. It must therefore never hold up or fail the purge: it runs after the
write, in the background, bounded in time and in number; a failure is logged and counted
(`meshcache_cp_semantic_purges{outcome}`), and the entries then leave with their TTL.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import httpx

from .metrics import Metrics

log = logging.getLogger("meshcache.control_plane.semantic")

MAX_PENDING = 64  # purges in flight; more are dropped (counted), the TTL still bounds the entries
PURGE_PATH = "/v1/semantic/purge"


class SemanticPurger:
    def __init__(self, base_url: str, timeout_s: float, metrics: Metrics) -> None:
        self.url = f"{base_url}{PURGE_PATH}" if base_url else ""
        self._metrics = metrics
        self._client = (httpx.AsyncClient(timeout=timeout_s, limits=httpx.Limits(max_connections=4))
                        if base_url else None)
        self._pending: set[asyncio.Task[None]] = set()

    def policy(self, model_prefix: str) -> None:
        self._start({"policy": model_prefix})

    def every_policy(self) -> None:
        self._start({"all": True})

    def _start(self, body: dict[str, Any]) -> None:
        if self._client is None:
            return
        if len(self._pending) >= MAX_PENDING:
            self._metrics.semantic_purges.labels("dropped").inc()
            log.warning("semantic index purge %s dropped: %d purges already in flight", body, MAX_PENDING)
            return
        task = asyncio.create_task(self._send(self._client, body), name="semantic-purge")
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _send(self, client: httpx.AsyncClient, body: dict[str, Any]) -> None:
        try:
            response = await client.post(self.url, json=body)
            response.raise_for_status()
        except httpx.HTTPError as exc:
            self._metrics.semantic_purges.labels("error").inc()
            log.warning("semantic index purge %s at %s failed (%s: %s); its entries expire with their TTL",
                        body, self.url, type(exc).__name__, exc)
            return
        self._metrics.semantic_purges.labels("ok").inc()
        log.info("semantic index purge %s: %s", body, response.text[:200])

    async def close(self) -> None:
        for task in list(self._pending):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._client is not None:
            await self._client.aclose()
