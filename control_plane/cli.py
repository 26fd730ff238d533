"""`meshcache-control-plane`: HTTP API (uvicorn) and xDS (grpcio aio) in one event loop."""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import uvicorn
from pydantic import ValidationError

from .api import create_app
from .auth import TokenConfigError, TokenTable
from .istiod_sync import IstiodSyncConfigError
from .istiod_sync import check_url as check_istiod_url
from .model_index import IndexConfigError, parse_engine_urls
from .proxy_stats import ProxyStatsReader, StatsConfigError, parse_dns_names, parse_sources
from .settings import Settings
from .wiring import ControlPlane
from .xds_workers import STOP_TIMEOUT_S, start_workers, stop_workers


def parse_args(argv: Sequence[str] | None) -> dict[str, Any]:
    p = argparse.ArgumentParser(
        prog="meshcache-control-plane",
        description="Policy API + xDS (ECDS/ADS) for the meshcache filter. "
                    "Every flag can also be set as MESHCACHE_CP_<FLAG> (e.g. MESHCACHE_CP_REDIS_URL).")
    p.add_argument("--redis-url")
    p.add_argument("--host")
    p.add_argument("--http-port", type=int)
    p.add_argument("--xds-port", type=int)
    p.add_argument("--xds-tls-cert", help="PEM certificate for TLS on the xDS port (with --xds-tls-key)")
    p.add_argument("--xds-tls-key", help="PEM private key for --xds-tls-cert")
    p.add_argument("--xds-tls-client-ca", help="PEM CA: xDS clients must present a certificate it signed")
    p.add_argument("--istio-mode", choices=["full", "basic", "native"],
                   help="what istiod gets over MCP: EnvoyFilters (full, gRPC cached), TrafficExtensions (basic) or "
                        "EnvoyFilters with the Envoy dynamic module (native, Istio >= 1.31; "
                        "MESHCACHE_CP_ISTIO_NATIVE_MODULE names its path in the sidecars)")
    p.add_argument("--delivery", choices=["mcp", "kube"],
                   help="how istiod gets those objects: served over MCP (default) or written to the Kubernetes API "
                        "server (server-side apply into MESHCACHE_CP_ISTIO_NAMESPACE; docs/istio.md)")
    p.add_argument("--kubeconfig", help="delivery kube: the API server of this kubeconfig's current context "
                                        "(default: in-cluster, the pod's ServiceAccount)")
    p.add_argument("--wasm-path", help="filter module path as Envoy sees it (must match default_config)")
    p.add_argument("--native-module", help="the native host's module (libmeshcache_native.so) path as Envoy sees "
                                           "it, for Envoys that ask for the `meshcache-native` ECDS resource")
    p.add_argument("--tokens-file", help="file of `read|write:name:token` lines")
    p.add_argument("--state-dir", help="directory where the last good snapshot is saved, served after a restart "
                                       "while Redis is unreachable (Kubernetes: an emptyDir)")
    p.add_argument("--key-prefix")
    p.add_argument("--instance-id")
    p.add_argument("--proxy-stats", help="`node_id=url` entries (comma-separated): where each proxy's "
                                         "Prometheus stats are read for the status page")
    p.add_argument("--proxy-stats-template", help="stats URL with {ip} for Istio node ids and --proxy-stats-dns "
                                                  "addresses, e.g. http://{ip}:15090/stats/prometheus")
    p.add_argument("--proxy-stats-dns", help="DNS names (comma-separated) whose addresses are proxies to read "
                                             "through the template: headless Services of the cached pods")
    p.add_argument("--engine-index", help="engines' REST base URLs (comma-separated): a policy prefix matching "
                                          "no model in their repository index gets a warning")
    p.add_argument("--istiod-debug", help="istiod's debug URL (e.g. http://istiod.istio-system:15014/debug): the "
                                          "sidecars it configures and their ACKs, from its /debug/syncz")
    p.add_argument("--semantic-cluster", help="the proxies' Envoy cluster for the semantic index service "
                                              "(with --semantic-authority; unset: semantic lookups off)")
    p.add_argument("--semantic-authority", help="host[:port] the proxies call the semantic index service with")
    p.add_argument("--semantic-timeout-ms", type=int, help="the filter's lookup timeout (1..5000, default 200)")
    p.add_argument("--semantic-url", help="where the control plane calls the semantic index service to purge a "
                                          "policy's entries (default http://<semantic-authority>)")
    p.add_argument("--xds-workers", type=int,
                   help="xDS processes behind the xDS port (SO_REUSEPORT), this one included; default 1")
    p.add_argument("--log-level", default="info")
    args = vars(p.parse_args(argv))
    return {k: v for k, v in args.items() if v is not None}


class _Server(uvicorn.Server):
    """uvicorn re-raises the stop signal once it has shut down (the process dies of it, so code
    after `serve()` never runs): the xDS side and the workers are stopped in its shutdown."""

    def __init__(self, config: uvicorn.Config, on_shutdown: Callable[[], Awaitable[None]]) -> None:
        super().__init__(config)
        self._on_shutdown = on_shutdown

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await super().shutdown(sockets)
        await self._on_shutdown()


async def serve(settings: Settings, tokens: TokenTable, log_level: str) -> None:
    cp = ControlPlane(settings, tokens)
    await cp.start()
    workers = start_workers(settings, cp.xds.port, log_level, cp.xds.probe_token) if settings.xds_workers > 1 else []
    stopped = False

    async def stop() -> None:
        nonlocal stopped
        if not stopped:
            stopped = True
            await asyncio.to_thread(stop_workers, workers)
            # Bounded: the process ends anyway (uvicorn re-raises the signal).
            _, pending = await asyncio.wait({asyncio.ensure_future(cp.stop())}, timeout=STOP_TIMEOUT_S)
            if pending:
                logging.getLogger("meshcache.control_plane").warning("stop timed out after %.0f s", STOP_TIMEOUT_S)

    config = uvicorn.Config(create_app(cp), host=settings.host, port=settings.http_port,
                            log_level=log_level, access_log=False, lifespan="off")
    try:
        await _Server(config, stop).serve()  # returns (or the process ends) on SIGINT/SIGTERM
    finally:
        await stop()


def _kube_config_error(settings: Settings) -> Exception | None:
    """Delivery kube without an API server to write to: the reason (the process refuses to start)."""
    # Imported here: the Kubernetes client (and yaml) is only needed for delivery kube.
    from .kube_client import KubeConfigError, connect

    try:
        connect(settings.kubeconfig)
    except (KubeConfigError, OSError) as exc:
        return exc
    return None


def _bad_configuration(exc: Exception) -> int:
    print(f"meshcache-control-plane: bad configuration: {exc}", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    log_level = str(args.pop("log_level")).lower()
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # httpx logs every request at INFO: a line per proxy stats, syncz or index read (--log-level debug keeps them).
    if log_level != "debug":
        for name in ("httpx", "httpcore"):
            logging.getLogger(name).setLevel(logging.WARNING)
    try:
        settings = Settings(**args)
        tokens = TokenTable.from_settings(settings)
        # Bad entries: refuse to start, say which.
        ProxyStatsReader(parse_sources(settings.proxy_stats), settings.proxy_stats_template,
                         dns_names=parse_dns_names(settings.proxy_stats_dns))
        parse_engine_urls(settings.engine_index)
        check_istiod_url(settings.istiod_debug)
    except (ValidationError, TokenConfigError, StatsConfigError, IndexConfigError, IstiodSyncConfigError,
            OSError) as exc:
        return _bad_configuration(exc)
    if settings.delivery == "kube" and (exc := _kube_config_error(settings)) is not None:
        return _bad_configuration(exc)
    if len(tokens) == 0:
        print("meshcache-control-plane: no API tokens configured "
              "(--tokens-file or MESHCACHE_CP_TOKENS, entries `read|write:name:token`)", file=sys.stderr)
        return 2
    asyncio.run(serve(settings, tokens, log_level))
    return 0


if __name__ == "__main__":
    sys.exit(main())
