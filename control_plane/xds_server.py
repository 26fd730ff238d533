"""xDS server: ECDS and ADS (state of the world) on grpcio aio, with ACK/NACK per stream.

Resources are produced per type URL by pluggable renderers, so another protocol served over the
same ADS stream (e.g. MCP-over-xDS serving `extensions.istio.io/v1alpha1/WasmPlugin` to istiod)
is one more `Renderer` registered with `XdsServer.add_renderer`.

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import grpc
from envoy.config.core.v3 import extension_pb2
from envoy.extensions.filters.http.wasm.v3 import wasm_pb2  # noqa: F401 - registers the Wasm type for Any
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from envoy.service.extension.v3 import config_discovery_pb2_grpc
from google.protobuf import any_pb2, json_format

from meshcache.contract.filter_config import client_plugin_config, plugin_config_json
from meshcache.contract.wasm_filter import CLIENT_FILTER_NAME, FILTER_NAME, extension_config_json, local_code

from .metrics import Metrics
from .snapshots import Snapshot, SnapshotCache, SnapshotMemo

log = logging.getLogger("meshcache.control_plane.xds")

ECDS_TYPE_URL = "type.googleapis.com/envoy.config.core.v3.TypedExtensionConfig"
INBOX_SIZE = 64  # per-stream bound on unprocessed requests (backpressure on the reader)
MAX_TYPES_PER_STREAM = 256  # fallback renderers are per type URL the client names: bound them


class Renderer(Protocol):
    """Turns a snapshot into the named resources of one type URL.

    An optional `always_respond = True` makes the server answer even with no resources and before
    the first snapshot (version 0): MCP sinks (istiod) wait for an answer to every type they
    subscribe to. Envoy-facing renderers leave it unset, so Envoy keeps its default_config.
    An optional `version_of(snapshot) -> str` replaces the snapshot version as `version_info`
    (a renderer whose output never changes keeps one version: no re-send on every snapshot)."""

    type_url: str

    def resources(self, snapshot: Snapshot) -> dict[str, any_pb2.Any]: ...


class EcdsRenderer:
    """The meshcache HTTP filter as an ECDS `TypedExtensionConfig` (the Wasm filter config whose
    plugin configuration is the snapshot's canonical JSON, as is; VM config identical to the
    static default). A second resource, `meshcache-client`, carries the same policies in the
    client role, for client sidecars that route by cache affinity; each Envoy asks for its name."""

    type_url = ECDS_TYPE_URL

    def __init__(self, wasm_path: Path, resource_name: str = FILTER_NAME) -> None:
        self.wasm_path = wasm_path
        self.resource_name = resource_name
        self._packed = SnapshotMemo(self._render)  # once per snapshot, shared by every stream

    def typed_extension_config(self, snapshot: Snapshot, client: bool = False) -> extension_pb2.TypedExtensionConfig:
        # The same builder as the full-mode EnvoyFilter's EXTENSION_CONFIG (meshcache.contract.extensions), so a
        # local sidecar runs what istiod would deliver, with the module as a local file.
        if client:
            text, name = plugin_config_json(client_plugin_config(snapshot.plugin_config())), CLIENT_FILTER_NAME
        else:
            text, name = snapshot.plugin_config_json, self.resource_name
        config = extension_config_json(local_code(self.wasm_path), text, name)
        return json_format.ParseDict(config, extension_pb2.TypedExtensionConfig())

    def resources(self, snapshot: Snapshot) -> dict[str, any_pb2.Any]:
        return self._packed(snapshot)

    def _render(self, snapshot: Snapshot) -> dict[str, any_pb2.Any]:
        out = {}
        for client in (False, True):
            config = self.typed_extension_config(snapshot, client)
            packed = any_pb2.Any()
            packed.Pack(config)
            out[config.name] = packed
        return out


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
    last_nack: Nack | None = None

    def acked_version(self, type_url: str = ECDS_TYPE_URL) -> tuple[str, float | None]:
        if type_url in self.acked:
            return self.acked[type_url]
        return next(iter(self.acked.values()), ("", None))


class ProxyRegistry:
    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self.connections: dict[int, Connection] = {}

    def open(self, transport: str, peer: str) -> Connection:
        conn = Connection(stream_id=next(self._ids), transport=transport, peer=peer)
        self.connections[conn.stream_id] = conn
        return conn

    def close(self, conn: Connection) -> None:
        self.connections.pop(conn.stream_id, None)

    def __len__(self) -> int:
        return len(self.connections)


@dataclass
class _TypeState:
    renderer: Renderer
    names: tuple[str, ...] = ()
    watch_open: bool = False
    force: bool = False  # respond even if the version did not change (first request, new names)
    sent_version: str | None = None
    sent_nonce: str | None = None
    sent_at: float = 0.0


_CLOSED = object()


class XdsServer:
    def __init__(self, cache: SnapshotCache, metrics: Metrics, max_streams: int = 5000) -> None:
        self.cache = cache
        self.metrics = metrics
        self.max_streams = max_streams
        self.registry = ProxyRegistry()
        self.renderers: dict[str, Renderer] = {}
        self.fallbacks: list[Callable[[str], Renderer | None]] = []
        self._server: grpc.aio.Server | None = None
        self.port = 0

    def add_renderer(self, renderer: Renderer) -> None:
        self.renderers[renderer.type_url] = renderer

    def add_fallback(self, factory: Callable[[str], Renderer | None]) -> None:
        """For type URLs without a renderer: `factory(type_url)` may supply one (per stream)."""
        self.fallbacks.append(factory)

    def renderer_for(self, type_url: str) -> Renderer | None:
        if type_url in self.renderers:
            return self.renderers[type_url]
        for factory in self.fallbacks:
            found = factory(type_url)
            if found is not None:
                return found
        return None

    # ---- gRPC plumbing ----------------------------------------------------------------------

    async def start(self, host: str, port: int, credentials: grpc.ServerCredentials | None = None) -> int:
        server = grpc.aio.server(options=[
            ("grpc.keepalive_time_ms", 30_000),
            ("grpc.keepalive_timeout_ms", 10_000),
            ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.max_concurrent_streams", 10_000),
        ])
        config_discovery_pb2_grpc.add_ExtensionConfigDiscoveryServiceServicer_to_server(
            _EcdsServicer(self), server)
        ads_pb2_grpc.add_AggregatedDiscoveryServiceServicer_to_server(_AdsServicer(self), server)
        address = f"{host}:{port}"
        self.port = (server.add_secure_port(address, credentials) if credentials is not None
                     else server.add_insecure_port(address))
        if self.port == 0:
            raise OSError(f"cannot bind xDS port {host}:{port}")
        await server.start()
        self._server = server
        return self.port

    async def stop(self, grace: float = 1.0) -> None:
        if self._server is not None:
            await self._server.stop(grace)
            self._server = None

    # ---- the stream -------------------------------------------------------------------------

    async def stream(self, requests: AsyncIterator[discovery_pb2.DiscoveryRequest],
                     context: grpc.aio.ServicerContext, transport: str
                     ) -> AsyncIterator[discovery_pb2.DiscoveryResponse]:
        if len(self.registry) >= self.max_streams:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many xDS streams")
        conn = self.registry.open(transport, context.peer() or "")
        self.metrics.streams.labels(transport).inc()
        wake = asyncio.Event()
        inbox: asyncio.Queue[Any] = asyncio.Queue(maxsize=INBOX_SIZE)
        states: dict[str, _TypeState] = {}
        nonces = itertools.count(1)

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

        watch_id = self.cache.watch(lambda _snap: wake.set())
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
                    self._on_request(conn, states, item)
                if closed or reader.done() and inbox.empty():
                    break
                snap = self.cache.current
                for type_url, st in states.items():
                    if snap.version == 0 and not getattr(st.renderer, "always_respond", False):
                        continue  # never configured: Envoy keeps its default_config
                    resp = self._maybe_respond(snap, type_url, st, nonces)
                    if resp is not None:
                        yield resp
        finally:
            self.cache.unwatch(watch_id)
            reader.cancel()
            self.registry.close(conn)
            self.metrics.streams.labels(transport).dec()

    def _on_request(self, conn: Connection, states: dict[str, _TypeState],
                    req: discovery_pb2.DiscoveryRequest) -> None:
        if req.HasField("node") and req.node.id:
            conn.node_id, conn.cluster = req.node.id, req.node.cluster
        type_url = req.type_url or ECDS_TYPE_URL
        st = states.get(type_url)
        if st is None:
            renderer = self.renderer_for(type_url)
            if renderer is None or len(states) >= MAX_TYPES_PER_STREAM:
                log.debug("stream %d: ignoring unserved type %s", conn.stream_id, type_url)
                return
            st = states[type_url] = _TypeState(renderer)
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
                log.warning("NACK from %s for version %s: %s", conn.node_id, st.sent_version,
                            req.error_detail.message)
            else:
                conn.acked[type_url] = (req.version_info, time.time())
                self.metrics.acks.inc()
                self.metrics.ack_latency.observe(time.monotonic() - st.sent_at)
        else:
            # First request of this type on the stream: Envoy reports the version it already has
            # (after a reconnect) and always gets an answer.
            st.force = True
            if req.version_info:
                conn.acked[type_url] = (req.version_info, None)
        if names != st.names:
            st.names, st.force = names, True
        st.watch_open = True

    def _maybe_respond(self, snap: Snapshot, type_url: str, st: _TypeState,
                       nonces: itertools.count[int]) -> discovery_pb2.DiscoveryResponse | None:
        version_of = getattr(st.renderer, "version_of", None)
        version = version_of(snap) if version_of is not None else str(snap.version)
        if not st.watch_open or (version == st.sent_version and not st.force):
            return None
        available = st.renderer.resources(snap)
        chosen = [available[n] for n in st.names if n in available] if st.names else list(available.values())
        if not chosen and not getattr(st.renderer, "always_respond", False):
            return None  # nothing this stream asked for exists (yet): keep the watch open
        st.watch_open = st.force = False
        st.sent_version, st.sent_nonce, st.sent_at = version, str(next(nonces)), time.monotonic()
        self.metrics.pushes.labels(type_url).inc()
        return discovery_pb2.DiscoveryResponse(
            version_info=version, resources=chosen, type_url=type_url, nonce=st.sent_nonce)

    def fetch(self, req: discovery_pb2.DiscoveryRequest) -> discovery_pb2.DiscoveryResponse:
        type_url = req.type_url or ECDS_TYPE_URL
        snap = self.cache.current
        renderer = self.renderer_for(type_url)
        if renderer is None or (snap.version == 0 and not getattr(renderer, "always_respond", False)):
            return discovery_pb2.DiscoveryResponse(type_url=type_url)
        available = renderer.resources(snap)
        names = list(req.resource_names) or list(available)
        version_of = getattr(renderer, "version_of", None)
        return discovery_pb2.DiscoveryResponse(
            version_info=version_of(snap) if version_of is not None else str(snap.version), type_url=type_url,
            resources=[available[n] for n in names if n in available])


class _EcdsServicer(config_discovery_pb2_grpc.ExtensionConfigDiscoveryServiceServicer):
    def __init__(self, xds: XdsServer) -> None:
        self.xds = xds

    async def StreamExtensionConfigs(self, request_iterator: AsyncIterator[discovery_pb2.DiscoveryRequest],  # noqa: N802
                                     context: grpc.aio.ServicerContext
                                     ) -> AsyncIterator[discovery_pb2.DiscoveryResponse]:
        async for resp in self.xds.stream(request_iterator, context, "ecds"):
            yield resp

    async def FetchExtensionConfigs(self, request: discovery_pb2.DiscoveryRequest,  # noqa: N802
                                    context: grpc.aio.ServicerContext) -> discovery_pb2.DiscoveryResponse:
        return self.xds.fetch(request)


class _AdsServicer(ads_pb2_grpc.AggregatedDiscoveryServiceServicer):
    def __init__(self, xds: XdsServer) -> None:
        self.xds = xds

    async def StreamAggregatedResources(self, request_iterator: AsyncIterator[discovery_pb2.DiscoveryRequest],  # noqa: N802
                                        context: grpc.aio.ServicerContext
                                        ) -> AsyncIterator[discovery_pb2.DiscoveryResponse]:
        async for resp in self.xds.stream(request_iterator, context, "ads"):
            yield resp
