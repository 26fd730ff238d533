"""Keeps this replica's in-memory snapshot equal to Redis's newest one.

Pub/sub carries each new snapshot record (sub-second propagation between replicas); because
pub/sub drops messages while disconnected, a cheap periodic version check (and a full resync on
every reconnect) closes the gaps. Redis outages are retried with capped exponential backoff.
"""

from __future__ import annotations

import asyncio
import logging
import time

from redis.exceptions import RedisError

from .metrics import Metrics
from .settings import Settings
from .snapshots import Snapshot, SnapshotCache
from .store import Store, StoreUnavailable

log = logging.getLogger("meshcache.control_plane.sync")
BACKOFF_MIN_S = 0.05
BACKOFF_MAX_S = 2.0


class RedisSync:
    def __init__(self, store: Store, cache: SnapshotCache, metrics: Metrics, settings: Settings) -> None:
        self.store = store
        self.cache = cache
        self.metrics = metrics
        self.interval = settings.resync_interval_s
        self.connected = asyncio.Event()

    @property
    def store_ok(self) -> bool:
        """Whether the last contact with Redis worked (false: degraded, serving from memory/disk)."""
        return self.connected.is_set()

    def _install(self, snap: Snapshot) -> None:
        if self.cache.set(snap):
            self.metrics.snapshot_version.set(snap.version)
            log.info("snapshot %d installed (%s by %s)", snap.version, snap.action, snap.author)

    async def resync(self) -> None:
        version = await self.store.current_version()
        mine = self.cache.current.version
        if version > mine or not self.cache.known:
            # Not known yet and Redis is reachable: its state, even version 0, is the real one.
            snap = await self.store.load_current()
            self._install(snap)
        elif version < mine:
            # Redis lost acknowledged data (e.g. restarted without its AOF), or this replica
            # started from its state file ahead of it: put our newer snapshot back so versions
            # never go backwards for Envoys or other replicas.
            log.warning("Redis is at version %d, this replica at %d: restoring", version, mine)
            await self.store.restore(self.cache.current)
        self.cache.origin = "redis"  # the store has what we serve
        if not self.connected.is_set():
            log.info("Redis reachable: snapshot %d is the store's", self.cache.current.version)
        self.connected.set()
        self.metrics.redis_up.set(1)

    def mark_unreachable(self) -> None:
        self.connected.clear()
        self.metrics.redis_up.set(0)

    async def run(self) -> None:
        backoff = BACKOFF_MIN_S
        while True:
            pubsub = self.store.pubsub()
            try:
                await pubsub.subscribe(self.store.channel)
                await self.resync()
                backoff = BACKOFF_MIN_S
                last_check = time.monotonic()
                while True:
                    msg = await pubsub.get_message(timeout=self.interval)
                    if msg is not None and msg.get("type") == "message":
                        self._install(Snapshot.from_record(msg["data"]))
                    if time.monotonic() - last_check >= self.interval:
                        await self.resync()
                        last_check = time.monotonic()
            except asyncio.CancelledError:
                raise
            except (RedisError, OSError, StoreUnavailable, TimeoutError) as exc:
                if self.connected.is_set():
                    log.warning("Redis unavailable (%s); serving snapshot %d from memory",
                                exc, self.cache.current.version)
                self.mark_unreachable()
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, BACKOFF_MAX_S)
            finally:
                try:
                    await pubsub.aclose()
                except (RedisError, OSError):
                    pass
