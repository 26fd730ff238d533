"""Redis store: versioned snapshots, created atomically by one Lua script.

Keys (under settings.key_prefix):
  current            the current snapshot version (also the version counter)
  snapshot:<v>       the snapshot record (JSON); the newest `snapshot_retention` are kept
  audit              stream of who changed what (XADD MAXLEN ~ audit_maxlen)
  changes            pub/sub channel; the message is the new snapshot record
  replicas           sorted set: replica id -> when it last published its proxies
  proxies:<replica>  the proxies connected to that replica (JSON list, expires: fleet.py)

The script compares `current` with the version the change was derived from and only then
writes the snapshot, moves `current`, appends the audit entry and publishes, so no reader sees
half a change and concurrent writers (several replicas) can never both win.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from .schemas import AuditEntry
from .settings import Settings
from .snapshots import EMPTY, Snapshot

_COMMIT = """
local cur = tonumber(redis.call('GET', KEYS[1]) or '0')
if cur ~= tonumber(ARGV[1]) then return {0, cur} end
local v = cur + 1
redis.call('SET', ARGV[2] .. v, ARGV[3])
redis.call('SET', KEYS[1], v)
local old = v - tonumber(ARGV[4])
if old > 0 then redis.call('DEL', ARGV[2] .. old) end
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[5], '*',
  'version', v, 'actor', ARGV[6], 'action', ARGV[7], 'detail', ARGV[8], 'at', ARGV[9])
redis.call('PUBLISH', KEYS[3], ARGV[3])
return {1, v}
"""

# Put back a snapshot newer than Redis's current one (Redis lost data); never moves backwards.
_RESTORE = """
local cur = tonumber(redis.call('GET', KEYS[1]) or '0')
local v = tonumber(ARGV[1])
if cur >= v then return cur end
redis.call('SET', ARGV[2] .. v, ARGV[3])
redis.call('SET', KEYS[1], v)
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[4], '*',
  'version', v, 'actor', 'control-plane', 'action', 'restore', 'detail', 'Redis was behind', 'at', ARGV[5])
return v
"""


class StoreUnavailable(Exception):
    """Redis could not be reached (or timed out); nothing was changed by this call."""


class VersionConflict(Exception):
    def __init__(self, current: int) -> None:
        super().__init__(f"snapshot moved on to version {current}")
        self.current = current


@asynccontextmanager
async def _unavailable_on_error(what: str) -> AsyncIterator[None]:
    try:
        yield
    except (RedisError, OSError) as exc:
        raise StoreUnavailable(f"{what}: {type(exc).__name__}: {exc}") from exc


class Store:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        p = settings.key_prefix
        self.current_key = f"{p}:current"
        self.snapshot_prefix = f"{p}:snapshot:"
        self.audit_key = f"{p}:audit"
        self.channel = f"{p}:changes"
        self.replicas_key = f"{p}:replicas"
        self.proxies_prefix = f"{p}:proxies:"
        # One immediate retry, on a broken connection only: a pooled connection that Redis reset
        # when it restarted looks idle and healthy until used, and would fail the first requests
        # after Redis is back. Timeouts are not retried: a write either answers fast or fails
        # with 503, and the caller (or the sync loop's backoff) decides when to try again. A
        # commit retried after its reply was lost meets its own write as a version conflict, and
        # the write path re-reads and finds the change applied.
        self.redis: aioredis.Redis = aioredis.Redis.from_url(
            settings.redis_url,
            socket_timeout=settings.redis_timeout_s,
            socket_connect_timeout=settings.redis_timeout_s,
            retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
            max_connections=64,
        )
        self._commit = self.redis.register_script(_COMMIT)
        self._restore = self.redis.register_script(_RESTORE)

    async def close(self) -> None:
        await self.redis.aclose()

    async def ping(self) -> bool:
        try:
            return bool(await self.redis.ping())
        except (RedisError, OSError):
            return False

    async def current_version(self) -> int:
        async with _unavailable_on_error("reading the current version"):
            raw = await self.redis.get(self.current_key)
        return int(raw) if raw is not None else 0

    async def load(self, version: int) -> Snapshot | None:
        if version == 0:
            return EMPTY
        async with _unavailable_on_error(f"reading snapshot {version}"):
            raw = await self.redis.get(f"{self.snapshot_prefix}{version}")
        return Snapshot.from_record(raw) if raw is not None else None

    async def load_many(self, versions: list[int]) -> list[Snapshot | None]:
        """Several snapshots in one MGET (one round trip, one pooled connection: a gather of
        single loads needs a connection each and fails past the pool's max_connections)."""
        if not versions:
            return []
        async with _unavailable_on_error(f"reading {len(versions)} snapshots"):
            raws = await self.redis.mget([f"{self.snapshot_prefix}{v}" for v in versions])
        return [Snapshot.from_record(raw) if raw is not None else None for raw in raws]

    async def load_current(self) -> Snapshot:
        # `current` moves after its snapshot is written (same script), so a short retry covers a
        # pruned-in-between race; versions only grow, so this terminates.
        for _ in range(5):
            version = await self.current_version()
            snap = await self.load(version)
            if snap is not None:
                return snap
        raise StoreUnavailable("current snapshot record missing")

    async def commit(self, snapshot: Snapshot, expected: int, actor: str, detail: str) -> int:
        """Atomically make `snapshot` (derived from version `expected`) the current one."""
        if snapshot.version != expected + 1:
            raise ValueError("snapshot.version must be expected + 1")
        s = self.settings
        args: list[Any] = [
            expected, self.snapshot_prefix, snapshot.to_record(), s.snapshot_retention,
            s.audit_maxlen, actor, snapshot.action, detail, f"{time.time():.6f}",
        ]
        async with _unavailable_on_error("committing the snapshot"):
            ok, version = await self._commit(keys=[self.current_key, self.audit_key, self.channel], args=args)
        if not ok:
            raise VersionConflict(int(version))
        return int(version)

    async def restore(self, snapshot: Snapshot) -> int:
        args: list[Any] = [snapshot.version, self.snapshot_prefix, snapshot.to_record(),
                           self.settings.audit_maxlen, f"{time.time():.6f}"]
        async with _unavailable_on_error("restoring the snapshot"):
            return int(await self._restore(keys=[self.current_key, self.audit_key], args=args))

    async def audit(self, count: int = 100) -> list[AuditEntry]:
        async with _unavailable_on_error("reading the audit stream"):
            rows = await self.redis.xrevrange(self.audit_key, count=count)
        out = []
        for entry_id, fields in rows:
            f = {k.decode(): v.decode(errors="replace") for k, v in fields.items()}
            out.append(AuditEntry(
                id=entry_id.decode(), version=int(f.get("version", 0)), actor=f.get("actor", ""),
                action=f.get("action", ""), detail=f.get("detail", ""), at=float(f.get("at", 0.0)),
            ))
        return out

    def pubsub(self) -> aioredis.client.PubSub:
        return self.redis.pubsub(ignore_subscribe_messages=True)

    # ---- the fleet's proxies (fleet.py) -------------------------------------------------------

    async def put_proxies(self, replica: str, proxies_json: str, ttl_s: float, forget_s: float) -> None:
        """This replica's proxies, expiring after `ttl_s` unless published again; replicas silent
        for `forget_s` leave the set."""
        now = time.time()
        async with _unavailable_on_error("publishing this replica's proxies"):
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.set(f"{self.proxies_prefix}{replica}", proxies_json, px=int(ttl_s * 1000))
                pipe.zadd(self.replicas_key, {replica: now})
                pipe.zremrangebyscore(self.replicas_key, "-inf", now - forget_s)
                await pipe.execute()

    async def drop_proxies(self, replica: str) -> None:
        async with _unavailable_on_error("removing this replica's proxies"):
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.delete(f"{self.proxies_prefix}{replica}")
                pipe.zrem(self.replicas_key, replica)
                await pipe.execute()

    async def other_proxies(self, replica: str, max_replicas: int) -> dict[str, bytes]:
        """The published proxy lists of the (at most `max_replicas` most recent) other replicas."""
        async with _unavailable_on_error("reading the other replicas' proxies"):
            ids = [r.decode() for r in await self.redis.zrevrange(self.replicas_key, 0, max_replicas - 1)]
            others = [r for r in ids if r != replica]
            if not others:
                return {}
            raws = await self.redis.mget([f"{self.proxies_prefix}{r}" for r in others])
        return {r: raw for r, raw in zip(others, raws, strict=True) if raw is not None}
