"""The EnvoyFilter for the gRPC-hit path inside an Istio sidecar (same shape as the local proxy in
meshcache/envoy_config.py; see the notes' "gRPC cache hits"): a local reply cannot carry a gRPC
body, so hits are routed to an internal listener that runs the same module as a stub.

Patches (inbound side of the engine's sidecar, gRPC port only):
1. CLUSTER `cache_stub` -> `envoy_internal_address` of the stub listener;
2. LISTENER `cache_stub_listener` (internal): the module with plugin config {"role": "stub"};
3. HTTP_FILTER grpc_http1_reverse_bridge before the router, `disabled: true` so it only runs
   where a route enables it (Istio generates the other inbound routes; none of them enable it);
4. HTTP_ROUTE first in the gRPC port's inbound virtual host: `x-meshcache-hit` -> `cache_stub`,
   enabling the bridge.

VM sharing: the stub must see the cache filter's shared data, which Envoy keys by vm_id. Istio's
WasmPlugin filters have no vm_id (""), so the stub uses "" too; the ECDS overlay, whose filter
comes from the control plane with vm_id "meshcache", sets it to that.
The module bytes reach the stub through the image volume mounted at /etc/meshcache (engine.yaml).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from meshcache.envoy_config import BRIDGE, BRIDGE_PER_ROUTE, HIT_HEADER, STUB_LISTENER
from meshcache.wasm_filter import FILTER_NAME, STUB_ROLE_CONFIG, WASM_TYPE_URL, wasm_filter_config

SIDECAR_MODULE_PATH = Path("/etc/meshcache/plugin.wasm")
ISTIO_VM_ID = ""  # what Istio's WasmPlugin filters run with
GRPC_PORT = 8001
_ENVOY = "type.googleapis.com/envoy."
HCM = "envoy.filters.network.http_connection_manager"
ROUTER = "envoy.filters.http.router"


def stub_cluster() -> dict[str, Any]:
    return {
        "name": "cache_stub",
        "connect_timeout": "1s",
        "load_assignment": {
            "cluster_name": "cache_stub",
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {
                "envoy_internal_address": {"server_listener_name": STUB_LISTENER}}}}]}],
        },
    }


def stub_wasm_filter(vm_id: str = ISTIO_VM_ID, module_path: Path = SIDECAR_MODULE_PATH) -> dict[str, Any]:
    cfg = wasm_filter_config(module_path, STUB_ROLE_CONFIG)
    cfg["config"]["vm_config"]["vm_id"] = vm_id
    return {"name": "meshcache_stub", "typed_config": {"@type": WASM_TYPE_URL, **cfg}}


def stub_listener(vm_id: str = ISTIO_VM_ID, module_path: Path = SIDECAR_MODULE_PATH) -> dict[str, Any]:
    hcm = {
        "@type": _ENVOY + "extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "meshcache_stub",
        "route_config": {
            "name": "meshcache_stub",
            # Only reached when the stub's VM is down: never expose anything else.
            "virtual_hosts": [{"name": "meshcache_stub", "domains": ["*"],
                               "routes": [{"match": {"prefix": "/"}, "direct_response": {"status": 503}}]}],
        },
        "http_filters": [
            stub_wasm_filter(vm_id, module_path),
            {"name": ROUTER, "typed_config": {"@type": _ENVOY + "extensions.filters.http.router.v3.Router"}},
        ],
    }
    return {
        "name": STUB_LISTENER,
        "internal_listener": {},
        "filter_chains": [{"filters": [{"name": HCM, "typed_config": hcm}]}],
    }


def bridge_filter() -> dict[str, Any]:
    return {
        "name": BRIDGE,
        "disabled": True,
        "typed_config": {
            "@type": _ENVOY + "extensions.filters.http.grpc_http1_reverse_bridge.v3.FilterConfig",
            "content_type": "application/x-protobuf",
            "withhold_grpc_frames": True,
        },
    }


def hit_route() -> dict[str, Any]:
    return {
        "name": "meshcache_grpc_hit",
        "match": {"prefix": "/", "headers": [{"name": HIT_HEADER, "present_match": True}]},
        "route": {"cluster": "cache_stub", "timeout": "5s"},
        "typed_per_filter_config": {BRIDGE: {
            "@type": _ENVOY + "config.route.v3.FilterConfig",
            "config": {"@type": BRIDGE_PER_ROUTE, "disabled": False},
        }},
    }


def envoy_filter(vm_id: str = ISTIO_VM_ID, port: int = GRPC_PORT) -> dict[str, Any]:
    """The EnvoyFilter object (no namespace: kustomize/render sets it)."""
    inbound_hcm = {"portNumber": port, "filterChain": {"filter": {"name": HCM, "subFilter": {"name": ROUTER}}}}
    return {
        "apiVersion": "networking.istio.io/v1alpha3",
        "kind": "EnvoyFilter",
        "metadata": {"name": "meshcache-grpc-hit"},
        "spec": {
            "workloadSelector": {"labels": {"app": "meshcache-engine"}},
            "configPatches": [
                {"applyTo": "CLUSTER", "match": {"context": "SIDECAR_OUTBOUND"},
                 "patch": {"operation": "ADD", "value": stub_cluster()}},
                {"applyTo": "LISTENER", "match": {"context": "SIDECAR_OUTBOUND"},
                 "patch": {"operation": "ADD", "value": stub_listener(vm_id)}},
                {"applyTo": "HTTP_FILTER", "match": {"context": "SIDECAR_INBOUND", "listener": inbound_hcm},
                 "patch": {"operation": "INSERT_BEFORE", "value": bridge_filter()}},
                {"applyTo": "HTTP_ROUTE",
                 "match": {"context": "SIDECAR_INBOUND",
                           "routeConfiguration": {"portNumber": port, "vhost": {"name": f"inbound|http|{port}"}}},
                 "patch": {"operation": "INSERT_FIRST", "value": hit_route()}},
            ],
        },
    }


# ---- overlays/ecds: the cache filter straight from the control plane's ECDS ---------------------

XDS_CLUSTER = "meshcache_xds"
XDS_PORT = 18000
ISTIO_STATS = "istio.stats"
_SDS = {
    "resource_api_version": "V3",
    "initial_fetch_timeout": "0s",
    "api_config_source": {
        "api_type": "GRPC", "transport_api_version": "V3", "set_node_on_first_message_only": True,
        # istio-agent's SDS server: the workload certificate and the mesh root, as Istio's own
        # ISTIO_MUTUAL clusters use them.
        "grpc_services": [{"envoy_grpc": {"cluster_name": "sds-grpc"}}],
    },
}


def xds_cluster(namespace: str = "meshcache") -> dict[str, Any]:
    """The control plane's xDS port, over Istio mTLS (the sidecar's own connections bypass the
    iptables capture, so this cluster does the mTLS itself with the workload's SDS certificate)."""
    host = f"meshcache-control-plane.{namespace}.svc.cluster.local"
    return {
        "name": XDS_CLUSTER,
        "type": "STRICT_DNS",
        "connect_timeout": "5s",
        "load_assignment": {"cluster_name": XDS_CLUSTER, "endpoints": [{"lb_endpoints": [{"endpoint": {
            "address": {"socket_address": {"address": host, "port_value": XDS_PORT}}}}]}]},
        "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": _ENVOY + "extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http2_protocol_options": {}},
        }},
        "transport_socket": {"name": "envoy.transport_sockets.tls", "typed_config": {
            "@type": _ENVOY + "extensions.transport_sockets.tls.v3.UpstreamTlsContext",
            "sni": f"outbound_.{XDS_PORT}_._.{host}",
            "common_tls_context": {
                "alpn_protocols": ["istio", "h2"],
                "tls_certificate_sds_secret_configs": [{"name": "default", "sds_config": _SDS}],
                "combined_validation_context": {
                    "default_validation_context": {"match_typed_subject_alt_names": [{
                        "san_type": "URI",
                        "matcher": {"exact": f"spiffe://cluster.local/ns/{namespace}/sa/meshcache-control-plane"},
                    }]},
                    "validation_context_sds_secret_config": {"name": "ROOTCA", "sds_config": _SDS},
                },
            },
        }},
    }


def ecds_cache_filter(module_path: Path = SIDECAR_MODULE_PATH) -> dict[str, Any]:
    """The cache filter by ECDS from the control plane. The default config (no policies: traffic
    flows uncached) has the VM config the control plane pushes (vm_id "meshcache", same path),
    so pushes only swap the plugin configuration and keep the VM and its cache."""
    return {
        "name": FILTER_NAME,
        "config_discovery": {
            "config_source": {
                "resource_api_version": "V3",
                "api_config_source": {"api_type": "GRPC", "transport_api_version": "V3",
                                      "grpc_services": [{"envoy_grpc": {"cluster_name": XDS_CLUSTER}}]},
            },
            "default_config": {"@type": WASM_TYPE_URL, **wasm_filter_config(module_path, {})},
            "apply_default_config_without_warming": True,
            "type_urls": [WASM_TYPE_URL],
        },
    }


def ecds_envoy_filter(ports: tuple[int, ...] = (8000, GRPC_PORT)) -> dict[str, Any]:
    patches: list[dict[str, Any]] = [
        {"applyTo": "CLUSTER", "match": {"context": "SIDECAR_OUTBOUND"},
         "patch": {"operation": "ADD", "value": xds_cluster()}},
    ]
    for port in ports:
        # Same place as the WasmPlugin's STATS phase: after authn/authz, before istio.stats.
        listener = {"portNumber": port, "filterChain": {"filter": {"name": HCM, "subFilter": {"name": ISTIO_STATS}}}}
        patches.append({"applyTo": "HTTP_FILTER", "match": {"context": "SIDECAR_INBOUND", "listener": listener},
                        "patch": {"operation": "INSERT_BEFORE", "value": ecds_cache_filter()}})
    return {
        "apiVersion": "networking.istio.io/v1alpha3",
        "kind": "EnvoyFilter",
        "metadata": {"name": "meshcache-ecds"},
        "spec": {"workloadSelector": {"labels": {"app": "meshcache-engine"}}, "configPatches": patches},
    }
