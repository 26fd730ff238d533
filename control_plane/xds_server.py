"""xDS server: ECDS and ADS (state of the world) on grpcio aio.

The server holds the renderers per type URL (renderers.py; another protocol served over the
same ADS stream, e.g. MCP-over-xDS for istiod, is one more `Renderer` registered with
`XdsServer.add_renderer`), the connected proxies (proxy_registry.py) and the gRPC servicers;
each stream's protocol (watches, ACK/NACK, flow control) is xds_stream.py.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import AsyncIterator, Callable

import grpc
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from envoy.service.extension.v3 import config_discovery_pb2_grpc

from .mcp import GVK_RE
from .metrics import Metrics
from .proxy_registry import Connection, ProxyRegistry
from .renderers import ECDS_TYPE_URL, Renderer
from .snapshots import SnapshotCache
from .xds_probe import is_probe_peer, probe_address
from .xds_stream import XdsStream

MAX_PROBE_STREAMS = 8  # the main's probe uses one per xDS process and kind at a time


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
        # The probe socket (xds_probe.py), unique per control plane (tests run several in one
        # process); its xDS workers get the token and listen on their own index.
        self.probe_token = f"{os.getpid()}-{secrets.token_hex(4)}"
        self.probe_address = probe_address(self.probe_token, 0)
        # Probe streams are no proxies: their pushes are counted here, not in /metrics.
        self._probe_metrics = Metrics()
        self._probe_streams = 0

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
            # Several xDS worker processes listen on one port (xds_workers.py).
            ("grpc.so_reuseport", 1),
            # New RPCs wait in grpc core until the Python loop accepts them; past the soft limit
            # (default 1000) core refuses some at random (RESOURCE_EXHAUSTED, "Too many pending
            # requests"): a fleet reconnecting at once (a replica lost, a restart) would see the
            # cliff measured in issue 25. The stream limit is the real bound.
            ("grpc.server.max_pending_requests", self.max_streams),
            ("grpc.server.max_pending_requests_hard_limit", self.max_streams + 1),
        ])
        config_discovery_pb2_grpc.add_ExtensionConfigDiscoveryServiceServicer_to_server(
            _EcdsServicer(self), server)
        ads_pb2_grpc.add_AggregatedDiscoveryServiceServicer_to_server(_AdsServicer(self), server)
        address = f"{host}:{port}"
        self.port = (server.add_secure_port(address, credentials) if credentials is not None
                     else server.add_insecure_port(address))
        if self.port == 0:
            raise OSError(f"cannot bind xDS port {host}:{port}")
        if server.add_insecure_port(self.probe_address) == 0:
            raise OSError(f"cannot listen on the xDS probe socket {self.probe_address}")
        await server.start()
        self._server = server
        return self.port

    async def stop(self, grace: float = 1.0) -> None:
        if self._server is not None:
            await self._server.stop(grace)
            self._server = None

    # ---- streams -------------------------------------------------------------------------

    async def stream(self, requests: AsyncIterator[discovery_pb2.DiscoveryRequest],
                     context: grpc.aio.ServicerContext, transport: str
                     ) -> AsyncIterator[discovery_pb2.DiscoveryResponse]:
        # The probe too: at the limit, istiod could not connect either.
        if len(self.registry) >= self.max_streams:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many xDS streams")
        if is_probe_peer(context.peer() or ""):
            async for resp in self._probe_stream(requests, context):
                yield resp
            return
        conn = self.registry.open(transport, context.peer() or "")
        self.metrics.streams.labels(transport).inc()
        try:
            # aclosing: the stream's own cleanup (unwatch, reader) runs when the RPC ends.
            async with contextlib.aclosing(XdsStream(conn, self.renderer_for, self.metrics)
                                           .serve(requests, self.cache)) as responses:
                async for resp in responses:
                    yield resp
        finally:
            self.registry.close(conn)
            self.metrics.streams.labels(transport).dec()

    async def _probe_stream(self, requests: AsyncIterator[discovery_pb2.DiscoveryRequest],
                            context: grpc.aio.ServicerContext) -> AsyncIterator[discovery_pb2.DiscoveryResponse]:
        """The same stream loop and renderers as istiod's stream, but no proxy: not in /v1/proxies
        or /metrics, no ACK recorded. The probe socket is plaintext and any local process may open
        it, so it serves the Istio (MCP) kinds only, never the sidecars' ECDS (which the local mesh
        keeps to mesh-certificate holders), and a few streams at a time."""
        if self._probe_streams >= MAX_PROBE_STREAMS:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many probe streams")
        self._probe_streams += 1
        try:
            probe = XdsStream(Connection(stream_id=0, transport="probe", peer="probe"),
                              lambda t: self.renderer_for(t) if GVK_RE.match(t) else None, self._probe_metrics)
            async with contextlib.aclosing(probe.serve(requests, self.cache)) as responses:
                async for resp in responses:
                    yield resp
        finally:
            self._probe_streams -= 1

    def fetch(self, req: discovery_pb2.DiscoveryRequest) -> discovery_pb2.DiscoveryResponse | None:
        """The current resources; None for a type that carries policies while no snapshot is known
        (the servicer says UNAVAILABLE)."""
        type_url = req.type_url or ECDS_TYPE_URL
        snap = self.cache.current
        renderer = self.renderer_for(type_url)
        if not self.cache.known and (renderer is None or renderer.needs_snapshot):
            return None
        if renderer is None or not renderer.serves(snap):
            return discovery_pb2.DiscoveryResponse(type_url=type_url)
        available = renderer.resources(snap)
        names = list(req.resource_names) or list(available)
        return discovery_pb2.DiscoveryResponse(
            version_info=renderer.version_of(snap), type_url=type_url,
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
        resp = self.xds.fetch(request)
        if resp is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no snapshot known yet (policy store unreachable)")
        return resp


class _AdsServicer(ads_pb2_grpc.AggregatedDiscoveryServiceServicer):
    def __init__(self, xds: XdsServer) -> None:
        self.xds = xds

    async def StreamAggregatedResources(self, request_iterator: AsyncIterator[discovery_pb2.DiscoveryRequest],  # noqa: N802
                                        context: grpc.aio.ServicerContext
                                        ) -> AsyncIterator[discovery_pb2.DiscoveryResponse]:
        async for resp in self.xds.stream(request_iterator, context, "ads"):
            yield resp
