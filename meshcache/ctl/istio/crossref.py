"""Cross-reference checks over a set of manifests: what schemas cannot see but a broken rollout
would (a subset nobody matches, a policy selecting no pod, a digest that is not the module's).

Each check returns human-readable errors; `check_all` runs them all, `check_operator_steps` checks
the two IstioOperator install steps. The image digest is the built module's (render.Pins).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import yaml

from meshcache.contract import extensions, grpc_hit
from meshcache.contract.filter_config import ROLE, ROLE_CLIENT
from meshcache.contract.headers import ROUTE_KEY_HEADER
from meshcache.contract.native_filter import DYNAMIC_MODULE_TYPE_URL
from meshcache.contract.wasm_filter import CLIENT_FILTER_NAME, FILTER_NAME, ROOT_ID

Obj = dict[str, Any]
WORKLOAD_KINDS = ("Deployment", "StatefulSet")
# Istio's principal form: the SPIFFE id without `spiffe://` (any trust domain, cluster.local by default).
PRINCIPAL_RE = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/ns/([a-z0-9-]+)/sa/([a-z0-9][-a-z0-9.]*)$")
# Secrets the operator creates (docs/istio.md); everything else must be in the manifests.
EXTERNAL_SECRETS = {"meshcache-cp-tokens", "meshcache-redis-url", "meshcache-cp-xds-tls"}
CONTROL_PLANE = "meshcache-control-plane"
# AuthorizationPolicy annotation: principals added by `render --allow-principal` (space-separated).
EXTERNAL_PRINCIPALS = "meshcache.io/allowed-principals"
DEFAULT_ACCOUNT = "default"  # every namespace has it
XDS_PORT = 18000


def _name(o: Obj) -> str:
    return str(o["metadata"]["name"])


def _of(objects: list[Obj], kind: str) -> list[Obj]:
    return [o for o in objects if o["kind"] == kind]


def _workloads(objects: list[Obj]) -> list[Obj]:
    return [o for o in objects if o["kind"] in WORKLOAD_KINDS]


def _pod_labels(w: Obj) -> dict[str, str]:
    return dict(w["spec"]["template"]["metadata"].get("labels", {}))


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _selected(objects: list[Obj], selector: dict[str, str]) -> list[Obj]:
    return [w for w in _workloads(objects) if _selects(selector, _pod_labels(w))]


def _container_ports(w: Obj) -> set[int]:
    return {p["containerPort"] for c in w["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])}


def _walk(node: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(node, dict):
        for k, v in node.items():
            yield k, v
            yield from _walk(v)
    elif isinstance(node, list):
        for v in node:
            yield from _walk(v)


def _accounts(objects: list[Obj]) -> set[str]:
    """ServiceAccounts known to exist: those defined here, and `default`, which Kubernetes
    creates in every namespace."""
    return {_name(o) for o in _of(objects, "ServiceAccount")} | {DEFAULT_ACCOUNT}


def check_workloads(objects: list[Obj]) -> list[str]:
    errors = []
    accounts = _accounts(objects)
    secrets = {_name(o) for o in _of(objects, "Secret")} | EXTERNAL_SECRETS
    for w in _workloads(objects):
        where = f"{w['kind']}/{_name(w)}"
        if not _selects(w["spec"]["selector"]["matchLabels"], _pod_labels(w)):
            errors.append(f"{where}: selector does not match its own pod template labels")
        sa = w["spec"]["template"]["spec"].get("serviceAccountName")
        if sa and sa not in accounts:
            errors.append(f"{where}: serviceAccountName {sa!r} is not defined")
        for key, value in _walk(w["spec"]["template"]["spec"]):
            if key in ("secretName",) or (key == "secretKeyRef" and isinstance(value, dict)):
                ref = value if isinstance(value, str) else value.get("name")
                if ref not in secrets:
                    errors.append(f"{where}: Secret {ref!r} is neither defined nor a documented external one")
    for svc in _of(objects, "Service"):
        selected = _selected(objects, svc["spec"].get("selector", {}))
        if not selected:
            errors.append(f"Service/{_name(svc)}: selector matches no workload")
        for port in svc["spec"].get("ports", []):
            target = port.get("targetPort")
            named = {p.get("name") for w in selected for c in w["spec"]["template"]["spec"]["containers"]
                     for p in c.get("ports", [])}
            if isinstance(target, str) and target not in named:
                errors.append(f"Service/{_name(svc)}: targetPort {target!r} is no container port name")
    return errors


def _service_for_host(objects: list[Obj], host: str) -> Obj | None:
    short = host.split(".")[0]
    return next((s for s in _of(objects, "Service") if _name(s) == short), None)


def check_traffic(objects: list[Obj], elsewhere: frozenset[str] = frozenset()) -> list[str]:
    """`elsewhere`: subsets whose workloads are deployed by another render (live colours)."""
    errors = []
    subsets: dict[str, set[str]] = {}
    for dr in _of(objects, "DestinationRule"):
        host = dr["spec"]["host"]
        svc = _service_for_host(objects, host)
        if svc is None:
            errors.append(f"DestinationRule/{_name(dr)}: host {host!r} is no Service here")
            continue
        subsets[host.split(".")[0]] = set()
        for s in dr["spec"].get("subsets", []):
            subsets[host.split(".")[0]].add(s["name"])
            labels = {**svc["spec"]["selector"], **s.get("labels", {})}
            if s["name"] not in elsewhere and not _selected(objects, labels):
                errors.append(f"DestinationRule/{_name(dr)}: subset {s['name']!r} selects no workload")
    gateways = {_name(g): g for g in _of(objects, "Gateway")}
    for vs in _of(objects, "VirtualService"):
        bound = [g for g in vs["spec"].get("gateways", []) if g != "mesh"]
        for g in bound:
            if g not in gateways:
                errors.append(f"VirtualService/{_name(vs)}: gateway {g!r} is no Gateway here")
                continue
            served = {h for server in gateways[g]["spec"]["servers"] for h in server["hosts"]}
            errors += [f"VirtualService/{_name(vs)}: host {h!r} is not served by Gateway {g!r}"
                       for h in vs["spec"]["hosts"] if h not in served and "*" not in served]
        for host in vs["spec"]["hosts"]:
            if not bound and _service_for_host(objects, host) is None:
                errors.append(f"VirtualService/{_name(vs)}: host {host!r} is no Service here")
        for route in vs["spec"].get("http", []):
            for r in route.get("route", []):
                d = r["destination"]
                short = d["host"].split(".")[0]
                if "subset" in d and d["subset"] not in subsets.get(short, set()):
                    errors.append(f"VirtualService/{_name(vs)}: route {route.get('name')!r} uses subset "
                                  f"{d['subset']!r} that no DestinationRule for {short!r} defines")
                svc = _service_for_host(objects, d["host"])
                if bound and svc is not None and len(svc["spec"].get("ports", [])) > 1 and "port" not in d:
                    errors.append(f"VirtualService/{_name(vs)}: route {route.get('name')!r} needs a destination "
                                  "port (a gateway's port is no port of a multi-port Service)")
                if "port" in d and svc is not None and d["port"]["number"] not in {
                        p["port"] for p in svc["spec"].get("ports", [])}:
                    errors.append(f"VirtualService/{_name(vs)}: route {route.get('name')!r} port "
                                  f"{d['port']['number']} is no port of Service {short!r}")
    return errors


def check_security(objects: list[Obj], allowed_principals: frozenset[str] = frozenset()) -> list[str]:
    """`allowed_principals`: callers whose accounts live elsewhere (`validate --allow-principal`),
    like those `render --allow-principal` records in the policy's annotation."""
    errors = []
    # Namespaces whose accounts these manifests define; a mesh-wide PeerAuthentication given with
    # `validate --workload` (istio-system) does not make the gateway's account one to define here.
    namespaces = {o["metadata"].get("namespace") for o in objects if o["kind"] != "PeerAuthentication"} - {None}
    # The accounts the workloads given here run as exist too (the user's, with --workload).
    accounts = _accounts(objects) | {w["spec"]["template"]["spec"].get("serviceAccountName", DEFAULT_ACCOUNT)
                                     for w in _workloads(objects)}
    for pol in _of(objects, "AuthorizationPolicy") + _of(objects, "PeerAuthentication"):
        where = f"{pol['kind']}/{_name(pol)}"
        sel = pol["spec"].get("selector", {}).get("matchLabels")
        selected = _selected(objects, sel) if sel else _workloads(objects)
        if sel and not selected:
            errors.append(f"{where}: selector matches no workload")
        ports = set().union(*(_container_ports(w) for w in selected)) if selected else set()
        for key in pol["spec"].get("portLevelMtls", {}):
            if int(key) not in ports:
                errors.append(f"{where}: portLevelMtls port {key} is no container port of the selected pods")
        external = set((pol["metadata"].get("annotations") or {}).get(EXTERNAL_PRINCIPALS, "").split())
        external |= allowed_principals
        for rule in pol["spec"].get("rules", []):
            for to in rule.get("to", []):
                for p in to["operation"].get("ports", []):
                    if int(p) not in ports:
                        errors.append(f"{where}: port {p} is no container port of the selected pods")
            for src in rule.get("from", []):
                for principal in src["source"].get("principals", []):
                    m = PRINCIPAL_RE.match(principal)
                    if not m:
                        errors.append(f"{where}: principal {principal!r} is not cluster.local/ns/<ns>/sa/<sa> "
                                      "(or another trust domain's; no spiffe://)")
                    # Identities of this namespace must exist here, except the callers' own that
                    # `render --allow-principal` listed in the annotation (their accounts are theirs).
                    elif m.group(2) in namespaces and m.group(3) not in accounts and principal not in external:
                        errors.append(f"{where}: principal {principal!r} names no ServiceAccount defined here")
    for np in _of(objects, "NetworkPolicy"):
        if not _selected(objects, np["spec"]["podSelector"].get("matchLabels", {})):
            errors.append(f"NetworkPolicy/{_name(np)}: podSelector matches no workload")
    return errors


def injected(w: Obj) -> bool:
    """Whether Istio injects a sidecar (the namespace is labelled for injection; the pod label
    `sidecar.istio.io/inject: "false"` opts out, and also keeps the pod away from the webhook)."""
    return _pod_labels(w).get("sidecar.istio.io/inject") != "false"


def _annotation_volumes(w: Obj) -> tuple[Obj, Obj]:
    ann = w["spec"]["template"]["metadata"].get("annotations", {})
    return (json.loads(ann.get("sidecar.istio.io/userVolume", "{}")),
            json.loads(ann.get("sidecar.istio.io/userVolumeMount", "{}")))


def check_sidecar_annotations(objects: list[Obj]) -> list[str]:
    """Annotations are opaque strings to the API server but must parse for the injector: Istio's
    injection template reads userVolume(Mount) as JSON objects keyed by volume name."""
    errors = []
    for w in _workloads(objects):
        where = f"{w['kind']}/{_name(w)}"
        labels = _pod_labels(w)
        ann = w["spec"]["template"]["metadata"].get("annotations", {})
        if "proxy.istio.io/config" in ann:
            proxy = yaml.safe_load(ann["proxy.istio.io/config"])
            meta = proxy.get("proxyMetadata", {})
            if "color" in labels and meta.get("MESHCACHE_TRAFFIC_COLOR") != labels["color"]:
                errors.append(f"{where}: proxyMetadata colour {meta.get('MESHCACHE_TRAFFIC_COLOR')!r} "
                              f"!= pod label color {labels['color']!r}")
        try:
            volumes, mounts = _annotation_volumes(w)
        except json.JSONDecodeError as exc:
            errors.append(f"{where}: sidecar.istio.io/userVolume(Mount) is not JSON: {exc}")
            continue
        if not isinstance(volumes, dict) or not isinstance(mounts, dict):
            errors.append(f"{where}: sidecar.istio.io/userVolume(Mount) must be JSON objects keyed by volume "
                          "name (Istio's injection template), not arrays")
            continue
        if volumes or mounts:
            pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "injected"}, "spec": {
                "volumes": [{"name": k, **v} for k, v in volumes.items()],
                "containers": [{"name": "istio-proxy", "image": "proxyv2",
                                "volumeMounts": [{"name": k, **v} for k, v in mounts.items()]}]}}
            # Imported here: validate loads jsonschema and the Kubernetes schemas, and every
            # `meshcache` run imports this module (through render and monitoring).
            from .validate import validate_object

            errors += [f"{where}: sidecar.istio.io/userVolume(Mount): {e}" for e in validate_object(pod)]
            pod_volumes = {v["name"] for v in w["spec"]["template"]["spec"].get("volumes", [])}
            if set(mounts) - set(volumes) - pod_volumes:
                errors.append(f"{where}: userVolumeMount names a volume that is not defined")
    return errors


def _env(w: Obj) -> dict[str, str]:
    return {e["name"]: e.get("value") for c in w["spec"]["template"]["spec"]["containers"] for e in c.get("env", [])}


def _control_planes(objects: list[Obj]) -> list[Obj]:
    return [w for w in _workloads(objects) if _pod_labels(w).get("app") == CONTROL_PLANE]


def check_module(objects: list[Obj], image_digest: str) -> list[str]:
    """The control plane (and anything it serves istiod) pins the built module's image."""
    errors = []
    for w in _control_planes(objects):
        env, where = _env(w), f"{w['kind']}/{_name(w)}"
        if env.get("MESHCACHE_CP_ISTIO_WASM_SHA256") != image_digest:
            errors.append(f"{where}: MESHCACHE_CP_ISTIO_WASM_SHA256 is not the built module's image digest "
                          f"{image_digest} (run `meshcache istio render --update-base` after a filter build)")
        url = env.get("MESHCACHE_CP_ISTIO_WASM_URL") or ""
        if not url.startswith("oci://") or not url.endswith(f"@sha256:{image_digest}"):
            errors.append(f"{where}: MESHCACHE_CP_ISTIO_WASM_URL {url!r} is not oci:// pinned to "
                          f"@sha256:{image_digest}")
    for o in objects:
        pins = [v for k, v in _walk(o.get("spec", {})) if k == "sha256"]
        if o["kind"] in ("TrafficExtension", "EnvoyFilter", "WasmPlugin") and any(p != image_digest for p in pins):
            errors.append(f"{o['kind']}/{_name(o)}: sha256 is not the built module's image digest {image_digest}")
    return errors


def _selected_ports(objects: list[Obj], sel: dict[str, str], where: str, errors: list[str]) -> set[int]:
    selected = _selected(objects, sel)
    if not selected:
        errors.append(f"{where}: selector matches no workload")
    elif not all(injected(w) for w in selected):
        errors.append(f"{where}: selects pods without a sidecar")
    return set().union(*(_container_ports(w) for w in selected)) if selected else set()


def check_extensions(objects: list[Obj], elsewhere: frozenset[str] = frozenset()) -> list[str]:
    """TrafficExtensions and EnvoyFilters (the MCP preview, or applied by hand): they select meshed
    pods and their ports, keep `istioctl analyze` quiet, and the full mode's pieces fit together.
    `elsewhere`: colours whose pods another render deployed (their objects are not checked)."""
    errors = []
    for te in _of(objects, "TrafficExtension"):
        if te["spec"].get("selector", {}).get("matchLabels", {}).get("color") in elsewhere:
            continue
        where = f"TrafficExtension/{_name(te)}"
        spec = te["spec"]
        ports = _selected_ports(objects, spec.get("selector", {}).get("matchLabels", {}), where, errors)
        for m in spec.get("match", []):
            errors += [f"{where}: match port {p['number']} is no container port of the selected pods"
                       for p in m.get("ports", []) if p["number"] not in ports]
        if spec["wasm"].get("pluginName") != ROOT_ID:
            errors.append(f"{where}: pluginName must be the filter's root id {ROOT_ID!r}")
        if spec["wasm"].get("pluginConfig", {}).get("hold_headers") is not False:
            errors.append(f"{where}: istiod cannot set allow_on_headers_stop_iteration: pluginConfig.hold_headers "
                          "must be false")
    for ef in _of(objects, "EnvoyFilter"):
        if _is_client_filter(ef):
            errors += _client_filter_errors(objects, ef)
        elif ef["spec"].get("workloadSelector", {}).get("labels", {}).get("color") not in elsewhere:
            errors += _envoy_filter_errors(objects, ef)
    return errors


def engine_host(objects: list[Obj]) -> str:
    """The Service callers use to reach the cached workloads: the host of the DestinationRule
    `meshcache-engine` (meshcache's own engine, or the user's Service in overlays kserve, triton)."""
    dr = next((d for d in _of(objects, "DestinationRule") if _name(d) == "meshcache-engine"), None)
    return str(dr["spec"]["host"]).split(".")[0] if dr is not None else extensions.ENGINE_APP


def _is_client_filter(ef: Obj) -> bool:
    return any(p.get("match", {}).get("context") == "SIDECAR_OUTBOUND" for p in ef["spec"]["configPatches"])


def _client_filter_errors(objects: list[Obj], ef: Obj) -> list[str]:
    """The client role on callers' outbound chains: callers are the users' pods (not in these
    manifests), so what is checked is that it reaches the engine's ports, runs the client role with
    held headers, and that the engine's DestinationRule hashes on the key it sets."""
    where, spec, errors = f"EnvoyFilter/{_name(ef)}", ef["spec"], []
    patches = spec["configPatches"]
    if not spec.get("workloadSelector", {}).get("labels"):
        errors.append(f"{where}: needs a workloadSelector (the callers that route by cache affinity)")
    if not spec.get("priority"):
        errors.append(f"{where}: relative patch operations need spec.priority (istioctl analyze IST0151)")
    host = engine_host(objects)
    engine = _service_for_host(objects, host)
    service_ports = {p["port"] for p in engine["spec"]["ports"]} if engine is not None else set()
    ecds = {p["patch"]["value"]["name"]: p["patch"]["value"] for p in patches if p["applyTo"] == "EXTENSION_CONFIG"}
    for p in patches:
        if p["applyTo"] != "HTTP_FILTER":
            continue
        if p["match"].get("context") != "SIDECAR_OUTBOUND":
            errors.append(f"{where}: the client role belongs on SIDECAR_OUTBOUND chains only")
        port = p["match"].get("listener", {}).get("portNumber")
        if port not in service_ports:
            errors.append(f"{where}: outbound port {port} is no port of Service {host!r}")
        name = p["patch"]["value"]["name"]
        if name not in ecds:
            errors.append(f"{where}: filter {name!r} takes its config by ECDS but no EXTENSION_CONFIG of that name")
            continue
        config, holds = _plugin_config(ecds[name])
        if name != CLIENT_FILTER_NAME or config.get(ROLE) != ROLE_CLIENT:
            errors.append(f"{where}: the outbound filter must be {CLIENT_FILTER_NAME!r} with role {ROLE_CLIENT!r}")
        if not (holds and config.get("hold_headers") is not False):
            errors.append(f"{where}: the client role needs held request headers (allow_on_headers_stop_iteration, "
                          "hold_headers): the routing key must exist before Envoy picks a replica")
    for dr in _of(objects, "DestinationRule"):
        if dr["spec"]["host"].split(".")[0] != host:
            continue
        if not dr["spec"].get("subsets"):
            lb = dr["spec"].get("trafficPolicy", {}).get("loadBalancer", {})
            if lb.get("consistentHash", {}).get("httpHeaderName") != ROUTE_KEY_HEADER:
                errors.append(f"DestinationRule/{_name(dr)}: does not hash on {ROUTE_KEY_HEADER} (cache affinity: "
                              f"{where})")
        for s in dr["spec"].get("subsets", []):
            lb = s.get("trafficPolicy", {}).get("loadBalancer") or dr["spec"].get("trafficPolicy", {}).get(
                "loadBalancer", {})
            if lb.get("consistentHash", {}).get("httpHeaderName") != ROUTE_KEY_HEADER:
                errors.append(f"DestinationRule/{_name(dr)}: subset {s['name']!r} does not hash on "
                              f"{ROUTE_KEY_HEADER} (cache affinity: {where})")
    return errors


def _plugin_config(extension_config: Obj) -> tuple[Obj, bool]:
    """An ECDS resource's plugin configuration, and whether its host can hold request headers:
    the Wasm filter when allow_on_headers_stop_iteration is set, the dynamic module always."""
    typed = extension_config["typed_config"]
    if typed.get("@type") == DYNAMIC_MODULE_TYPE_URL:
        return json.loads(typed["filter_config"]["value"]), True
    wasm = typed["config"]
    return json.loads(wasm["configuration"]["value"]), bool(wasm.get("allow_on_headers_stop_iteration"))


def _native_module_errors(objects: list[Obj], ef: Obj, where: str) -> list[str]:
    """A DynamicModuleFilter loads a file from the sidecar's filesystem: every selected pod must
    have it mounted where the filter names it (render's init container, emptyDir and
    userVolumeMount; meshcache/ctl/istio/native_module.py)."""
    from . import native_module  # imported here: render imports this module

    errors = []
    paths = {p["patch"]["value"]["typed_config"]["dynamic_module_config"]["module"]["local"]["filename"]
             for p in ef["spec"]["configPatches"] if p["applyTo"] == "EXTENSION_CONFIG"
             and p["patch"]["value"]["typed_config"].get("@type") == DYNAMIC_MODULE_TYPE_URL}
    for w in _selected(objects, ef["spec"].get("workloadSelector", {}).get("labels", {})):
        _, mounts = _annotation_volumes(w)
        mount = mounts.get(native_module.VOLUME, {}).get("mountPath")
        init = [c for c in w["spec"]["template"]["spec"].get("initContainers", [])
                if c["name"] == native_module.INIT_CONTAINER]
        ann = w["spec"]["template"]["metadata"].get("annotations", {})
        for path in paths:
            if mount is None or path.rsplit("/", 1)[0] != mount or not init \
                    or path.rsplit("/", 1)[1] not in " ".join(init[0].get("command", [])):
                errors.append(f"{where}: {w['kind']}/{_name(w)} does not mount the native module {path} into its "
                              "sidecar (render --filter native's init container and userVolumeMount)")
        if paths and ann.get("sidecar.istio.io/nativeSidecar") != "false":
            errors.append(f"{where}: {w['kind']}/{_name(w)} needs sidecar.istio.io/nativeSidecar: \"false\" (a "
                          "native sidecar starts before the init container that copies the module)")
    return errors


def _envoy_filter_errors(objects: list[Obj], ef: Obj) -> list[str]:
    where, spec, errors = f"EnvoyFilter/{_name(ef)}", ef["spec"], []
    ports = _selected_ports(objects, spec.get("workloadSelector", {}).get("labels", {}), where, errors)
    patches = spec["configPatches"]
    if any(p["patch"]["operation"] in ("INSERT_BEFORE", "INSERT_AFTER", "REPLACE", "REMOVE") for p in patches) \
            and not spec.get("priority"):
        errors.append(f"{where}: relative patch operations need spec.priority (istioctl analyze IST0151)")
    ecds_names = {p["patch"]["value"]["name"] for p in patches if p["applyTo"] == "EXTENSION_CONFIG"}
    errors += _native_module_errors(objects, ef, where)
    filters_by_port: dict[int, list[str]] = {}
    for p in patches:
        match, value = p.get("match", {}), p["patch"].get("value", {})
        port = match.get("listener", match.get("routeConfiguration", {})).get("portNumber")
        if port is not None and port not in ports:
            errors.append(f"{where}: patch {p['applyTo']} matches port {port}, no container port of the pods")
        if p["applyTo"] == "HTTP_FILTER":
            filters_by_port.setdefault(port, []).append(value["name"])
            if "config_discovery" in value and value["name"] not in ecds_names:
                errors.append(f"{where}: filter {value['name']!r} takes its config by ECDS but no EXTENSION_CONFIG "
                              "of that name is added")
    for port, names in filters_by_port.items():
        if grpc_hit.GRPC_HIT_LUA_FILTER in names:
            at = names.index(grpc_hit.GRPC_HIT_LUA_FILTER)
            if at == 0 or names[at - 1] != FILTER_NAME:
                errors.append(f"{where}: on port {port} {grpc_hit.GRPC_HIT_LUA_FILTER} must come right after "
                              f"the {FILTER_NAME} filter")
            # The hit route and the stale-if-error route (grpc_hit_routes()) both come before the default.
            for route in (r["name"] for r in grpc_hit.grpc_hit_routes()):
                found = [p for p in patches if p["applyTo"] == "HTTP_ROUTE"
                         and p["match"]["routeConfiguration"].get("portNumber") == port
                         and p["patch"]["value"].get("name") == route]
                if not found or found[0]["patch"]["operation"] != "INSERT_FIRST":
                    errors.append(f"{where}: port {port} has the Lua filter but no {route} route inserted first")
    return errors


# ---- startup order: what istiod needs must not need istiod ----------------------------------


def _proxy_config(w: Obj) -> Obj:
    ann = w["spec"]["template"]["metadata"].get("annotations", {})
    return yaml.safe_load(ann.get("proxy.istio.io/config", "")) or {}


# Where an Istio sidecar serves its Envoy stats: Envoy's own Prometheus listener, or the agent's
# merged page. Both outside the inbound traffic capture (istio-iptables -d 15090,15021,15020).
SIDECAR_STATS_PORTS = (15090, 15020)
SIDECAR_STATS_PORT_NAME = "http-envoy-prom"  # 15090 as Istio's injected istio-proxy container names it
# A stat the filter always defines; Istio keeps only stats its matcher includes.
FILTER_STAT = "wasmcustom.meshcache.hits"


def _keeps_filter_stats(w: Obj) -> bool:
    """Whether the pod's sidecar exports the filter's stats (Istio's default matcher drops them)."""
    prefixes = list((_proxy_config(w).get("proxyStatsMatcher") or {}).get("inclusionPrefixes") or [])
    ann = w["spec"]["template"]["metadata"].get("annotations", {})
    prefixes += [p.strip() for p in ann.get("sidecar.istio.io/statsInclusionPrefixes", "").split(",") if p.strip()]
    return any(FILTER_STAT.startswith(p) for p in prefixes)


def check_proxy_stats(objects: list[Obj]) -> list[str]:
    """The status page reads the cached pods' sidecar stats: found as the addresses of headless
    Services (MESHCACHE_CP_PROXY_STATS_DNS) and read through the {ip} template, on a port outside
    the traffic capture, from sidecars that keep the filter's stats."""
    errors = []
    for cp in _control_planes(objects):
        env = _env(cp)
        where = f"{cp['kind']}/{_name(cp)}"
        template = env.get("MESHCACHE_CP_PROXY_STATS_TEMPLATE") or ""
        names = [n.strip() for n in (env.get("MESHCACHE_CP_PROXY_STATS_DNS") or "").split(",") if n.strip()]
        if names and "{ip}" not in template:
            errors.append(f"{where}: MESHCACHE_CP_PROXY_STATS_DNS needs MESHCACHE_CP_PROXY_STATS_TEMPLATE with {{ip}}")
        if template:
            url = urlsplit(template.replace("{ip}", "10.0.0.1"))
            if url.port not in SIDECAR_STATS_PORTS or url.path != "/stats/prometheus":
                errors.append(f"{where}: proxy stats template {template!r} is not an Istio sidecar's stats page "
                              f"(http://{{ip}}:15090/stats/prometheus, or :15020 for the agent's merged page)")
        for name in names:
            svc = next((x for x in _of(objects, "Service") if _name(x) == name.split(".")[0]), None)
            if svc is None:
                errors.append(f"{where}: proxy stats DNS name {name!r} is no Service here")
                continue
            swhere = f"Service/{_name(svc)}"
            if svc["spec"].get("clusterIP") != "None":
                errors.append(f"{swhere}: proxy stats need a headless Service (clusterIP: None): a ClusterIP "
                              "Service resolves to one virtual IP, not to each pod")
            pods = _selected(objects, svc["spec"].get("selector", {}))
            if not pods:
                errors.append(f"{swhere}: selector matches no workload")
            for w in pods:
                if not injected(w):
                    errors.append(f"{swhere}: selects {w['kind']}/{_name(w)}, which has no sidecar to read stats from")
                elif not _keeps_filter_stats(w):
                    errors.append(f"{w['kind']}/{_name(w)}: its sidecar drops the filter's stats: add "
                                  "wasmcustom.meshcache to proxyStatsMatcher.inclusionPrefixes (proxy.istio.io/config) "
                                  "or sidecar.istio.io/statsInclusionPrefixes")
    return errors


def check_startup(objects: list[Obj]) -> list[str]:
    """istiod serves neither xDS nor its injection webhook (failurePolicy Fail) until every
    configSources entry has synced. So the control plane it reads, and whatever the control plane
    needs to answer, must start without istiod: no sidecar (or its xDS port excluded from capture
    and no hold on the app), readiness that does not depend on meshed pods, xDS behind TLS and a
    NetworkPolicy that admits istiod only."""
    errors = []
    cps = _control_planes(objects)
    if not cps:
        return ["no meshcache control plane Deployment"]
    for w in cps:
        where = f"{w['kind']}/{_name(w)}"
        ann = w["spec"]["template"]["metadata"].get("annotations", {})
        if injected(w):
            excluded = {p.strip() for p in ann.get("traffic.sidecar.istio.io/excludeInboundPorts", "").split(",")}
            if str(XDS_PORT) not in excluded:
                errors.append(f"{where}: has a sidecar and its xDS port {XDS_PORT} goes through it: istiod could never "
                              "sync (label the pod sidecar.istio.io/inject: \"false\")")
            if _proxy_config(w).get("holdApplicationUntilProxyStarts"):
                errors.append(f"{where}: holdApplicationUntilProxyStarts waits for a sidecar that waits for istiod")
        env = _env(w)
        if not env.get("MESHCACHE_CP_XDS_TLS_CERT") or not env.get("MESHCACHE_CP_XDS_TLS_KEY"):
            errors.append(f"{where}: the xDS port must serve TLS (MESHCACHE_CP_XDS_TLS_CERT/KEY)")
        for c in w["spec"]["template"]["spec"]["containers"]:
            probe = c.get("readinessProbe", {})
            if "httpGet" in probe and probe["httpGet"].get("path") == "/readyz":
                errors.append(f"{where}: readiness on /readyz needs Redis; istiod reaches only ready pods")
        redis = re.match(r"^rediss?://([^:/]+)", env.get("MESHCACHE_CP_REDIS_URL") or "")
        svc = next((s for s in _of(objects, "Service") if redis and _name(s) == redis.group(1)), None)
        if svc is not None and not injected(w):
            for dep in _selected(objects, svc["spec"].get("selector", {})):
                if injected(dep):
                    errors.append(f"{dep['kind']}/{_name(dep)}: the control plane (no sidecar) reaches it, so it "
                                  "must be outside the mesh too")
    policies = [np for np in _of(objects, "NetworkPolicy")
                if _selects(np["spec"]["podSelector"].get("matchLabels", {}), _pod_labels(cps[0]))]
    xds_rules = [r for np in policies for r in np["spec"].get("ingress", [])
                 if any(p.get("port") in (XDS_PORT, "xds") for p in r.get("ports", []))]
    open_rules = [r for np in policies for r in np["spec"].get("ingress", []) if not r.get("ports")]
    if not policies:
        errors.append("no NetworkPolicy selects the control plane: its xDS port is open to every pod")
    elif open_rules or not xds_rules:
        errors.append("the control plane's NetworkPolicy must admit its xDS port from istiod only")
    for rule in xds_rules:
        for peer in rule.get("from", [{}]):
            ns = peer.get("namespaceSelector", {}).get("matchLabels", {})
            pods = peer.get("podSelector", {}).get("matchLabels", {})
            if ns.get("kubernetes.io/metadata.name") != "istio-system" or pods.get("app") != "istiod":
                errors.append(f"NetworkPolicy: xDS port {XDS_PORT} admits {peer} (only istiod may connect)")
    return errors


# The control plane's probes: ADS round trips through its xDS server (control_plane/xds_probe.py).
LIVENESS_PATH = "/healthz/xds"
READINESS_PATH = "/readyz/xds"


def _probe_path(container: Obj, probe: str) -> str | None:
    return container.get(probe, {}).get("httpGet", {}).get("path")


def check_availability(objects: list[Obj]) -> list[str]:
    """A starting istiod exits if its stream to the control plane's Service fails and waits without
    a timeout for the answers (docs/istio.md, "What istiod waits for"): one replica must be ready
    and really serving at all times, and the Service must send istiod to such replicas only."""
    errors = []
    for w in _control_planes(objects):
        where = f"{w['kind']}/{_name(w)}"
        spec, pod = w["spec"], w["spec"]["template"]["spec"]
        container = next((c for c in pod["containers"] if c["name"] == "control-plane"), pod["containers"][0])
        if _probe_path(container, "readinessProbe") != READINESS_PATH:
            errors.append(f"{where}: readinessProbe must be httpGet {READINESS_PATH} (an ADS round trip): a TCP "
                          "check passes on a stopped process, and istiod's Service would keep sending it there")
        for probe in ("livenessProbe", "startupProbe"):
            if _probe_path(container, probe) != LIVENESS_PATH:
                errors.append(f"{where}: {probe} must be httpGet {LIVENESS_PATH}: a wedged control plane is only "
                              "restarted if its liveness exercises the xDS path")
        if spec.get("replicas", 1) < 2:
            errors.append(f"{where}: needs 2 replicas or more: istiod cannot start while the only one is down")
        rolling = spec.get("strategy", {}).get("rollingUpdate", {})
        if spec.get("strategy", {}).get("type") == "Recreate" or rolling.get("maxUnavailable") not in (0, "0%"):
            errors.append(f"{where}: strategy.rollingUpdate.maxUnavailable must be 0 (a rollout keeps every "
                          "ready replica until its replacement is ready)")
        pc = pod.get("priorityClassName")
        if not pc:
            errors.append(f"{where}: no priorityClassName (istiod's restarts depend on this pod)")
        elif not any(_name(o) == pc for o in _of(objects, "PriorityClass")) and not pc.startswith("system-"):
            errors.append(f"{where}: priorityClassName {pc!r}: no such PriorityClass in the manifests")
        anti = pod.get("affinity", {}).get("podAntiAffinity", {})
        terms = [t.get("podAffinityTerm", t) for key in ("preferredDuringSchedulingIgnoredDuringExecution",
                                                          "requiredDuringSchedulingIgnoredDuringExecution")
                 for t in anti.get(key, [])]
        if not any(t.get("topologyKey") == "kubernetes.io/hostname"
                   and _selects(t.get("labelSelector", {}).get("matchLabels", {}), _pod_labels(w)) for t in terms):
            errors.append(f"{where}: no pod anti-affinity on kubernetes.io/hostname: both replicas may share a node")
        pdbs = [b for b in _of(objects, "PodDisruptionBudget")
                if _selects(b["spec"].get("selector", {}).get("matchLabels", {}), _pod_labels(w))]
        if not any(int(b["spec"].get("minAvailable", 0) or 0) >= 1 or "maxUnavailable" in b["spec"] for b in pdbs):
            errors.append(f"{where}: no PodDisruptionBudget keeps a replica available during drains")
        services = [svc for svc in _of(objects, "Service")
                    if _name(svc) == CONTROL_PLANE and _selects(svc["spec"].get("selector", {}), _pod_labels(w))]
        if not services:
            errors.append(f"{where}: no Service {CONTROL_PLANE} selects it (istiod's xds:// address)")
        for svc in services:
            if svc["spec"].get("publishNotReadyAddresses"):
                errors.append(f"Service/{_name(svc)}: publishNotReadyAddresses sends istiod to unready replicas")
    return errors


def check_operator_steps(step1: Obj, step2: Obj) -> list[str]:
    """Step 1 installs Istio without the MCP source; step 2 adds it, over TLS, keeping Kubernetes."""
    errors = []
    sources1 = step1["spec"].get("meshConfig", {}).get("configSources", [])
    if any(s["address"].startswith("xds://") for s in sources1):
        errors.append("IstioOperator step 1: must not list the control plane (istiod would wait for it)")
    sources2 = step2["spec"].get("meshConfig", {}).get("configSources", [])
    if "k8s://" not in [s["address"] for s in sources2]:
        errors.append("IstioOperator step 2: configSources replaces the defaults: list k8s:// too")
    xds = [s for s in sources2 if s["address"].startswith("xds://")]
    if not xds:
        errors.append("IstioOperator step 2: no xds:// source")
    for s in xds:
        tls = s.get("tlsSettings", {})
        if tls.get("mode") != "SIMPLE" or not (tls.get("credentialName") or tls.get("caCertificates")):
            errors.append(f"IstioOperator step 2: {s['address']} needs tlsSettings mode SIMPLE with a CA "
                          "(credentialName): other modes are plaintext")
        host = s["address"].removeprefix("xds://").rsplit(":", 1)[0]
        if not any(host.startswith(n) for n in tls.get("subjectAltNames", [])):
            errors.append(f"IstioOperator step 2: {s['address']}: subjectAltNames must name the control plane")
    return errors


def check_monitors(objects: list[Obj]) -> list[str]:
    """PodMonitors select pods here and scrape a port they have: a named container port, or the
    sidecar's Envoy stats port on injected pods (the istio-proxy container Istio adds)."""
    errors = []
    for pm in _of(objects, "PodMonitor"):
        where = f"PodMonitor/{_name(pm)}"
        pods = _selected(objects, pm["spec"].get("selector", {}).get("matchLabels", {}))
        if not pods:
            errors.append(f"{where}: selector matches no workload")
        for ep in pm["spec"].get("podMetricsEndpoints", []):
            for w in pods:
                names = {p.get("name") for c in w["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])}
                if injected(w):
                    names.add(SIDECAR_STATS_PORT_NAME)
                if ep.get("port") not in names:
                    errors.append(f"{where}: port {ep.get('port')!r} is no port of {w['kind']}/{_name(w)}")
    return errors


def check_delivery(objects: list[Obj]) -> list[str]:
    """delivery kube: the control plane's ServiceAccount may do exactly what its writer does, on
    exactly its kind, in its own namespace (a Role, never cluster-wide), read that Role (the
    owner of what it writes), and has its token. delivery
    mcp (the default): it is granted nothing, since it writes nothing."""
    errors = []
    for w in _control_planes(objects):
        where, env = f"{w['kind']}/{_name(w)}", _env(w)
        delivery = env.get("MESHCACHE_CP_DELIVERY") or "mcp"
        pod = w["spec"]["template"]["spec"]
        account, namespace = pod.get("serviceAccountName", "default"), w["metadata"].get("namespace")
        resource = extensions.KUBE_RESOURCES[extensions.MODE_KIND[env.get("MESHCACHE_CP_ISTIO_MODE") or "full"]]
        bindings = [b for b in _of(objects, "RoleBinding") + _of(objects, "ClusterRoleBinding")
                    if any(s.get("kind") == "ServiceAccount" and s.get("name") == account
                           and s.get("namespace", b["metadata"].get("namespace")) == namespace
                           for s in b.get("subjects", []))]
        rules = []
        for b in bindings:
            if b["kind"] == "ClusterRoleBinding" or b["roleRef"]["kind"] == "ClusterRole":
                errors.append(f"{b['kind']}/{_name(b)}: grants the control plane a ClusterRole; it needs a Role "
                              "in its own namespace only")
                continue
            role = next((r for r in _of(objects, "Role") if _name(r) == b["roleRef"]["name"]
                         and r["metadata"].get("namespace") == b["metadata"].get("namespace")), None)
            if role is None:
                errors.append(f"RoleBinding/{_name(b)}: Role {b['roleRef']['name']!r} is not defined here")
                continue
            rules += [(role, r) for r in role.get("rules", [])]
        if delivery == "mcp":
            errors += [f"Role/{_name(role)}: grants {rule.get('resources')} to the control plane, which writes "
                       "nothing with delivery mcp" for role, rule in rules]
            continue
        if pod.get("automountServiceAccountToken") is False:
            errors.append(f"{where}: delivery kube authenticates with the pod's ServiceAccount token: don't set "
                          "automountServiceAccountToken false")
        enough = owned = False
        for role, rule in rules:
            groups, plurals, verbs = rule.get("apiGroups", []), rule.get("resources", []), rule.get("verbs", [])
            if rule == extensions.WRITER_OWNER_RULE and _name(role) == extensions.WRITER_ROLE:
                owned = role["metadata"].get("namespace") == namespace  # its own Role: the objects' owner
            elif groups != [resource.group] or plurals != [resource.plural] or rule.get("resourceNames") \
                    or sorted(verbs) != sorted(extensions.WRITER_VERBS):
                errors.append(f"Role/{_name(role)}: rule {groups} {plurals} {verbs} is not the writer's: exactly "
                              f"{list(extensions.WRITER_VERBS)} on {resource.group} {resource.plural}")
            elif role["metadata"].get("namespace") == namespace:
                enough = True
        if not enough:
            errors.append(f"{where}: delivery kube needs a Role in {namespace} granting "
                          f"{list(extensions.WRITER_VERBS)} on {resource.group} {resource.plural}, bound to "
                          f"ServiceAccount {account}")
        if not owned:
            errors.append(f"{where}: delivery kube needs the Role {extensions.WRITER_ROLE} in {namespace} to also "
                          f"grant get on itself ({extensions.WRITER_OWNER_RULE}): it owns the objects the control "
                          "plane writes, which are removed with it (uninstall)")
    return errors


def check_all(objects: list[Obj], image_digest: str, elsewhere: frozenset[str] = frozenset(),
              startup: bool = True, allowed_principals: frozenset[str] = frozenset()) -> list[str]:
    return (check_delivery(objects)
            + check_workloads(objects) + check_traffic(objects, elsewhere) + check_security(objects, allowed_principals)
            + check_sidecar_annotations(objects) + check_module(objects, image_digest)
            + check_extensions(objects, elsewhere) + check_proxy_stats(objects) + check_monitors(objects)
            + (check_startup(objects) + check_availability(objects) if startup else []))
