"""Writes: derive a new snapshot from the current one and commit it with compare-and-set."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from . import history
from .metrics import Metrics
from .snapshots import ChangeError, Snapshot, SnapshotCache
from .store import Store, StoreUnavailable, VersionConflict

Change = Callable[[Snapshot, int], Snapshot]
MAX_ATTEMPTS = 8  # bounded retries when other replicas keep winning the race


class PreconditionFailed(Exception):
    def __init__(self, current: int) -> None:
        super().__init__(f"If-Match does not match the current snapshot version {current}")
        self.current = current


class PolicyService:
    def __init__(self, store: Store, cache: SnapshotCache, metrics: Metrics) -> None:
        self.store = store
        self.cache = cache
        self.metrics = metrics
        # One write at a time per replica: no self-inflicted CAS conflicts.
        self._lock = asyncio.Lock()

    async def apply(self, change: Change, actor: str, detail: str, if_match: int | None = None
                    ) -> tuple[Snapshot, bool]:
        """Apply `change`; returns (current snapshot, changed). Raises PreconditionFailed,
        StoreUnavailable, or the change's ChangeError; nothing is written in those cases."""
        async with self._lock:
            try:
                result = await self._apply(change, actor, detail, if_match)
            except StoreUnavailable:
                self.metrics.writes.labels("unavailable").inc()
                self.metrics.redis_up.set(0)
                raise
            self.metrics.redis_up.set(1)
            self.metrics.writes.labels("changed" if result[1] else "unchanged").inc()
            return result

    async def write(self, change: Change, actor: str, detail: str, if_match: int | None = None
                    ) -> tuple[Snapshot, bool, list[dict[str, Any]]]:
        """`apply`, plus the field diff the write made (`history.diff` of the snapshot it was
        applied to and the new one; empty when nothing changed)."""
        applied_to: list[Snapshot] = []

        def tracked(cur: Snapshot, version: int) -> Snapshot:
            applied_to.append(cur)
            return change(cur, version)

        snap, changed = await self.apply(tracked, actor, detail, if_match)
        return snap, changed, history.diff(applied_to[-1], snap) if changed else []

    def preview(self, change: Change) -> tuple[Snapshot, Snapshot, bool, list[dict[str, Any]]]:
        """What `write` would do now, without writing: (current snapshot, the one it would make,
        whether it would change, the field diff). From the in-memory snapshot (kept current by
        the Redis sync): apply with If-Match on the current version to make exactly this change."""
        cur = self.cache.current
        new = change(cur, cur.version + 1)
        if new.same_content(cur):
            return cur, cur, False, []
        return cur, new, True, history.diff(cur, new)

    async def _apply(self, change: Change, actor: str, detail: str, if_match: int | None
                     ) -> tuple[Snapshot, bool]:
        # Start from memory (usually current). Anything that might be an artefact of a stale
        # cache (CAS conflict, If-Match mismatch, change error) is re-checked against Redis.
        cur = self.cache.current
        fresh = False
        for attempt in range(MAX_ATTEMPTS):
            if if_match is not None and cur.version != if_match:
                if fresh:
                    raise PreconditionFailed(cur.version)
            else:
                try:
                    new = change(cur, cur.version + 1)
                except ChangeError:
                    if fresh:
                        raise
                else:
                    if new.same_content(cur):
                        # No-op writes create no snapshot, but Redis must confirm "current".
                        if fresh or await self.store.current_version() == cur.version:
                            return cur, False
                    else:
                        try:
                            await self.store.commit(new, cur.version, actor, detail)
                        except VersionConflict:
                            pass
                        else:
                            self.cache.set(new)
                            self.metrics.snapshot_version.set(self.cache.current.version)
                            return new, True
            if attempt:
                await asyncio.sleep(min(0.005 * 2**attempt, 0.1))
            cur = await self.store.load_current()
            fresh = True
            self.cache.set(cur)
        raise StoreUnavailable(f"gave up after {MAX_ATTEMPTS} conflicting attempts; retry")
