"""Envoy bootstraps with the meshcache filter, rendered from one definition.

The cache proxy's shape (see docs/filter.md):
- listener `ingress`: meshcache wasm -> Lua `meshcache.grpc_hit_body` (acts on the gRPC hit
  route only) -> router. gRPC requests go to the gRPC upstream, everything else to the HTTP
  upstream.
- gRPC hits are answered in one pass: the filter marks the request with filter state
  `wasm.meshcache_local` (clients cannot set it) and sends a local reply; that reply selects
  the `meshcache_grpc_hit` route, whose Lua step gives it a body the filter fills with the
  framed message and a `grpc-status: 0` trailer (fragments: meshcache.contract.grpc_hit).
- With `ecds_port`, the cache filter comes from the control plane over ECDS, with the static
  plugin config as `default_config` so traffic flows before the control plane is reachable.
  A list of ports = several control-plane replicas: one endpoint each in the xDS cluster, so the
  Envoys spread over them (round robin) and a lost replica's Envoys reopen their stream on another.
- `color_routes`: requests whose `x-traffic-color` equals a key go to that colour's upstream
  (e.g. `blue` to a canary engine); everything else to the default upstream. The filter puts the
  colour in the cache key, so colours never share entries.

The client-side sidecar (`ClientSidecar`) is the app's local proxy: a plaintext listener (gRPC
and HTTP/1.1), `x-traffic-color` added unless the app set one (an early header mutation, so
filters and routes see it), and HTTP/2 over strict mTLS (TLS 1.3, the server sidecar's SPIFFE
ID checked) to the server-side sidecars, one per engine replica. With `affinity`, the meshcache
filter runs there in the client role (config from the control plane's `meshcache-client` ECDS
resource) and sets `x-meshcache-route-key`; the replicas' cluster is RING_HASH (or MAGLEV) with
a route `hash_policy` on that header, so identical requests reach the replica that cached the
answer. Requests without the header (the server would bypass them) balance at random.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from meshcache.contract.filter_config import DEMO_POLICIES, client_plugin_config
from meshcache.contract.grpc_hit import grpc_hit_lua_filter, grpc_hit_routes
from meshcache.contract.headers import COLOR_HEADER, ROUTE_KEY_HEADER
from meshcache.contract.native_filter import (
    DYNAMIC_MODULE_TYPE_URL,
    NATIVE_CLIENT_FILTER_NAME,
    NATIVE_FILTER_NAME,
    native_filter_config,
    native_http_filter,
)
from meshcache.contract.wasm_filter import (
    CLIENT_FILTER_NAME,
    FILTER_NAME,
    WASM_TYPE_URL,
    ecds_http_filter,
    wasm_filter_config,
)
from meshcache.ctl.pki import Identity

_ENVOY = "type.googleapis.com/envoy."
BUFFER_LIMIT_BYTES = 16 * 1024 * 1024  # above the filter's max entry/request sizes it buffers

@dataclass(frozen=True)
class Upstream:
    """An upstream serving HTTP (and optionally gRPC) on loopback ports."""

    http_port: int
    grpc_port: int | None = None


@dataclass
class CacheProxy:
    listen_port: int
    admin_port: int
    http_upstream_port: int
    grpc_upstream_port: int | None = None
    wasm_path: Path = Path("/etc/meshcache/meshcache_filter.wasm")
    plugin_config: dict[str, Any] = field(default_factory=dict)
    ecds_port: int | list[int] | None = None
    node_id: str = "meshcache-sidecar"
    cluster: str = "meshcache"
    with_filter: bool = True
    # False renders the Wasm filter as Istio's WasmPlugin does (see wasm_filter_config).
    allow_on_headers_stop_iteration: bool = True
    address: str = "127.0.0.1"
    # Strict mTLS on the listener: TLS 1.3 only, client certificate required, and (when set)
    # the peer's URI SAN must be one of `allowed_peers`.
    downstream_tls: Identity | None = None
    allowed_peers: list[str] = field(default_factory=list)
    # x-traffic-color value -> the upstream that colour is routed to (default upstream otherwise).
    color_routes: dict[str, Upstream] = field(default_factory=dict)
    # mTLS to the control plane's xDS port (ECDS): this identity as the client certificate, and
    # the control plane must present one of `xds_peers` (SPIFFE IDs).
    xds_tls: Identity | None = None
    xds_peers: list[str] = field(default_factory=list)
    # Per-connection buffer limit of the listener and upstreams; None = Envoy's default (1 MiB),
    # what an Istio sidecar runs with. The filter works under either.
    buffer_limit_bytes: int | None = BUFFER_LIMIT_BYTES
    # The cache as an Envoy dynamic module (filter/native/, issue 24) instead of the Wasm filter.
    # With `ecds_port` it comes from the control plane's `meshcache-native` ECDS resource.
    native_module: Path | None = None
    # False leaves out the single-pass gRPC hit route and its Lua filter: a misconfigured
    # sidecar, where the filter must bypass gRPC (tests).
    grpc_hit_route: bool = True
    # The routes' upstream timeout (past it Envoy answers 504, gRPC UNAVAILABLE).
    route_timeout_s: float = 60.0
    # The semantic index service on loopback (docs/llm.md): a cluster SEMANTIC_CLUSTER the filter
    # calls on an exact miss (the control plane names it in the config's `semantic_service`).
    semantic_port: int | None = None


SEMANTIC_CLUSTER = "meshcache_semantic"


def _socket(address: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": address, "port_value": port}}


def _cluster(name: str, port: int | list[int], http2: bool, buffer_limit: int | None = BUFFER_LIMIT_BYTES
             ) -> dict[str, Any]:
    ports = port if isinstance(port, list) else [port]
    c: dict[str, Any] = {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "1s",
        **_buffer_limit(buffer_limit),
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": _socket("127.0.0.1", p)}} for p in ports]}],
        },
    }
    if http2:
        c["typed_extension_protocol_options"] = _http2_options()
    return c


def _buffer_limit(limit: int | None) -> dict[str, Any]:
    """None keeps Envoy's default (1 MiB), as an Istio sidecar has."""
    return {} if limit is None else {"per_connection_buffer_limit_bytes": limit}


def _http2_options() -> dict[str, Any]:
    return {
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": _ENVOY + "extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http2_protocol_options": {}},
        }
    }


def _tls_params() -> dict[str, Any]:
    return {"tls_minimum_protocol_version": "TLSv1_3", "tls_maximum_protocol_version": "TLSv1_3"}


def _validation(identity: Identity, allowed_peers: list[str]) -> dict[str, Any]:
    v: dict[str, Any] = {"trusted_ca": {"filename": str(identity.ca)}}
    if allowed_peers:
        v["match_typed_subject_alt_names"] = [{"san_type": "URI", "matcher": {"exact": p}} for p in allowed_peers]
    return v


def _certificates(identity: Identity) -> list[dict[str, Any]]:
    return [{"certificate_chain": {"filename": str(identity.cert)}, "private_key": {"filename": str(identity.key)}}]


# ---- certificates over file-based SDS ------------------------------------------------------------
# An identity with `sds_dir` reaches Envoy through SDS: one Secret file for the certificate + key,
# one for the trust bundle, each read with a path config source. The secrets name the files in
# `sds_dir` and watch that directory: an atomic rename there (the `..data` symlink swap done by
# meshcache.ctl.mesh.certs) makes Envoy re-read certificate, key and CA together, without a restart;
# new handshakes use the new files, open connections stay up.
SDS_CERT_SECRET = "workload_certificate"
SDS_TRUST_SECRET = "trust_bundle"
SECRET_TYPE = _ENVOY + "extensions.transport_sockets.tls.v3.Secret"


def sds_secret_paths(identity: Identity) -> tuple[Path, Path]:
    """(certificate secret file, trust bundle secret file) of an SDS identity."""
    assert identity.sds_dir is not None
    return identity.sds_dir / "sds" / "certificate.yaml", identity.sds_dir / "sds" / "trust-bundle.yaml"


def sds_secrets(identity: Identity) -> dict[Path, dict[str, Any]]:
    """The Secret files Envoy reads (DiscoveryResponse documents), by path."""
    cert_path, trust_path = sds_secret_paths(identity)
    watched = {"path": str(identity.sds_dir)}
    cert = {"@type": SECRET_TYPE, "name": SDS_CERT_SECRET, "tls_certificate": {
        "certificate_chain": {"filename": str(identity.cert)}, "private_key": {"filename": str(identity.key)},
        "watched_directory": watched}}
    trust = {"@type": SECRET_TYPE, "name": SDS_TRUST_SECRET, "validation_context": {
        "trusted_ca": {"filename": str(identity.ca)}, "watched_directory": watched}}
    return {cert_path: {"resources": [cert]}, trust_path: {"resources": [trust]}}


def write_sds_secrets(identity: Identity) -> None:
    for path, doc in sds_secrets(identity).items():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(yaml.safe_dump(doc, sort_keys=False))
        tmp.replace(path)


def _sds_ref(name: str, path: Path) -> dict[str, Any]:
    return {"name": name, "sds_config": {"resource_api_version": "V3", "path_config_source": {"path": str(path)}}}


def _tls_identity(identity: Identity, allowed_peers: list[str]) -> dict[str, Any]:
    """The CommonTlsContext fields naming our certificate and the CA + SANs we accept."""
    if identity.sds_dir is None:
        return {"tls_certificates": _certificates(identity), "validation_context": _validation(identity, allowed_peers)}
    cert_path, trust_path = sds_secret_paths(identity)
    matchers = _validation(identity, allowed_peers)
    del matchers["trusted_ca"]  # comes with the trust bundle secret
    return {"tls_certificate_sds_secret_configs": [_sds_ref(SDS_CERT_SECRET, cert_path)],
            "combined_validation_context": {"default_validation_context": matchers,
                                            "validation_context_sds_secret_config": _sds_ref(SDS_TRUST_SECRET,
                                                                                             trust_path)}}


def downstream_mtls(identity: Identity, allowed_peers: list[str]) -> dict[str, Any]:
    return {
        "name": "envoy.transport_sockets.tls",
        "typed_config": {
            "@type": _ENVOY + "extensions.transport_sockets.tls.v3.DownstreamTlsContext",
            "require_client_certificate": True,
            "common_tls_context": {
                "tls_params": _tls_params(),
                "alpn_protocols": ["h2", "http/1.1"],
                **_tls_identity(identity, allowed_peers),
            },
        },
    }


def upstream_mtls(identity: Identity, allowed_peers: list[str], sni: str = "") -> dict[str, Any]:
    return {
        "name": "envoy.transport_sockets.tls",
        "typed_config": {
            "@type": _ENVOY + "extensions.transport_sockets.tls.v3.UpstreamTlsContext",
            "sni": sni,
            "common_tls_context": {
                "tls_params": _tls_params(),
                "alpn_protocols": ["h2"],
                **_tls_identity(identity, allowed_peers),
            },
        },
    }


def _wasm_http_filter(p: CacheProxy) -> dict[str, Any]:
    static = {"@type": WASM_TYPE_URL,
              **wasm_filter_config(p.wasm_path, p.plugin_config, p.allow_on_headers_stop_iteration)}
    if p.ecds_port is None:
        return {"name": FILTER_NAME, "typed_config": static}
    return ecds_http_filter(_ecds_source(), default_config=static)


def _native_http_filter(p: CacheProxy) -> dict[str, Any]:
    assert p.native_module is not None
    if p.ecds_port is None:
        return native_http_filter(p.native_module, p.plugin_config)
    static = {"@type": DYNAMIC_MODULE_TYPE_URL, **native_filter_config(p.native_module, p.plugin_config)}
    return ecds_http_filter(_ecds_source(), default_config=static, name=NATIVE_FILTER_NAME,
                            type_url=DYNAMIC_MODULE_TYPE_URL)


def _ecds_source() -> dict[str, Any]:
    return {
        "resource_api_version": "V3",
        "api_config_source": {
            "api_type": "GRPC",
            "transport_api_version": "V3",
            "grpc_services": [{"envoy_grpc": {"cluster_name": "xds_cluster"}}],
        },
    }


def _xds_cluster(port: int | list[int], tls: Identity | None, peers: list[str]) -> dict[str, Any]:
    xds = _cluster("xds_cluster", port, http2=True)
    if tls is not None:
        xds["transport_socket"] = upstream_mtls(tls, peers)
    return xds


def _color_suffix(color: str) -> str:
    """A colour as it appears in route and cluster names (Envoy stat names avoid odd characters)."""
    if not color or not all(c.isascii() and (c.isalnum() or c in "-_") for c in color):
        raise ValueError(f"traffic colour {color!r}: use letters, digits, '-' and '_'")
    return color.lower().replace("-", "_")


def _routes(p: CacheProxy) -> list[dict[str, Any]]:
    routes: list[dict[str, Any]] = grpc_hit_routes() if p.with_filter and p.grpc_hit_route else []
    timeout = f"{p.route_timeout_s:g}s"
    for color, upstream in p.color_routes.items():
        header = {"name": COLOR_HEADER, "string_match": {"exact": color}}
        if upstream.grpc_port is not None:
            routes.append({
                "name": f"grpc_{_color_suffix(color)}",
                "match": {"prefix": "/", "grpc": {}, "headers": [header]},
                "route": {"cluster": f"grpc_upstream_{_color_suffix(color)}", "timeout": timeout},
            })
        routes.append({
            "name": f"http_{_color_suffix(color)}",
            "match": {"prefix": "/", "headers": [header]},
            "route": {"cluster": f"http_upstream_{_color_suffix(color)}", "timeout": timeout},
        })
    if p.grpc_upstream_port is not None:
        routes.append({
            "name": "grpc",
            "match": {"prefix": "/", "grpc": {}},
            "route": {"cluster": "grpc_upstream", "timeout": timeout},
        })
    routes.append({
        "name": "http",
        "match": {"prefix": "/"},
        "route": {"cluster": "http_upstream", "timeout": timeout},
    })
    return routes


def _hcm(stat_prefix: str, routes: list[dict[str, Any]], http_filters: list[dict[str, Any]],
         early: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "name": "envoy.filters.network.http_connection_manager",
        "typed_config": {
            "@type": _ENVOY + "extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
            "stat_prefix": stat_prefix,
            "codec_type": "AUTO",
            **({"early_header_mutation_extensions": [early]} if early is not None else {}),
            "route_config": {
                "name": stat_prefix,
                "virtual_hosts": [{"name": stat_prefix, "domains": ["*"], "routes": routes}],
            },
            "http_filters": [*http_filters, {
                "name": "envoy.filters.http.router",
                "typed_config": {"@type": _ENVOY + "extensions.filters.http.router.v3.Router"},
            }],
        },
    }


def render(p: CacheProxy) -> dict[str, Any]:
    """The bootstrap as a dict (dump with yaml.safe_dump)."""
    filters: list[dict[str, Any]] = []
    if p.with_filter and p.native_module is not None:
        filters = [_native_http_filter(p)]
    elif p.with_filter:
        filters = [_wasm_http_filter(p), *([grpc_hit_lua_filter()] if p.grpc_hit_route else [])]
    chain: dict[str, Any] = {"filters": [_hcm("ingress", _routes(p), filters)]}
    if p.downstream_tls is not None:
        chain["transport_socket"] = downstream_mtls(p.downstream_tls, p.allowed_peers)
    listeners: list[dict[str, Any]] = [{
        "name": "ingress",
        "address": _socket(p.address, p.listen_port),
        **_buffer_limit(p.buffer_limit_bytes),
        "filter_chains": [chain],
    }]
    limit = p.buffer_limit_bytes
    clusters = [_cluster("http_upstream", p.http_upstream_port, http2=False, buffer_limit=limit)]
    if p.grpc_upstream_port is not None:
        clusters.append(_cluster("grpc_upstream", p.grpc_upstream_port, http2=True, buffer_limit=limit))
    for color, upstream in p.color_routes.items():
        clusters.append(_cluster(f"http_upstream_{_color_suffix(color)}", upstream.http_port, http2=False,
                                 buffer_limit=limit))
        if upstream.grpc_port is not None:
            clusters.append(_cluster(f"grpc_upstream_{_color_suffix(color)}", upstream.grpc_port, http2=True,
                                     buffer_limit=limit))
    if p.ecds_port is not None:
        clusters.append(_xds_cluster(p.ecds_port, p.xds_tls, p.xds_peers))
    if p.semantic_port is not None:
        clusters.append(_cluster(SEMANTIC_CLUSTER, p.semantic_port, http2=False, buffer_limit=limit))
    bootstrap: dict[str, Any] = {
        "node": {"id": p.node_id, "cluster": p.cluster},
        "admin": {"address": _socket("127.0.0.1", p.admin_port)},
        "static_resources": {"listeners": listeners, "clusters": clusters},
    }
    return bootstrap


LB_POLICIES = ("RING_HASH", "MAGLEV")
RING_SIZE = 4096


@dataclass(frozen=True)
class Affinity:
    """Cache-affinity routing in a client sidecar: the filter in the client role, consistent hashing."""

    wasm_path: Path
    plugin_config: dict[str, Any]  # the client role's (filter_config.client_plugin_config)
    lb_policy: str = "RING_HASH"  # or MAGLEV
    # ECDS from the control plane (resource `meshcache-client`), mTLS as for the server sidecar.
    ecds_port: int | list[int] | None = None
    xds_tls: Identity | None = None
    xds_peers: tuple[str, ...] = ()
    # The client role in the native host (resource `meshcache-native-client`) instead of Wasm.
    native_module: Path | None = None

    def __post_init__(self) -> None:
        if self.lb_policy not in LB_POLICIES:
            raise ValueError(f"lb_policy {self.lb_policy!r}: use one of {', '.join(LB_POLICIES)}")


@dataclass
class ClientSidecar:
    """The app-side proxy of the local mesh: plaintext in from the app, mTLS out to the server sidecars."""

    listen_port: int
    admin_port: int
    server_ports: list[int]  # the server-side sidecars' mTLS listeners, one per engine replica
    identity: Identity  # this sidecar's workload certificate (and the CA it trusts)
    server_identities: list[str]  # SPIFFE IDs the server sidecars may present
    color: str = "inference-2026"
    node_id: str = "meshcache-client-sidecar"
    cluster: str = "meshcache-client"
    address: str = "127.0.0.1"
    # None: no filter here, replicas balanced round robin.
    affinity: Affinity | None = None


def _color_mutation(color: str) -> dict[str, Any]:
    """The sidecar's colour unless the app chose one, before any filter or route reads the request
    (the client-role filter keys on it)."""
    kind = "extensions.http.early_header_mutation.header_mutation.v3.HeaderMutation"
    return {"name": "envoy.http.early_header_mutation.header_mutation",
            "typed_config": {"@type": _ENVOY + kind, "mutations": [
                {"append": {"header": {"key": COLOR_HEADER, "value": color}, "append_action": "ADD_IF_ABSENT"}}]}}


# A replica that stops answering costs no request: a request that could not reach it (connect
# failure, refused stream, reset) is retried on another host (previous_hosts makes the consistent
# hash walk on to the next replica on its ring), and outlier detection takes the dead replica out
# of the ring after a few local failures so its keys move at once instead of failing over one by
# one. Bounded: 2 retries, 5 host picks per retry.
REPLICA_RETRY_ON = "connect-failure,refused-stream,reset"
REPLICA_RETRIES = 2
OUTLIER_LOCAL_FAILURES = 2
OUTLIER_EJECTION_S = 5


def _replica_retry_policy() -> dict[str, Any]:
    return {
        "retry_on": REPLICA_RETRY_ON,
        "num_retries": REPLICA_RETRIES,
        "retry_host_predicate": [{
            "name": "envoy.retry_host_predicates.previous_hosts",
            "typed_config": {"@type": _ENVOY + "extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"},
        }],
        "host_selection_retry_max_attempts": 5,
    }


def _replica_outlier_detection() -> dict[str, Any]:
    """Eject on connection-level failures seen by this sidecar (not on the engine's 5xx answers,
    which stale-if-error and the caller handle)."""
    return {
        "split_external_local_origin_errors": True,
        "consecutive_local_origin_failure": OUTLIER_LOCAL_FAILURES,
        "enforcing_consecutive_local_origin_failure": 100,
        "enforcing_consecutive_5xx": 0,  # answers, even 5xx, never eject: only connect/reset failures
        "enforcing_success_rate": 0,
        "interval": "1s",
        "base_ejection_time": f"{OUTLIER_EJECTION_S}s",
        "max_ejection_percent": 100,
    }


def render_client(c: ClientSidecar) -> dict[str, Any]:
    if not c.server_ports:
        raise ValueError("a client sidecar needs at least one server sidecar port")
    route: dict[str, Any] = {
        "name": "outbound",
        "match": {"prefix": "/"},
        "route": {"cluster": "mesh_upstream", "timeout": "60s", "retry_policy": _replica_retry_policy()},
    }
    filters: list[dict[str, Any]] = []
    a = c.affinity
    if a is not None:
        route["route"]["hash_policy"] = [{"header": {"header_name": ROUTE_KEY_HEADER}}]
        if a.native_module is None:
            static = {"@type": WASM_TYPE_URL, **wasm_filter_config(a.wasm_path, a.plugin_config)}
            name, type_url = CLIENT_FILTER_NAME, WASM_TYPE_URL
        else:
            static = {"@type": DYNAMIC_MODULE_TYPE_URL, **native_filter_config(a.native_module, a.plugin_config)}
            name, type_url = NATIVE_CLIENT_FILTER_NAME, DYNAMIC_MODULE_TYPE_URL
        filters.append({"name": name, "typed_config": static} if a.ecds_port is None
                       else ecds_http_filter(_ecds_source(), default_config=static, name=name, type_url=type_url))
    listener = {
        "name": "outbound",
        "address": _socket(c.address, c.listen_port),
        "per_connection_buffer_limit_bytes": BUFFER_LIMIT_BYTES,
        "filter_chains": [{"filters": [_hcm("outbound", [route], filters, early=_color_mutation(c.color))]}],
    }
    # HTTP/2 upstream: gRPC needs it, and Envoy carries HTTP/1.1 app requests over it as well.
    upstream = _cluster("mesh_upstream", list(c.server_ports), http2=True)
    upstream["transport_socket"] = upstream_mtls(c.identity, c.server_identities)
    upstream["outlier_detection"] = _replica_outlier_detection()
    clusters = [upstream]
    if a is not None:
        upstream["lb_policy"] = a.lb_policy
        if a.lb_policy == "RING_HASH":
            # More points per replica than Envoy's default 1024 in all: shares closer to 1/N.
            upstream["ring_hash_lb_config"] = {"minimum_ring_size": RING_SIZE}
        if a.ecds_port is not None:
            clusters.append(_xds_cluster(a.ecds_port, a.xds_tls, list(a.xds_peers)))
    return {
        "node": {"id": c.node_id, "cluster": c.cluster},
        "admin": {"address": _socket("127.0.0.1", c.admin_port)},
        "static_resources": {"listeners": [listener], "clusters": clusters},
    }


def write(p: CacheProxy | ClientSidecar, path: Path) -> Path:
    """The bootstrap at `path`, and the SDS secret files of an identity served over SDS."""
    doc = render_client(p) if isinstance(p, ClientSidecar) else render(p)
    identity = p.identity if isinstance(p, ClientSidecar) else p.downstream_tls
    if identity is not None and identity.sds_dir is not None:
        write_sds_secrets(identity)
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def examples(out_dir: Path) -> list[Path]:
    """The committed reference configs in envoy/ (fixed ports, module under /etc/meshcache)."""
    demo_config = {
        "version": "1",
        "policies": [{"model_prefix": prefix, **spec} for prefix, spec in sorted(DEMO_POLICIES.items())],
    }
    base = CacheProxy(listen_port=15006, admin_port=15000, http_upstream_port=8000, grpc_upstream_port=8001,
                      plugin_config=demo_config, address="0.0.0.0")
    out = [write(base, out_dir / "cache-proxy.yaml")]
    ecds = CacheProxy(**{**base.__dict__, "ecds_port": 18000})
    out.append(write(ecds, out_dir / "cache-proxy-ecds.yaml"))
    # The same with the native host (the dynamic module), from the control plane's
    # `meshcache-native` ECDS resource.
    native = CacheProxy(**{**ecds.__dict__, "native_module": Path("/etc/meshcache/libmeshcache_native.so")})
    out.append(write(native, out_dir / "cache-proxy-native-ecds.yaml"))
    # The local mesh (`meshcache up`, default ports): server sidecar with strict mTLS and a
    # colour route, and the client sidecar in front of the app.
    certs = Path("/etc/meshcache/certs")
    client_id = "spiffe://cluster.local/ns/default/sa/inference-client"
    server_id = "spiffe://cluster.local/ns/default/sa/inference-server"
    server_identity = Identity(certs / "server-sidecar.crt", certs / "server-sidecar.key", certs / "ca.crt")
    server = CacheProxy(listen_port=15006, admin_port=15100, http_upstream_port=18100, grpc_upstream_port=18101,
                        plugin_config={"version": "default", "policies": []}, ecds_port=18000,
                        node_id="meshcache-server-sidecar", downstream_tls=server_identity,
                        allowed_peers=[client_id], color_routes={"blue": Upstream(18110, 18111)},
                        xds_tls=server_identity,
                        xds_peers=["spiffe://cluster.local/ns/default/sa/meshcache-control-plane"])
    out.append(write(server, out_dir / "mesh-server-sidecar.yaml"))
    client = ClientSidecar(listen_port=15001, admin_port=15000, server_ports=[15006],
                           identity=Identity(certs / "client-sidecar.crt", certs / "client-sidecar.key",
                                             certs / "ca.crt"),
                           server_identities=[server_id])
    out.append(write(client, out_dir / "mesh-client-sidecar.yaml"))
    # `meshcache up --replicas 3`: the client sidecar in front of three server sidecars, the filter
    # in the client role (ECDS resource meshcache-client) and a ring hash on its routing key.
    affinity = Affinity(Path("/etc/meshcache/meshcache_filter.wasm"),
                        client_plugin_config({"version": "default", "policies": []}), ecds_port=18000,
                        xds_tls=client.identity, xds_peers=("spiffe://cluster.local/ns/default/sa/meshcache-control-plane",))
    replicated = ClientSidecar(**{**client.__dict__, "server_ports": [15006, 18200, 18210], "affinity": affinity})
    out.append(write(replicated, out_dir / "mesh-client-sidecar-replicas.yaml"))
    # `meshcache up --replicas 3 --filter native`: the client role in the native host (ECDS
    # resource meshcache-native-client).
    native_affinity = Affinity(**{**affinity.__dict__, "native_module": Path("/etc/meshcache/libmeshcache_native.so")})
    native_client = ClientSidecar(**{**replicated.__dict__, "affinity": native_affinity})
    out.append(write(native_client, out_dir / "mesh-client-sidecar-replicas-native.yaml"))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description="Render the reference Envoy configs into a directory")
    parser.add_argument("out_dir", type=Path)
    args = parser.parse_args()
    for p in examples(args.out_dir):
        print(p)


if __name__ == "__main__":
    main()
