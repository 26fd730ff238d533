"""Every proxy of the fleet, whichever replica holds its stream.

Each replica publishes the proxies connected to it (proxy_registry.py) to Redis: one JSON list
per replica under `proxies:<replica id>` with an expiry, rewritten when its registry changed and
at least every third of the expiry otherwise; a killed replica's list disappears when it expires,
a stopped one's at once. `/v1/proxies` and the status page show this replica's live proxies plus
the other replicas' lists (each as fresh as their last publish: at most `interval` old). When an
Envoy moves (its replica died) it may be listed twice until the dead replica's list expires: the
newest connection of a node id wins. Bounded: a replica publishes at most its stream limit of
proxies and at most MAX_REPLICAS lists are read. Redis down: this replica's proxies only.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from typing import Any

from .mcp import GVK_RE
from .proxy_registry import Connection, ProxyRegistry
from .store import Store, StoreUnavailable

log = logging.getLogger("meshcache.control_plane.fleet")
MAX_REPLICAS = 64
FORGET_S = 3600.0  # a replica silent this long leaves the replica set


def replica_id(instance_id: str) -> str:
    """Unique per process: replicas on one host (or one pod name reused) never share a list."""
    return f"{instance_id}:{os.getpid()}"


def is_config_client(c: Connection) -> bool:
    """istiod (an MCP client): it asks for Istio config kinds only, never Envoy's xDS types."""
    types = set(c.acked) | set(c.resources)
    return bool(types) and all(GVK_RE.match(t) for t in types)


def config_client_entries(entries: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(Envoy proxies, config clients: istiod), by the `role` every replica publishes."""
    return [e for e in entries if e["role"] == "proxy"], [e for e in entries if e["role"] == "config-client"]


def proxy_entry(c: Connection, replica: str) -> dict[str, Any]:
    """One proxy as /v1/proxies shows it (without `current`, computed at read time). For istiod
    the version is the policy snapshot it ACKed (its other kinds are answered once, "empty")."""
    client = is_config_client(c)
    acked, acked_at = c.acked_version()
    if client:
        acked, acked_at = max(((v, at) for v, at in c.acked.values() if v.isdigit()),
                              key=lambda va: int(va[0]), default=("", None))
    nack = c.last_nack
    return {"node_id": c.node_id, "cluster": c.cluster, "stream_id": c.stream_id, "transport": c.transport,
            "role": "config-client" if client else "proxy",
            "type_urls": sorted(c.acked), "resources": sorted({n for names in c.resources.values() for n in names}),
            "connected_since": c.connected_since, "acked_version": acked,
            "acked_at": acked_at, "replica": replica,
            "last_nack": {"version": nack.version, "error": nack.error, "at": nack.at} if nack else None}


class FleetView:
    def __init__(self, store: Store, registry: ProxyRegistry, replica: str, interval_s: float) -> None:
        self.store = store
        self.registry = registry
        self.replica = replica
        self.interval_s = interval_s
        self.ttl_s = max(3.0, 3 * interval_s)
        self._published: tuple[int, float] | None = None  # (registry generation, when)

    def local(self) -> list[dict[str, Any]]:
        return [proxy_entry(c, self.replica) for c in list(self.registry.connections.values())]

    async def publish_once(self) -> None:
        gen, now = self.registry.generation, time.monotonic()
        if self._published is not None and self._published[0] == gen and now - self._published[1] < self.ttl_s / 3:
            return
        await self.store.put_proxies(self.replica, json.dumps(self.local()), self.ttl_s, FORGET_S)
        self._published = (gen, now)

    async def run(self) -> None:
        while True:
            try:
                await self.publish_once()
            except StoreUnavailable as exc:
                log.debug("proxies not published: %s", exc)
                self._published = None
            await asyncio.sleep(self.interval_s)

    async def withdraw(self) -> None:
        """On a clean stop: this replica's proxies are gone now (they reconnect elsewhere)."""
        try:
            await self.store.drop_proxies(self.replica)
        except StoreUnavailable as exc:
            log.debug("proxies not withdrawn (they expire): %s", exc)

    async def all(self) -> tuple[list[dict[str, Any]], bool]:
        """(every proxy of the fleet, whether the other replicas could be read): this replica's
        live ones, then the others'; one entry per node id (the newest connection)."""
        entries = self.local()
        complete = True
        try:
            others = await self.store.other_proxies(self.replica, MAX_REPLICAS)
        except StoreUnavailable as exc:
            log.debug("other replicas' proxies unavailable: %s", exc)
            others, complete = {}, False
        for replica, raw in others.items():
            listed = _proxy_list(raw)
            if listed is None:  # unreadable (another release's format?): left out, and said so
                log.warning("replica %s: unreadable proxy list in Redis, left out", replica)
                complete = False
            else:
                entries.extend(listed)
        newest: dict[str, dict[str, Any]] = {}
        anonymous = []
        for e in entries:
            if not e["node_id"]:
                anonymous.append(e)
            elif e["node_id"] not in newest or e["connected_since"] > newest[e["node_id"]]["connected_since"]:
                newest[e["node_id"]] = e
        return [*newest.values(), *anonymous], complete


def _proxy_list(raw: str | bytes) -> list[dict[str, Any]] | None:
    """Another replica's published proxies, or None when they are not what `local()` writes."""
    try:
        listed = json.loads(raw)
    except ValueError:
        return None
    ok = isinstance(listed, list) and all(
        isinstance(e, dict) and isinstance(e.get("node_id"), str) and isinstance(e.get("connected_since"), (int, float))
        for e in listed)
    return listed if ok else None
