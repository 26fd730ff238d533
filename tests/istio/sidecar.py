"""An Envoy config shaped like what istiod 1.30 generates for an inbound sidecar, the piece of
istiod that serves EXTENSION_CONFIG resources by ECDS over ADS, and istio-agent's Wasm rewrite.

Shape (pilot/pkg/networking/core listener_inbound.go, listener_builder.go, httproute.go):
- listener `virtualInbound`, one filter chain per container port and transport (mTLS `tls` and
  `raw_buffer`, as PERMISSIVE has), matched by `destination_port`;
- an inline route config per port named `inbound|<port>||`, virtual host `inbound|http|<port>`,
  route `default` to cluster `inbound|<port>||`;
- HTTP filters in Istio's order: metadata exchange, authn, RBAC, grpc_stats, fault, cors,
  `istio.stats`, router. The istio-proxy-only filters (`istio.metadata_exchange`, `istio_authn`,
  `istio.stats`) are not in stock Envoy: stand-ins of the same names (a no-op header mutation) keep
  the names and positions patches anchor on.
- ADS to the cluster `xds-grpc`; the bootstrap's internal listener extension, as Istio's has.
- Optionally (`stats_port`) the bootstrap's stats matcher and Prometheus listener
  (tools/packaging/common/envoy_bootstrap.json): inclusion prefixes `reporter=`, the pod's
  proxyStatsMatcher prefixes, `component`, `istio`; `/stats/prometheus` on :15090 routed to the
  admin port (cluster `prometheus_stats`).
Not reproduced: iptables (the listener binds a free port; `remap_port` stands in for the
redirect), original_dst, SDS certificates (files instead), telemetry.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
from envoy.config.core.v3 import extension_pb2
from envoy.extensions.filters.http.rbac.v3 import rbac_pb2  # noqa: F401 - registers the type for Any
from envoy.extensions.filters.http.wasm.v3 import wasm_pb2  # noqa: F401 - registers the type for Any
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from google.protobuf import any_pb2, json_format

from meshcache.contract import oci
from meshcache.ctl.pki import Identity

Obj = dict[str, Any]
_ENVOY = "type.googleapis.com/envoy."
ECDS_TYPE_URL = _ENVOY + "config.core.v3.TypedExtensionConfig"
WASM_TYPE_URL = _ENVOY + "extensions.filters.http.wasm.v3.Wasm"
RBAC_TYPE_URL = _ENVOY + "extensions.filters.http.rbac.v3.RBAC"
STAND_IN = {"@type": _ENVOY + "extensions.filters.http.header_mutation.v3.HeaderMutation", "mutations": {}}
ISTIO_HTTP_FILTER_ORDER = ["istio.metadata_exchange", "istio_authn", "envoy.filters.http.rbac",
                           "envoy.filters.http.grpc_stats", "envoy.filters.http.fault", "envoy.filters.http.cors",
                           "istio.stats", "envoy.filters.http.router"]


def _http_filters() -> list[Obj]:
    typed = {
        "istio.metadata_exchange": STAND_IN,
        "istio_authn": STAND_IN,
        # An ALLOW AuthorizationPolicy as istiod translates it (here: any principal).
        "envoy.filters.http.rbac": {"@type": RBAC_TYPE_URL, "rules": {"policies": {"ns[ml]-policy[engine]-rule[0]": {
            "permissions": [{"any": True}], "principals": [{"any": True}]}}}},
        "envoy.filters.http.grpc_stats": {"@type": _ENVOY + "extensions.filters.http.grpc_stats.v3.FilterConfig",
                                          "emit_filter_state": True, "stats_for_all_methods": False},
        "envoy.filters.http.fault": {"@type": _ENVOY + "extensions.filters.http.fault.v3.HTTPFault"},
        "envoy.filters.http.cors": {"@type": _ENVOY + "extensions.filters.http.cors.v3.Cors"},
        "istio.stats": STAND_IN,
        "envoy.filters.http.router": {"@type": _ENVOY + "extensions.filters.http.router.v3.Router"},
    }
    return [{"name": n, "typed_config": copy.deepcopy(typed[n])} for n in ISTIO_HTTP_FILTER_ORDER]


def _hcm(port: int) -> Obj:
    name = f"inbound|{port}||"
    return {
        "name": "envoy.filters.network.http_connection_manager",
        "typed_config": {
            "@type": _ENVOY + "extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
            "stat_prefix": f"inbound_0.0.0.0_{port}",
            "codec_type": "AUTO",
            "use_remote_address": False,
            "forward_client_cert_details": "APPEND_FORWARD",
            "normalize_path": True,
            "stream_idle_timeout": "0s",
            "http2_protocol_options": {"max_concurrent_streams": 2147483647},
            "route_config": {"name": name, "validate_clusters": False, "virtual_hosts": [{
                "name": f"inbound|http|{port}", "domains": ["*"], "routes": [{
                    "name": "default", "match": {"prefix": "/"},
                    "route": {"cluster": name, "timeout": "0s",
                              "max_stream_duration": {"max_stream_duration": "0s",
                                                      "grpc_timeout_header_max": "0s"}},
                    "decorator": {"operation": f"meshcache-engine.ml.svc.cluster.local:{port}/*"}}]}]},
            "http_filters": _http_filters(),
        },
    }


def _mtls(identity: Identity) -> Obj:
    return {"name": "envoy.transport_sockets.tls", "typed_config": {
        "@type": _ENVOY + "extensions.transport_sockets.tls.v3.DownstreamTlsContext",
        "require_client_certificate": True,
        "common_tls_context": {
            "alpn_protocols": ["h2", "http/1.1"],
            "tls_certificates": [{"certificate_chain": {"filename": str(identity.cert)},
                                  "private_key": {"filename": str(identity.key)}}],
            "validation_context": {"trusted_ca": {"filename": str(identity.ca)}}}}}


def _cluster(name: str, port: int, http2: bool) -> Obj:
    c: Obj = {"name": name, "type": "STATIC", "connect_timeout": "10s", "load_assignment": {
        "cluster_name": name, "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {
            "socket_address": {"address": "127.0.0.1", "port_value": port}}}}]}]}}
    if http2:
        c["typed_extension_protocol_options"] = {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": _ENVOY + "extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http2_protocol_options": {}}}}
    return c


def stats_listener(stats_port: int) -> Obj:
    """Istio's Envoy Prometheus listener (:15090 in a pod): /stats/prometheus to the admin port."""
    route = {"virtual_hosts": [{"name": "backend", "domains": ["*"], "routes": [
        {"match": {"prefix": "/stats/prometheus"}, "route": {"cluster": "prometheus_stats"}}]}]}
    hcm = {"@type": _ENVOY + "extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
           "codec_type": "AUTO", "stat_prefix": "stats", "route_config": route,
           "http_filters": [{"name": "envoy.filters.http.router",
                             "typed_config": {"@type": _ENVOY + "extensions.filters.http.router.v3.Router"}}]}
    return {"name": "prometheus_stats_listener",
            "address": {"socket_address": {"address": "127.0.0.1", "port_value": stats_port}},
            "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                            "typed_config": hcm}]}]}


def inbound_sidecar(*, listen_port: int, admin_port: int, xds_port: int, upstreams: dict[int, int],
                    grpc_ports: set[int], identity: Identity, stats_port: int | None = None,
                    stats_inclusion_prefixes: list[str] | None = None) -> Obj:
    """`upstreams`: container port -> where the app listens here (127.0.0.1). `stats_port`: add
    Istio's stats matcher (with the pod's `stats_inclusion_prefixes`) and Prometheus listener."""
    chains = []
    for port in upstreams:
        for transport in ("tls", "raw_buffer"):
            chain: Obj = {"name": f"0.0.0.0_{port}",
                          "filter_chain_match": {"destination_port": port, "transport_protocol": transport},
                          "filters": [_hcm(port)]}
            if transport == "tls":
                chain["filter_chain_match"]["application_protocols"] = ["istio-peer-exchange", "istio"]
                chain["transport_socket"] = _mtls(identity)
            chains.append(chain)
    listener = {
        "name": "virtualInbound",
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": listen_port}},
        "listener_filters": [
            {"name": "envoy.filters.listener.tls_inspector", "typed_config": {
                "@type": _ENVOY + "extensions.filters.listener.tls_inspector.v3.TlsInspector"}},
            {"name": "envoy.filters.listener.http_inspector", "typed_config": {
                "@type": _ENVOY + "extensions.filters.listener.http_inspector.v3.HttpInspector"}},
        ],
        "filter_chains": chains,
    }
    clusters = [_cluster(f"inbound|{p}||", up, http2=p in grpc_ports) for p, up in upstreams.items()]
    clusters.append(_cluster("xds-grpc", xds_port, http2=True))
    listeners = [listener]
    extra: Obj = {}
    if stats_port is not None:
        listeners.append(stats_listener(stats_port))
        clusters.append(_cluster("prometheus_stats", admin_port, http2=False))
        prefixes = ["reporter=", *(stats_inclusion_prefixes or []), "component", "istio"]
        extra["stats_config"] = {"use_all_default_tags": False, "stats_matcher": {
            "inclusion_list": {"patterns": [{"prefix": p} for p in prefixes]}}}
    return {**extra,
        "node": {"id": "sidecar~10.0.0.1~meshcache-engine-blue-0.ml~ml.svc.cluster.local", "cluster": "engine.ml"},
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}},
        "static_resources": {"listeners": listeners, "clusters": clusters},
        "dynamic_resources": {"ads_config": {
            "api_type": "GRPC", "transport_api_version": "V3", "set_node_on_first_message_only": True,
            "grpc_services": [{"envoy_grpc": {"cluster_name": "xds-grpc"}}]}},
        "bootstrap_extensions": [{"name": "envoy.bootstrap.internal_listener", "typed_config": {
            "@type": _ENVOY + "extensions.bootstrap.internal_listener.v3.InternalListener"}}],
    }


def remap_port(config: Obj, container_port: int, listen_port: int) -> None:
    """What iptables does in a pod: connections to the listener's port count as `container_port`."""
    for chain in config["static_resources"]["listeners"][0]["filter_chains"]:
        if chain["filter_chain_match"]["destination_port"] == container_port:
            chain["filter_chain_match"]["destination_port"] = listen_port


def http_filters(config: Obj, port: int) -> Iterator[list[str]]:
    for chain in config["static_resources"]["listeners"][0]["filter_chains"]:
        if chain["filter_chain_match"]["destination_port"] == port:
            yield [f["name"] for f in chain["filters"][0]["typed_config"]["http_filters"]]


def route_config(config: Obj, port: int) -> Obj:
    chain = next(c for c in config["static_resources"]["listeners"][0]["filter_chains"]
                 if c["filter_chain_match"]["destination_port"] == port)
    return chain["filters"][0]["typed_config"]["route_config"]  # type: ignore[no-any-return]


# ---- istio-agent: remote Wasm code -> a local file (pkg/wasm convert.go) ---------------------


def agent_rewrite(resources: dict[str, Obj], registry: dict[str, oci.Image], cache_dir: Path) -> dict[str, Obj]:
    """Fetch each remote module from `registry` (image reference -> image), verify the pinned
    digest against the image manifest digest, extract plugin.wasm and point the config at it. A
    failure gives the FAIL_OPEN fallback the agent uses: an allow-all RBAC filter."""
    out = {}
    for name, ext in resources.items():
        ext = copy.deepcopy(ext)
        typed = ext["typed_config"]
        code = typed.get("config", {}).get("vm_config", {}).get("code", {})
        if typed["@type"] == WASM_TYPE_URL and "remote" in code:
            uri, pinned = code["remote"]["http_uri"]["uri"], code["remote"].get("sha256", "")
            image = registry.get(uri.removeprefix("oci://"))
            if image is None or image.digest != pinned:
                ext["typed_config"] = {"@type": RBAC_TYPE_URL, "rules_stat_prefix": "wasm-default-allow"}
            else:
                path = cache_dir / f"{image.digest}.wasm"
                path.write_bytes(oci.extract_module(image))
                typed["config"]["vm_config"]["code"] = {"local": {"filename": str(path)}}
        out[name] = ext
    return out


# ---- istiod's ECDS over ADS ---------------------------------------------------------------


class EcdsOverAds(ads_pb2_grpc.AggregatedDiscoveryServiceServicer):
    """Serves TypedExtensionConfig resources by name on the ADS stream, as istiod does for
    EXTENSION_CONFIG patches; records ACKs and NACKs."""

    def __init__(self, resources: dict[str, Obj]) -> None:
        self.resources = {n: json_format.ParseDict(r, extension_pb2.TypedExtensionConfig())
                          for n, r in resources.items()}
        self.acks: list[str] = []
        self.nacks: list[str] = []
        self.requested: list[str] = []
        self._lock = threading.Lock()

    def StreamAggregatedResources(self, request_iterator: Iterator[discovery_pb2.DiscoveryRequest],  # noqa: N802
                                  context: grpc.ServicerContext) -> Iterator[discovery_pb2.DiscoveryResponse]:
        nonce = 0
        for req in request_iterator:
            if req.type_url != ECDS_TYPE_URL:
                continue
            if req.response_nonce:
                with self._lock:
                    (self.nacks if req.error_detail.message else self.acks).append(
                        req.error_detail.message or req.version_info)
                continue
            with self._lock:
                self.requested += list(req.resource_names)
            nonce += 1
            found = []
            for n in req.resource_names:
                if n in self.resources:
                    packed = any_pb2.Any()
                    packed.Pack(self.resources[n])
                    found.append(packed)
            yield discovery_pb2.DiscoveryResponse(version_info="1", type_url=ECDS_TYPE_URL, nonce=str(nonce),
                                                  resources=found)


def serve_ecds(servicer: EcdsOverAds) -> tuple[grpc.Server, int]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    ads_pb2_grpc.add_AggregatedDiscoveryServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port
