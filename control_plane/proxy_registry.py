"""The proxies connected over xDS: one `Connection` per stream, with what its client has
acknowledged (per type URL) and its last NACK. Written by the stream loop, read by the API
(`/v1/proxies`, `/v1/stats`)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .renderers import ECDS_TYPE_URL


@dataclass
class Nack:
    version: str
    error: str
    at: float


@dataclass
class Connection:
    """One xDS stream and what its Envoy has acknowledged."""

    stream_id: int
    transport: str
    peer: str
    connected_since: float = field(default_factory=time.time)
    node_id: str = ""
    cluster: str = ""
    acked: dict[str, tuple[str, float | None]] = field(default_factory=dict)  # type_url -> (version, at)
    # type_url -> the resource names it asked for: which filter it runs (ECDS `meshcache`,
    # `meshcache-native` for the native host, `meshcache-client`).
    resources: dict[str, tuple[str, ...]] = field(default_factory=dict)
    last_nack: Nack | None = None
    on_change: Callable[[], None] | None = field(default=None, repr=False, compare=False)

    def touch(self) -> None:
        """Something shown in /v1/proxies changed (an ACK, a NACK, the node id)."""
        if self.on_change is not None:
            self.on_change()

    def acked_version(self, type_url: str = ECDS_TYPE_URL) -> tuple[str, float | None]:
        if type_url in self.acked:
            return self.acked[type_url]
        return next(iter(self.acked.values()), ("", None))


class ProxyRegistry:
    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self.connections: dict[int, Connection] = {}
        self.generation = 0  # moves on every change: the fleet view republishes only then

    def _changed(self) -> None:
        self.generation += 1

    def open(self, transport: str, peer: str) -> Connection:
        conn = Connection(stream_id=next(self._ids), transport=transport, peer=peer, on_change=self._changed)
        self.connections[conn.stream_id] = conn
        self._changed()
        return conn

    def close(self, conn: Connection) -> None:
        self.connections.pop(conn.stream_id, None)
        self._changed()

    def __len__(self) -> int:
        return len(self.connections)
