"""What istiod 1.30 gets from meshcache, as Kubernetes objects (camelCase, as `kubectl` and
`json_format.ParseDict` read them): one definition for the control plane's MCP resources and
`meshcache istio render`, so what istiod gets over MCP is what the rendered preview shows.

Two modes for every Istio, and a third for Istio >= 1.31 (istio-1.30-facts.md: what istiod's
source does with each kind; **native**: the full mode's EnvoyFilters with the Envoy dynamic module
instead of the Wasm filter, below):
- **full** (default): one EnvoyFilter per colour. `EXTENSION_CONFIG` ADD carries the exact Wasm
  filter config (`vm_id`, `allow_on_headers_stop_iteration`, code fetched by istio-agent from
  the OCI image pinned by digest), which istiod serves by ECDS over ADS; `HTTP_FILTER` patches put
  the filter (`config_discovery` over ADS, `FAIL_OPEN_DEFAULT` if its first config is refused)
  and, on the gRPC port, the Lua filter
  `meshcache.grpc_hit_body` right after it, just before the router; an `HTTP_ROUTE` patch puts the
  single-pass gRPC-hit route first in the gRPC port's inbound route. gRPC is cached.
- **basic**: one TrafficExtension per colour (what a WasmPlugin turns into inside istiod). istiod
  never sets `vm_id` or `allow_on_headers_stop_iteration`, so the filter runs with
  `"hold_headers": false` and gRPC requests bypass the cache; REST is cached.

Placement, full mode: INSERT_BEFORE `envoy.filters.http.router` (the one filter every inbound HTTP
chain has, always last), i.e. after Istio's authn, RBAC and `istio.stats`: the cache never answers
a request the AuthorizationPolicy denies, principal-scoped entries see the authenticated peer, and
hits are counted by Istio's telemetry (the local reply passes `istio.stats` on its way out).
`spec.priority` 10: patch sets are applied in ascending priority (unset = 0), so filters other
default-priority EnvoyFilters insert before the router end up ahead of ours, and the Lua filter
stays right after the wasm filter. An explicit priority also keeps `istioctl analyze` quiet
(IST0151 warns on INSERT_BEFORE/AFTER without one).

Cache affinity (full mode): one more EnvoyFilter, `meshcache-client`, puts the filter in the
client role (`"role": "client"`, the same policies; ECDS resource `meshcache-client`) on the
callers' outbound HTTP chains to the engine ports (SIDECAR_OUTBOUND, before the router), for pods
labelled `meshcache.io/cache-affinity: "true"` in the namespace (or every namespace when the object
is copied to Istio's root namespace). It sets `x-meshcache-route-key`; the engine's
DestinationRule hashes on it per colour subset (`consistentHash.httpHeaderName`), so identical
requests from every caller reach the replica that holds the answer. The client role needs held
request headers, which only the EnvoyFilter's own Wasm config can ask for: basic mode has no
client filter (a TrafficExtension `match: mode: CLIENT` could not read the body before Envoy picks
the replica), so there requests carry no key and the ring hash spreads them at random.

Placement, basic mode: phase STATS (after authn/authz). Within a phase istiod orders by
descending priority and an unset priority sorts lowest, so `priority: -1000` puts the cache after
every STATS extension that sets a priority (they see hits too); ones without a priority still
sort after it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from meshcache.contract import grpc_hit
from meshcache.contract.filter_config import client_plugin_config
from meshcache.contract.headers import ROUTE_KEY_HEADER
from meshcache.contract.native_filter import DYNAMIC_MODULE_TYPE_URL, native_filter_config
from meshcache.contract.wasm_filter import (
    CLIENT_FILTER_NAME,
    FILTER_NAME,
    ROOT_ID,
    WASM_TYPE_URL,
    code_for,
    ecds_http_filter,
    extension_config,
)

Obj = dict[str, Any]
MODES = ("full", "basic", "native")
ENGINE_APP = "meshcache-engine"
HTTP_PORT, GRPC_PORT = 8000, 8001  # the engine's REST and gRPC container ports; never metrics
ENGINE_PORTS = (HTTP_PORT, GRPC_PORT)
CLIENT_OBJECT = "meshcache-client"
# Callers that route to the engine by cache affinity (the client-role filter) carry this pod label.
AFFINITY_LABEL = "meshcache.io/cache-affinity"
RING_SIZE = 4096  # DestinationRule ringHash.minimumRingSize: shares closer to 1/N than the default 1024
ENVOY_FILTER_PRIORITY = 10
TRAFFIC_EXTENSION_PHASE = "STATS"
TRAFFIC_EXTENSION_PRIORITY = -1000
FAIL_STRATEGY = "FAIL_OPEN"  # a module that cannot load must not stop inference
DIGEST_RE = re.compile(r"^[a-f0-9]{64}$")
HCM = "envoy.filters.network.http_connection_manager"
ROUTER = "envoy.filters.http.router"
# istio-agent replaces a Wasm filter whose module it cannot fetch by an allow-all RBAC filter
# (FAIL_OPEN), so the ECDS resource may also be that type.
RBAC_TYPE_URL = "type.googleapis.com/envoy.extensions.filters.http.rbac.v3.RBAC"
# As istiod configures ECDS for its own extensions: over ADS, and the listener waits for it.
ADS_CONFIG_SOURCE = {"ads": {}, "resource_api_version": "V3", "initial_fetch_timeout": "0s"}
# The fail-open default of every filter taken from istiod (either host, either role): an RBAC
# filter without rules enforces nothing, what istio-agent hands Envoy for a FAIL_OPEN Wasm filter
# it cannot fetch. It covers a sidecar whose first config is refused (a config the filter rejects,
# a module Envoy cannot load, e.g. a native one built for another Envoy): without it Envoy
# leaves the listener serving with a filter that has no config, a 500 for every request; with it
# that sidecar serves uncached. The listener still waits for the first answer (`warm`, as
# istiod's own extensions do), so a healthy new sidecar is Ready only with the cache in place
# (docs/istio.md, "A sidecar whose first config is refused").
FAIL_OPEN_DEFAULT: Obj = {"@type": RBAC_TYPE_URL}


def _istiod_ecds_filter(name: str = FILTER_NAME, type_url: str = WASM_TYPE_URL) -> Obj:
    """The `HTTP_FILTER` patch value: the filter by ECDS over ADS, the fail-open default, warming."""
    return ecds_http_filter(ADS_CONFIG_SOURCE, FAIL_OPEN_DEFAULT, extra_type_urls=(RBAC_TYPE_URL,), name=name,
                            type_url=type_url, warm=True)


def oci_url(repository: str, digest: str) -> str:
    """`oci://REPO@sha256:DIGEST`: pinned by digest, so `IfNotPresent` can never serve stale code."""
    return f"oci://{repository.removeprefix('oci://')}@sha256:{digest}"


def object_name(color: str) -> str:
    return f"meshcache-{color}" if color else "meshcache"


DEFAULT_SELECTOR: Mapping[str, str] = {"app": ENGINE_APP}
# Kubernetes label syntax: an optional DNS-subdomain prefix and `/`, a name of at most 63; values
# at most 63 (apimachinery validation.IsQualifiedName / IsValidLabelValue).
_LABEL_NAME = r"([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)"
LABEL_KEY_RE = re.compile(rf"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?{_LABEL_NAME}$")
LABEL_VALUE_RE = re.compile(rf"^{_LABEL_NAME}?$")


@dataclass(frozen=True)
class Workloads:
    """The pods whose sidecars cache (a label selector, the colour label added per colour) and
    the ports the filter attaches to: their REST and gRPC container ports (inbound listeners are
    per container port) and the Service ports callers send to (outbound listeners are per Service
    port; the client role attaches there). meshcache's own engine by default; a KServe or Triton
    workload with its own labels and ports otherwise."""

    labels: Mapping[str, str] = field(default_factory=lambda: dict(DEFAULT_SELECTOR))
    http_ports: tuple[int, ...] = (HTTP_PORT,)
    grpc_ports: tuple[int, ...] = (GRPC_PORT,)
    service_ports: tuple[int, ...] = ENGINE_PORTS

    def __post_init__(self) -> None:
        if not self.labels:
            raise ValueError("the workload selector needs at least one label")
        for k, v in self.labels.items():
            if len(k) > 317 or not LABEL_KEY_RE.match(k):
                raise ValueError(f"selector label key {k!r} is not a Kubernetes label key")
            if not LABEL_VALUE_RE.match(v):
                raise ValueError(f"selector label {k}={v!r}: not a Kubernetes label value (63 characters of "
                                 "[A-Za-z0-9-_.], alphanumeric at both ends)")
        ports = [*self.http_ports, *self.grpc_ports]
        if not ports:
            raise ValueError("the filter needs at least one REST or gRPC port")
        for p in (*ports, *self.service_ports):
            if not 1 <= p <= 65535:
                raise ValueError(f"port {p} is not in 1..65535")
        if len(set(ports)) != len(ports):
            raise ValueError(f"a port is listed twice (REST {list(self.http_ports)}, gRPC {list(self.grpc_ports)})")

    def selector(self, color: str) -> dict[str, str]:
        return {**self.labels, "color": color} if color else dict(self.labels)

    @property
    def ports(self) -> tuple[int, ...]:
        return (*self.http_ports, *self.grpc_ports)


def parse_selector(text: str) -> dict[str, str]:
    """`key=value,key=value` (an empty string: meshcache's own engine)."""
    out: dict[str, str] = {}
    for item in (i.strip() for i in text.split(",")):
        if not item:
            continue
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"selector entry {item!r} is not KEY=VALUE")
        out[key.strip()] = value.strip()
    return out or dict(DEFAULT_SELECTOR)


def format_selector(labels: Mapping[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in labels.items())


def parse_ports(text: str) -> tuple[int, ...]:
    """`8000` or `8000,8080`; empty: none."""
    try:
        return tuple(int(p) for p in (i.strip() for i in text.split(",")) if p)
    except ValueError:
        raise ValueError(f"ports {text!r} must be comma-separated numbers") from None


def selector(color: str, workloads: Workloads | None = None) -> dict[str, str]:
    return (workloads or Workloads()).selector(color)


def _check_pin(sha256: str) -> None:
    if not DIGEST_RE.match(sha256):
        raise ValueError(f"sha256 must be 64 lowercase hex characters, got {sha256!r}")


# ---- full mode: the EnvoyFilter ---------------------------------------------------------------


def _inbound_http_filter(port: int, value: Obj) -> Obj:
    listener = {"portNumber": port, "filterChain": {"filter": {"name": HCM, "subFilter": {"name": ROUTER}}}}
    return {"applyTo": "HTTP_FILTER", "match": {"context": "SIDECAR_INBOUND", "listener": listener},
            "patch": {"operation": "INSERT_BEFORE", "value": value}}


def _envoy_filter_object(name: str, labels: Mapping[str, str], patches: list[Obj]) -> Obj:
    """An EnvoyFilter of ours (no namespace: MCP names it `<ns>/<name>`, kustomize sets it)."""
    return {
        "apiVersion": "networking.istio.io/v1alpha3",
        "kind": "EnvoyFilter",
        "metadata": {"name": name},
        "spec": {"workloadSelector": {"labels": dict(labels)}, "configPatches": patches,
                 "priority": ENVOY_FILTER_PRIORITY},
    }


def envoy_filter(*, color: str, url: str, sha256: str, plugin_config: Obj,
                 workloads: Workloads | None = None) -> Obj:
    """The full mode's EnvoyFilter (no namespace: MCP names it `<ns>/<name>`, kustomize sets it)."""
    _check_pin(sha256)
    w = workloads or Workloads()
    http_ports, grpc_ports = w.http_ports, w.grpc_ports
    config = {**plugin_config, "color": color}
    ecds = extension_config(code_for(url, sha256), config)
    cache_filter = _istiod_ecds_filter()
    patches: list[Obj] = [{"applyTo": "EXTENSION_CONFIG", "patch": {"operation": "ADD", "value": ecds}}]
    for port in http_ports:
        patches.append(_inbound_http_filter(port, cache_filter))
    for port in grpc_ports:
        # Two INSERT_BEFORE router patches in this order: [..., meshcache, grpc_hit_body, router].
        patches.append(_inbound_http_filter(port, cache_filter))
        patches.append(_inbound_http_filter(port, grpc_hit.grpc_hit_lua_filter()))
        # Each INSERT_FIRST goes on top: insert in reverse to keep grpc_hit_routes()' order.
        for route in reversed(grpc_hit.grpc_hit_routes()):
            patches.append({"applyTo": "HTTP_ROUTE",
                            "match": {"context": "SIDECAR_INBOUND", "routeConfiguration": {"portNumber": port}},
                            "patch": {"operation": "INSERT_FIRST", "value": route}})
    return _envoy_filter_object(object_name(color), w.selector(color), patches)


def _client_object(ecds: Obj, client_filter: Obj, ports: Iterable[int]) -> Obj:
    """The client-role EnvoyFilter (either host): the ECDS config, and the filter before the
    router of each cached Service port's outbound listener on the callers labelled for affinity."""
    patches: list[Obj] = [{"applyTo": "EXTENSION_CONFIG", "patch": {"operation": "ADD", "value": ecds}}]
    for port in ports:
        listener = {"portNumber": port, "filterChain": {"filter": {"name": HCM, "subFilter": {"name": ROUTER}}}}
        patches.append({"applyTo": "HTTP_FILTER", "match": {"context": "SIDECAR_OUTBOUND", "listener": listener},
                        "patch": {"operation": "INSERT_BEFORE", "value": client_filter}})
    return _envoy_filter_object(CLIENT_OBJECT, {AFFINITY_LABEL: "true"}, patches)


def client_envoy_filter(*, url: str, sha256: str, plugin_config: Obj, ports: Iterable[int] = ENGINE_PORTS) -> Obj:
    """The full mode's client-role EnvoyFilter (cache affinity, see the module docstring). `ports`:
    the cached workloads' Service ports (a caller's outbound listener is per Service port)."""
    _check_pin(sha256)
    ecds = extension_config(code_for(url, sha256), client_plugin_config(plugin_config), name=CLIENT_FILTER_NAME)
    client_filter = _istiod_ecds_filter(CLIENT_FILTER_NAME)
    return _client_object(ecds, client_filter, ports)


def consistent_hash() -> Obj:
    """A DestinationRule subset's load balancer: hash on the client role's routing key."""
    return {"consistentHash": {"httpHeaderName": ROUTE_KEY_HEADER, "ringHash": {"minimumRingSize": RING_SIZE}}}


# ---- basic mode: the TrafficExtension -------------------------------------------------------


def traffic_extension(*, color: str, url: str, sha256: str, plugin_config: Obj,
                      workloads: Workloads | None = None, pull_secret: str = "") -> Obj:
    _check_pin(sha256)
    w = workloads or Workloads()
    wasm: Obj = {
        "url": url,
        "sha256": sha256,
        "imagePullPolicy": "IfNotPresent",
        "pluginName": ROOT_ID,
        "failStrategy": FAIL_STRATEGY,
        "type": "HTTP",
        # istiod cannot set allow_on_headers_stop_iteration: without this the filter would hold
        # the headers of every request with a body forever (docs/filter.md, "hold_headers").
        "pluginConfig": {**plugin_config, "color": color, "hold_headers": False},
    }
    if pull_secret:
        wasm["imagePullSecret"] = pull_secret
    return {
        "apiVersion": "extensions.istio.io/v1alpha1",
        "kind": "TrafficExtension",
        "metadata": {"name": object_name(color)},
        "spec": {
            "selector": {"matchLabels": w.selector(color)},
            "phase": TRAFFIC_EXTENSION_PHASE,
            "priority": TRAFFIC_EXTENSION_PRIORITY,
            "match": [{"mode": "SERVER", "ports": [{"number": p} for p in w.ports]}],
            "wasm": wasm,
        },
    }


# ---- native mode: the EnvoyFilter for the dynamic module (Istio >= 1.31) ----------------------
# The full mode's EnvoyFilters with `envoy.filters.http.dynamic_modules` (the native host,
# filter/native/) in place of the Wasm filter: the same ECDS names (`meshcache`,
# `meshcache-client`), the same position (INSERT_BEFORE the router, after authn/RBAC/istio.stats),
# the same plugin configuration JSON. No Lua filter and no hit route on the gRPC ports: the module
# sends a gRPC hit's headers, message and trailers itself (filter/native/DESIGN.md, "Hit"). The
# module is a file on the sidecar's filesystem (`module_path`, docs/istio.md "The native host
# under Istio 1.31"); no istio-agent fetch applies to it (the agent only converts Wasm configs).

NATIVE_MODULE_DIR = "/var/lib/meshcache/modules"  # where the sidecar sees the module (render mounts it)


def native_extension_config(module_path: str, plugin_config: Obj, name: str = FILTER_NAME) -> Obj:
    if not module_path.startswith("/"):
        raise ValueError(f"the native module path must be absolute (a file in the sidecar), got {module_path!r}")
    return {"name": name, "typed_config": {"@type": DYNAMIC_MODULE_TYPE_URL,
                                           **native_filter_config(module_path, plugin_config)}}


def native_envoy_filter(*, color: str, module_path: str, plugin_config: Obj,
                        workloads: Workloads | None = None) -> Obj:
    w = workloads or Workloads()
    ecds = native_extension_config(module_path, {**plugin_config, "color": color})
    cache_filter = _istiod_ecds_filter(type_url=DYNAMIC_MODULE_TYPE_URL)
    patches: list[Obj] = [{"applyTo": "EXTENSION_CONFIG", "patch": {"operation": "ADD", "value": ecds}}]
    patches += [_inbound_http_filter(port, cache_filter) for port in w.ports]
    return _envoy_filter_object(object_name(color), w.selector(color), patches)


def native_client_envoy_filter(*, module_path: str, plugin_config: Obj, ports: Iterable[int] = ENGINE_PORTS) -> Obj:
    """The client role in the native host; the callers' sidecars need the module too."""
    ecds = native_extension_config(module_path, client_plugin_config(plugin_config), name=CLIENT_FILTER_NAME)
    client_filter = _istiod_ecds_filter(CLIENT_FILTER_NAME, DYNAMIC_MODULE_TYPE_URL)
    return _client_object(ecds, client_filter, ports)


# ---- as Kubernetes objects (`--delivery kube`: the control plane writes them to the API server) --

FIELD_MANAGER = "meshcache-control-plane"  # server-side apply's field manager
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY = {MANAGED_BY_LABEL: FIELD_MANAGER}  # what the writer lists and prunes by
SNAPSHOT_ANNOTATION = "meshcache.io/snapshot-version"
REVISION_LABEL = "istio.io/rev"
MODE_KIND = {"full": "EnvoyFilter", "basic": "TrafficExtension", "native": "EnvoyFilter"}


@dataclass(frozen=True)
class KubeResource:
    """Where the API server keeps one kind: `/apis/<group>/<version>/namespaces/<ns>/<plural>`."""

    group: str
    version: str
    plural: str

    def path(self, namespace: str, name: str = "") -> str:
        base = f"/apis/{self.group}/{self.version}/namespaces/{namespace}/{self.plural}"
        return f"{base}/{name}" if name else base


KUBE_RESOURCES = {
    "EnvoyFilter": KubeResource("networking.istio.io", "v1alpha3", "envoyfilters"),
    "TrafficExtension": KubeResource("extensions.istio.io", "v1alpha1", "trafficextensions"),
}
# What the writer does with its kind, so all the Role grants (no watch: it re-lists on a timer;
# no update: server-side apply is a PATCH, and creating through it needs create).
WRITER_VERBS = ("get", "list", "create", "patch", "delete")
# The Role that lets the control plane write its kind (render and the chart make it, in the
# control plane's namespace, with delivery kube). It is also the owner of every object written
# (`ownerReferences`): Kubernetes' garbage collector deletes them when the Role is deleted
# (`helm uninstall`, `kubectl delete -f` of the rendered manifests), and nothing else does; a
# control-plane restart, crash or rollout leaves the Role, so the objects stay. Its name is part
# of the contract: renaming it would delete the objects of every existing install.
WRITER_ROLE = "meshcache-control-plane-istio-objects"
RBAC_GROUP = "rbac.authorization.k8s.io"
# The writer's second rule: read its own Role (for the owner's uid), that Role only.
WRITER_OWNER_RULE: Obj = {"apiGroups": [RBAC_GROUP], "resources": ["roles"], "resourceNames": [WRITER_ROLE],
                          "verbs": ["get"]}


def role_path(namespace: str, name: str = WRITER_ROLE) -> str:
    return f"/apis/{RBAC_GROUP}/v1/namespaces/{namespace}/roles/{name}"


def owner_reference(role: Obj) -> Obj:
    """A namespaced object may only be owned by one of its own namespace (the writer's Role is)."""
    return {"apiVersion": f"{RBAC_GROUP}/v1", "kind": "Role", "name": role["metadata"]["name"],
            "uid": role["metadata"]["uid"]}


def kube_object(obj: Obj, *, namespace: str, version: int, revision: str = "", owner: Obj | None = None) -> Obj:
    """`obj` as the control plane writes it: namespaced, labelled as meshcache's (the writer
    prunes only objects with this label that its field manager owns), stamped with the snapshot
    version (a replica never overwrites a newer one) and, given the writer's Role (`owner`),
    owned by it (removed with it)."""
    labels = dict(MANAGED_BY)
    if revision:
        labels[REVISION_LABEL] = revision
    meta = {**obj["metadata"], "namespace": namespace, "labels": {**obj["metadata"].get("labels", {}), **labels},
            "annotations": {**obj["metadata"].get("annotations", {}), SNAPSHOT_ANNOTATION: str(version)}}
    if owner is not None:
        meta["ownerReferences"] = [owner_reference(owner)]
    return {**obj, "metadata": meta}


def objects(mode: str, *, colors: Iterable[str], url: str, sha256: str, plugin_config: Obj,
            workloads: Workloads | None = None, native_module: str = "") -> list[Obj]:
    """Everything meshcache gives istiod for one policy snapshot, full state. `native_module`:
    the module's path in the sidecars (native mode only; `url`/`sha256` are the Wasm pins)."""
    if mode not in MODES:
        raise ValueError(f"Istio mode {mode!r}: use one of {', '.join(MODES)}")
    w = workloads or Workloads()
    if mode == "native":
        out = [native_envoy_filter(color=c, module_path=native_module, plugin_config=plugin_config, workloads=w)
               for c in colors]
        return [*out, native_client_envoy_filter(module_path=native_module, plugin_config=plugin_config,
                                                 ports=w.service_ports)]
    build = envoy_filter if mode == "full" else traffic_extension
    out = [build(color=c, url=url, sha256=sha256, plugin_config=plugin_config, workloads=w) for c in colors]
    if mode == "full":
        out.append(client_envoy_filter(url=url, sha256=sha256, plugin_config=plugin_config, ports=w.service_ports))
    return out

