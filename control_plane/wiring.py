"""Wiring: one ControlPlane = store + snapshot cache + Redis sync + xDS server + HTTP app."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .auth import TokenTable
from .fleet import FleetView, config_client_entries, replica_id
from .istio_objects import IstioObjects
from .istiod_sync import IstiodSync
from .mcp import IstioMcpRenderer, mcp_fallback
from .metrics import Metrics
from .model_index import ModelIndex, parse_engine_urls
from .policy_service import PolicyService
from .proxy_stats import ProxyStatsReader, parse_dns_names, parse_sources
from .renderers import EcdsRenderer
from .semantic_purge import SemanticPurger
from .settings import Settings
from .snapshots import SnapshotCache
from .state_file import Persister, StateFile
from .store import Store, StoreUnavailable
from .sync import RedisSync
from .xds_probe import XdsProbe
from .xds_server import XdsServer
from .xds_tls import xds_credentials

if TYPE_CHECKING:
    from .kube_writer import KubeWriter

log = logging.getLogger("meshcache.control_plane")


@dataclass
class MeshProxies:
    proxies: list[dict[str, Any]]
    config_clients: list[dict[str, Any]]
    complete: bool
    istiod_error: str | None


SOURCES = ("redis", "memory", "disk", "none")


@dataclass(frozen=True)
class Serving:
    """What this replica serves and why: one answer for /readyz, /v1/stats, the 503s and metrics.
    `source`: redis (in step with the store), memory (store unreachable; the snapshot last read
    from or written to it), disk (store not reached since start; the state file's), none."""

    source: str
    version: int | None
    store_reachable: bool

    @property
    def degraded(self) -> bool:
        return not self.store_reachable

    @property
    def detail(self) -> str:
        if self.source == "none":
            return ("no snapshot: the policy store (Redis) is unreachable and there is no saved state; "
                    "serving nothing until the store is back (proxies and istiod keep their last config)")
        if self.store_reachable:
            return f"serving snapshot {self.version} from the policy store (Redis)"
        where = "the state file (saved before this process started)" if self.source == "disk" else "memory"
        return f"policy store (Redis) unreachable: serving snapshot {self.version} from {where}"


class ControlPlane:
    def __init__(self, settings: Settings, tokens: TokenTable | None = None) -> None:
        self.settings = settings
        self.tokens = tokens if tokens is not None else TokenTable.from_settings(settings)
        self.metrics = Metrics()
        # Nothing is known (nor served) until Redis or the state file says what is current.
        self.cache = SnapshotCache(None, semantic_service=settings.semantic_service())
        self.state_file = StateFile(settings.state_dir, settings.key_prefix) if settings.state_dir else None
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
            # Imported here: the Kubernetes client (and yaml) is only needed for delivery kube.
            from .kube_client import KubeApi, connect
            from .kube_writer import KubeWriter

            objects = IstioObjects.from_settings(settings)
            if objects is not None and settings.kube_write:
                api = KubeApi(connect(settings.kubeconfig), settings.kube_timeout_s)
                self.kube_writer = KubeWriter(self.cache, objects, api, self.metrics, settings.kube_resync_s)
        else:
            istio = IstioMcpRenderer.from_settings(settings)
            if istio is not None:
                self.xds.add_renderer(istio)
        self.xds.add_fallback(mcp_fallback)
        # /healthz/xds and /readyz/xds: round trips through every xDS process (xds_probe.py).
        self.probe = XdsProbe(self.xds.probe_token, settings.xds_workers, list(self.xds.renderers))
        self.proxy_stats = ProxyStatsReader(parse_sources(settings.proxy_stats), settings.proxy_stats_template,
                                            timeout_s=settings.proxy_stats_timeout_s,
                                            dns_names=parse_dns_names(settings.proxy_stats_dns))
        self.istiod_sync = IstiodSync(settings.istiod_debug, settings.proxy_stats_timeout_s)
        self.model_index = ModelIndex(parse_engine_urls(settings.engine_index), settings.engine_index_timeout_s)
        self.semantic = SemanticPurger(settings.semantic_base_url(), settings.semantic_purge_timeout_s, self.metrics)
        self.fleet = FleetView(self.store, self.xds.registry, replica_id(settings.instance_id),
                               settings.resync_interval_s)
        self._tasks: list[asyncio.Task[None]] = []
        self.metrics.degraded.set_function(lambda: float(self.serving().degraded))
        for source in SOURCES:
            self.metrics.snapshot_source.labels(source).set_function(
                lambda source=source: float(self.serving().source == source))

    def serving(self) -> Serving:
        known = self.cache.known
        ok = self.sync.store_ok
        source = "none" if not known else "redis" if ok else "disk" if self.cache.origin == "disk" else "memory"
        return Serving(source, self.cache.current.version if known else None, ok)

    async def start(self) -> None:
        """Install the last good snapshot before serving anything: the state file's (if any),
        then Redis's current one (newer wins; a Redis behind the file gets the file's back). With
        neither, nothing is served until Redis answers (control_plane/README.md)."""
        saved = await asyncio.to_thread(self.state_file.load) if self.state_file is not None else None
        if saved is not None:
            self.cache.set(saved, origin="disk")
            self.metrics.snapshot_version.set(saved.version)
        try:
            await self.sync.resync()
        except StoreUnavailable as exc:
            self.sync.mark_unreachable()
            log.warning("Redis unreachable at start (%s)", exc)
        log.info("%s", self.serving().detail)
        self._tasks.append(asyncio.create_task(self.sync.run(), name="redis-sync"))
        self._tasks.append(asyncio.create_task(self.fleet.run(), name="fleet-publish"))
        if self.state_file is not None:
            persister = Persister(self.state_file, self.cache, self.metrics)
            self._tasks.append(asyncio.create_task(persister.run(), name="state-file"))
        if self.kube_writer is not None:
            self.kube_writer.start()
        port = await self.xds.start(self.settings.host, self.settings.xds_port, xds_credentials(self.settings))
        log.info("xDS on %s:%d", self.settings.host, port)

    async def mesh_proxies(self) -> MeshProxies:
        """Every proxy of the fleet (connected to any replica, or configured by istiod) and the
        config clients (istiod)."""
        entries, complete = await self.fleet.all()
        proxies, clients = config_client_entries(entries)
        istiod_acked = max((e["acked_version"] for e in clients if str(e["acked_version"]).isdigit()),
                           key=int, default="")
        sync = await self.istiod_sync.read(istiod_acked)
        known = {e["node_id"] for e in proxies}
        proxies += [e for e in sync.entries if e["node_id"] not in known]
        return MeshProxies(proxies, clients, complete and sync.error is None, sync.error)

    async def stop(self) -> None:
        await self.xds.stop(grace=0.5)
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.fleet.withdraw()
        await self.proxy_stats.close()
        await self.istiod_sync.close()
        await self.semantic.close()
        await self.store.close()
        if self.kube_writer is not None:
            await self.kube_writer.stop()
