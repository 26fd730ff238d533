"""Wiring: one ControlPlane = store + snapshot cache + Redis sync + xDS server + HTTP app."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc

from .auth import TokenTable
from .fleet import FleetView, replica_id
from .istio_objects import IstioObjects
from .kube_client import KubeApi, connect
from .kube_writer import KubeWriter
from .mcp import IstioMcpRenderer, mcp_fallback
from .metrics import Metrics
from .model_index import ModelIndex, parse_engine_urls
from .policy_service import PolicyService
from .proxy_stats import ProxyStatsReader, parse_dns_names, parse_sources
from .renderers import EcdsRenderer
from .settings import Settings
from .snapshots import SnapshotCache
from .store import Store, StoreUnavailable
from .sync import RedisSync
from .xds_server import XdsServer

log = logging.getLogger("meshcache.control_plane")


def xds_credentials(settings: Settings) -> grpc.ServerCredentials | None:
    """TLS for the xDS port when configured; a client CA makes client certificates mandatory."""
    if settings.xds_tls_cert is None or settings.xds_tls_key is None:
        return None
    ca = settings.xds_tls_client_ca.read_bytes() if settings.xds_tls_client_ca else None
    return grpc.ssl_server_credentials([(settings.xds_tls_key.read_bytes(), settings.xds_tls_cert.read_bytes())],
                                       root_certificates=ca, require_client_auth=ca is not None)


class ControlPlane:
    def __init__(self, settings: Settings, tokens: TokenTable | None = None) -> None:
        self.settings = settings
        self.tokens = tokens if tokens is not None else TokenTable.from_settings(settings)
        self.metrics = Metrics()
        self.cache = SnapshotCache()
        self.store = Store(settings)
        self.service = PolicyService(self.store, self.cache, self.metrics)
        self.sync = RedisSync(self.store, self.cache, self.metrics, settings)
        self.xds = XdsServer(self.cache, self.metrics, max_streams=settings.max_xds_streams)
        self.xds.add_renderer(EcdsRenderer(settings.wasm_path, settings.native_module))
        # The Istio objects: served to istiod over MCP on the same ADS port (mcp.py), or, with
        # delivery kube, written to the API server (kube_writer.py) and not served over MCP (an
        # istiod still pointed here gets empty answers, never a second copy).
        self.kube_writer: KubeWriter | None = None
        if settings.delivery == "kube":
            objects = IstioObjects.from_settings(settings)
            if objects is not None and settings.kube_write:
                api = KubeApi(connect(settings.kubeconfig), settings.kube_timeout_s)
                self.kube_writer = KubeWriter(self.cache, objects, api, self.metrics, settings.kube_resync_s)
        else:
            istio = IstioMcpRenderer.from_settings(settings)
            if istio is not None:
                self.xds.add_renderer(istio)
        self.xds.add_fallback(mcp_fallback)
        self.proxy_stats = ProxyStatsReader(parse_sources(settings.proxy_stats), settings.proxy_stats_template,
                                            timeout_s=settings.proxy_stats_timeout_s,
                                            dns_names=parse_dns_names(settings.proxy_stats_dns))
        self.model_index = ModelIndex(parse_engine_urls(settings.engine_index), settings.engine_index_timeout_s)
        self.fleet = FleetView(self.store, self.xds.registry, replica_id(settings.instance_id),
                               settings.resync_interval_s)
        self._sync_task: asyncio.Task[None] | None = None
        self._fleet_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Load the current snapshot if Redis is up (else start empty and keep retrying in the
        background: Envoys keep their default_config meanwhile), then serve xDS."""
        with contextlib.suppress(StoreUnavailable):
            await self.sync.resync()
        self._sync_task = asyncio.create_task(self.sync.run(), name="redis-sync")
        self._fleet_task = asyncio.create_task(self.fleet.run(), name="fleet-publish")
        if self.kube_writer is not None:
            self.kube_writer.start()
        port = await self.xds.start(self.settings.host, self.settings.xds_port, xds_credentials(self.settings))
        log.info("xDS on %s:%d, snapshot version %d", self.settings.host, port, self.cache.current.version)

    async def stop(self) -> None:
        await self.xds.stop(grace=0.5)
        for task in (self._sync_task, self._fleet_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self.fleet.withdraw()
        await self.proxy_stats.close()
        await self.store.close()
        if self.kube_writer is not None:
            await self.kube_writer.stop()
