"""One xDS stream, state of the world: what each type URL on it asked for, was sent and
acknowledged, and the loop that answers it.

Flow control follows go-control-plane: a request opens a watch for its type; a response is sent
only while a watch is open and the snapshot differs from what this stream was last sent, then
the watch closes until the next request (the ACK or NACK). A NACK therefore never triggers a
resend of the same rejected version: Envoy keeps its last good config until a newer snapshot.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from envoy.service.discovery.v3 import discovery_pb2

from .metrics import Metrics
from .proxy_registry import Connection, Nack
from .renderers import ECDS_TYPE_URL, Renderer
from .snapshots import Snapshot, SnapshotCache

log = logging.getLogger("meshcache.control_plane.xds")

INBOX_SIZE = 64  # per-stream bound on unprocessed requests (backpressure on the reader)
MAX_TYPES_PER_STREAM = 256  # fallback renderers are per type URL the client names: bound them
_CLOSED = object()


@dataclass
class _TypeState:
    renderer: Renderer
    pushes: Any  # this type's labelled push counter (labels() per push was ~5% of a 2,000-stream push)
    names: tuple[str, ...] = ()
    watch_open: bool = False
    force: bool = False  # respond even if the version did not change (first request, new names)
    sent_version: str | None = None
    sent_nonce: str | None = None
    sent_at: float = 0.0


class XdsStream:
    """The protocol state of one stream; `conn` (in the proxy registry) shows what it acknowledged."""

    def __init__(self, conn: Connection, renderer_for: Callable[[str], Renderer | None], metrics: Metrics) -> None:
        self.conn = conn
        self.renderer_for = renderer_for
        self.metrics = metrics
        self.states: dict[str, _TypeState] = {}
        self._nonces = itertools.count(1)

    async def serve(self, requests: AsyncIterator[discovery_pb2.DiscoveryRequest],
                    cache: SnapshotCache) -> AsyncIterator[discovery_pb2.DiscoveryResponse]:
        """Reads requests and snapshot changes until the client ends the stream; yields responses."""
        wake = asyncio.Event()
        inbox: asyncio.Queue[Any] = asyncio.Queue(maxsize=INBOX_SIZE)

        async def read() -> None:
            try:
                async for req in requests:
                    await inbox.put(req)
                    wake.set()
            finally:
                # Stream ended or broke: let the loop finish (put_nowait: never blocks here).
                with contextlib.suppress(asyncio.QueueFull):
                    inbox.put_nowait(_CLOSED)
                wake.set()

        watch_id = cache.watch(lambda _snap: wake.set())
        reader = asyncio.create_task(read())
        try:
            closed = False
            while not closed:
                await wake.wait()
                wake.clear()
                while not inbox.empty():
                    item = inbox.get_nowait()
                    if item is _CLOSED:
                        closed = True
                        break
                    self.on_request(item)
                if closed or reader.done() and inbox.empty():
                    break
                # No snapshot yet (store unreachable, no state file): answering a policy-carrying
                # type, even "empty", would replace what the client holds; its watches stay open.
                for resp in self.responses(cache.current, known=cache.known):
                    yield resp
        finally:
            cache.unwatch(watch_id)
            reader.cancel()

    def on_request(self, req: discovery_pb2.DiscoveryRequest) -> None:
        conn = self.conn
        if req.HasField("node") and req.node.id:
            conn.node_id, conn.cluster = req.node.id, req.node.cluster
            conn.touch()
        type_url = req.type_url or ECDS_TYPE_URL
        st = self.states.get(type_url)
        if st is None:
            renderer = self.renderer_for(type_url)
            if renderer is None or len(self.states) >= MAX_TYPES_PER_STREAM:
                log.debug("stream %d: ignoring unserved type %s", conn.stream_id, type_url)
                return
            st = self.states[type_url] = _TypeState(renderer, self.metrics.pushes.labels(type_url))
        names = tuple(sorted(req.resource_names))
        # A nonce only means ACK/NACK once this stream was sent something of the type: istiod's
        # first requests carry a timestamp nonce, and a client may reconnect with an old one.
        if req.response_nonce and st.sent_nonce is not None:
            if req.response_nonce != st.sent_nonce:
                return  # stale: answers a response superseded since
            if req.HasField("error_detail") and (req.error_detail.code or req.error_detail.message):
                conn.last_nack = Nack(version=st.sent_version or "", error=req.error_detail.message,
                                      at=time.time())
                self.metrics.nacks.inc()
                conn.touch()
                log.warning("NACK from %s for version %s: %s", conn.node_id, st.sent_version,
                            req.error_detail.message)
            else:
                conn.acked[type_url] = (req.version_info, time.time())
                conn.touch()
                self.metrics.acks.inc()
                self.metrics.ack_latency.observe(time.monotonic() - st.sent_at)
        else:
            # First request of this type on the stream: Envoy reports the version it already has
            # (after a reconnect) and always gets an answer.
            st.force = True
            if req.version_info:
                conn.acked[type_url] = (req.version_info, None)
                conn.touch()
        if names != st.names:
            st.names, st.force = names, True
            conn.resources[type_url] = names
            conn.touch()
        st.watch_open = True

    def responses(self, snap: Snapshot, known: bool = True) -> list[discovery_pb2.DiscoveryResponse]:
        """What to send now for `snap`: one response per type whose watch is open and whose
        version this stream has not been sent (or that must answer anyway). While no snapshot is
        `known`, only the types whose answer never depends on one."""
        out = []
        for type_url, st in self.states.items():
            if (known or not st.renderer.needs_snapshot) and st.renderer.serves(snap):
                resp = self._respond(snap, type_url, st)
                if resp is not None:
                    out.append(resp)
        return out

    def _respond(self, snap: Snapshot, type_url: str, st: _TypeState) -> discovery_pb2.DiscoveryResponse | None:
        version = st.renderer.version_of(snap)
        if not st.watch_open or (version == st.sent_version and not st.force):
            return None
        available = st.renderer.resources(snap)
        chosen = [available[n] for n in st.names if n in available] if st.names else list(available.values())
        if not chosen and not st.renderer.always_respond:
            return None  # nothing this stream asked for exists (yet): keep the watch open
        st.watch_open = st.force = False
        st.sent_version, st.sent_nonce, st.sent_at = version, str(next(self._nonces)), time.monotonic()
        st.pushes.inc()
        return discovery_pb2.DiscoveryResponse(
            version_info=version, resources=chosen, type_url=type_url, nonce=st.sent_nonce)
