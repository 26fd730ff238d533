"""`meshcache istio render`: the kustomize build of istio/ customised for a namespace, traffic
colours and the built filter module; the two IstioOperator steps; and a preview of what the control
plane serves istiod over MCP for a policy snapshot (the same builders, meshcache/contract/extensions.py).

The committed base (namespace `meshcache`, colour `blue`, demo policies, the module built at
commit time) is a fixed point of this function: rendering it with the defaults gives it back, so
the committed files and the renderer cannot drift apart unnoticed (tests/istio).
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from meshcache.contract import extensions, oci
from meshcache.contract.extensions import Workloads, format_selector, oci_url, parse_ports, parse_selector
from meshcache.contract.filter_config import Limits, Policy, demo_policies, plugin_config
from meshcache.contract.headers import COLOR_HEADER
from meshcache.contract.paths import FILTER_WASM, REPO_ROOT

from . import filter_host as hosts
from . import kustomize, monitoring, native_module

ISTIO_DIR = REPO_ROOT / "istio"
BASE_DIR = ISTIO_DIR / "base"
OPERATOR_FILE = ISTIO_DIR / "install" / "istio-operator.yaml"  # step 1: no MCP source
OPERATOR_MCP_FILE = ISTIO_DIR / "install" / "istio-operator-mcp.yaml"  # step 2: with it
BASE_NAMESPACE = "meshcache"
BASE_COLOR = "blue"
FILTER_REPOSITORY = "registry.example.com/meshcache/filter"
ENGINE_APP = extensions.ENGINE_APP
CONTROL_PLANE = "meshcache-control-plane"
INGRESS_HOST = "meshcache.example.com"
ENGINE_IMAGE_PREFIX = "registry.example.com/meshcache/engine:"
CONTROL_PLANE_IMAGE_PREFIX = "registry.example.com/meshcache/control-plane:"
# Objects the renderer fills in, found by name (overlays keep the names, change the content).
AUTHZ = "meshcache-engine"
AUTHZ_MODES = ("allow-callers", "none")
# The ingress gateway's identity in the committed manifests: istioctl's default gateway. A Helm
# gateway (`helm install NAME istio/gateway -n NS`) runs as NS/NAME: `render --ingress-principal`.
INGRESS_PRINCIPAL = "cluster.local/ns/istio-system/sa/istio-ingressgateway-service-account"
DESTINATION_RULE = "meshcache-engine"
PROXIES_SERVICE = "meshcache-engine-proxies"
COLOR_RE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,30}[a-z0-9])?$")
NAMESPACE_RE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")  # DNS-1123 label (fullmatch)
# Namespaces meshcache's manifests must never go into: Istio's own (its control plane, the
# gateway namespaces its install docs create, the operator's) and Kubernetes' system ones. A
# policy or a Deployment there would change the mesh, not one application.
RESERVED_NAMESPACES = ("istio-system", "istio-ingress", "istio-egress", "istio-gateways", "istio-operator",
                       "istio-cni", "kube-system", "kube-public", "kube-node-lease")


def check_namespace(namespace: str) -> None:
    """`--namespace`: a DNS-1123 label that is neither Istio's nor Kubernetes' own (ValueError)."""
    if NAMESPACE_RE.fullmatch(namespace) is None:
        raise ValueError(f"--namespace {namespace!r} must be a DNS-1123 label (lowercase letters, digits and '-', "
                         "starting and ending with a letter or digit, at most 63 characters)")
    if namespace in RESERVED_NAMESPACES:
        raise ValueError(f"--namespace {namespace}: that is Istio's or Kubernetes' own namespace; meshcache goes "
                         f"into a namespace of its own (default {BASE_NAMESPACE})")
Obj = dict[str, Any]


def demo_plugin_config() -> dict[str, Any]:
    """The demo models' policies, as a snapshot (version 1) would render them (no control plane needed)."""
    return plugin_config("1", demo_policies(generation=1))


def plugin_config_from_file(path: Path) -> dict[str, Any]:
    """A snapshot JSON file: the API's `GET /v1/snapshot` body, or a stored snapshot record."""
    data = json.loads(Path(path).read_text())
    if isinstance(data, dict) and isinstance(data.get("plugin_config"), str):
        return json.loads(data["plugin_config"])  # type: ignore[no-any-return]
    # A stored record (control_plane/snapshots.py `to_record`): version, limits, policies.
    return plugin_config(str(int(data["version"])), [Policy.model_validate(p) for p in data.get("policies", [])],
                         Limits.model_validate(data.get("limits", {})))


def plugin_config_from_api(url: str, token: str, timeout: float = 10.0) -> dict[str, Any]:
    r = httpx.get(f"{url.rstrip('/')}/v1/snapshot", headers={"Authorization": f"Bearer {token}"}, timeout=timeout)
    r.raise_for_status()
    body = r.json()
    if body["version"] == 0:
        raise ValueError(f"{url} has no policies yet (snapshot version 0): nothing to render")
    return json.loads(body["plugin_config"])  # type: ignore[no-any-return]


# `--allow-principal`: a SPIFFE id, Istio's principal form, or `namespace/serviceaccount`.
_DNS_LABEL = r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?"
_SA_NAME = r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?"
_TRUST_DOMAIN = r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?"
_PRINCIPAL_FORMS = (
    re.compile(rf"^spiffe://(?P<td>{_TRUST_DOMAIN})/ns/(?P<ns>{_DNS_LABEL})/sa/(?P<sa>{_SA_NAME})$"),
    re.compile(rf"^(?P<td>{_TRUST_DOMAIN})/ns/(?P<ns>{_DNS_LABEL})/sa/(?P<sa>{_SA_NAME})$"),
    re.compile(rf"^(?P<ns>{_DNS_LABEL})/(?P<sa>{_SA_NAME})$"),
)
DEFAULT_TRUST_DOMAIN = "cluster.local"


def normalize_principal(value: str, flag: str = "--allow-principal") -> str:
    """`spiffe://cluster.local/ns/X/sa/Y`, `cluster.local/ns/X/sa/Y` or `X/Y` -> Istio's
    AuthorizationPolicy form `cluster.local/ns/X/sa/Y` (the SPIFFE id without `spiffe://`)."""
    for form in _PRINCIPAL_FORMS:
        m = form.match(value.strip())
        if m:
            td = m.groupdict().get("td") or DEFAULT_TRUST_DOMAIN
            return f"{td}/ns/{m.group('ns')}/sa/{m.group('sa')}"
    raise ValueError(f"{flag} {value!r}: use spiffe://<trust domain>/ns/<namespace>/sa/<serviceaccount>, "
                     "<trust domain>/ns/<namespace>/sa/<serviceaccount> or <namespace>/<serviceaccount> "
                     "(lowercase DNS names)")


ENGINE_PORT_KEYS = ("http", "grpc", "service-http", "service-grpc")


def parse_engine_ports(items: Iterable[str]) -> dict[str, int | None]:
    """`--engine-port KEY=N` entries (KEY: http, grpc, service-http, service-grpc; `grpc=none`: no
    gRPC port)."""
    out: dict[str, int | None] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in ENGINE_PORT_KEYS:
            raise ValueError(f"--engine-port {item!r}: use KEY=PORT with KEY one of {', '.join(ENGINE_PORT_KEYS)}")
        if value == "none" and key in ("grpc", "service-grpc"):
            out[key] = None
            continue
        if not value.isdigit() or not 1 <= int(value) <= 65535:
            raise ValueError(f"--engine-port {item!r}: the port must be a number in 1..65535")
        out[key] = int(value)
    return out


def parse_engine_selector(items: Iterable[str]) -> dict[str, str]:
    """`--engine-selector KEY=VALUE` entries, checked as Kubernetes labels."""
    labels: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--engine-selector {item!r}: use KEY=VALUE (a pod label of the cached workloads)")
        labels[key] = value
    Workloads(labels)  # label syntax
    return labels


# An image reference as the container runtime takes it (registry/path[:tag][@sha256:digest]).
IMAGE_RE = re.compile(r"^[a-z0-9]([-a-z0-9._:]*[a-z0-9])?(/[a-z0-9]([-a-z0-9._]*[a-z0-9])?)*"
                      r"(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(@sha256:[a-f0-9]{64})?$")


@dataclass
class RenderOptions:
    namespace: str = BASE_NAMESPACE
    color: str | None = None  # None: BASE_COLOR when the build deploys meshcache's own engine
    also_colors: tuple[str, ...] = ()  # colours already live: keep their subsets and routes
    plugin_config: dict[str, Any] = field(default_factory=demo_plugin_config)
    module_path: Path = FILTER_WASM
    image_digest: str | None = None  # manifest digest of the pushed image, if not ours
    filter_repository: str = FILTER_REPOSITORY
    source: Path = BASE_DIR  # the base or an overlay directory
    ingress_host: str = INGRESS_HOST
    engine_image: str | None = None
    control_plane_image: str | None = None
    allow_principals: tuple[str, ...] = ()  # added to the engine AuthorizationPolicy's callers
    ingress_principals: tuple[str, ...] = ()  # the ingress gateway's identities; () keeps INGRESS_PRINCIPAL
    authz: str = "allow-callers"  # AUTHZ_MODES: the ALLOW policy, or none (authorization is the user's)
    engine_selector: dict[str, str] | None = None  # None: the build's (the control plane's env)
    engine_ports: dict[str, int | None] = field(default_factory=dict)  # parse_engine_ports()
    engine_service: str | None = None  # the Service callers use; None: the build's DestinationRule host
    mesh_tls13: bool = False  # IstioOperator/Helm values: meshMTLS.minProtocolVersion TLSV1_3
    delivery: str = "mcp"  # mcp: istiod reads the control plane (configSources); kube: it writes the objects
    filter_host: str = "wasm"  # hosts.FILTERS: the cache's host in the sidecars
    istio_version: str = hosts.ISTIO_VERSION  # the mesh's Istio (which hosts it can run)
    native_image: str | None = None  # --filter native: the module's image, pinned by digest

    def colors(self, own_engine: bool = True) -> list[str]:
        if not own_engine:
            return []
        color = self.color or BASE_COLOR
        return [color, *[c for c in dict.fromkeys(self.also_colors) if c != color]]

    def default_color(self) -> str:
        return self.color or BASE_COLOR


@dataclass(frozen=True)
class Pins:
    image_digest: str
    module_sha256: str
    url: str


def pins_for(opts: RenderOptions) -> Pins:
    image = oci.image_for(opts.module_path)
    digest = opts.image_digest or image.digest
    if not re.match(r"^[a-f0-9]{64}$", digest):
        raise ValueError(f"--image-digest must be 64 lowercase hex characters (no 'sha256:'), got {digest!r}")
    return Pins(digest, image.module_sha256, oci_url(opts.filter_repository, digest))


@dataclass(frozen=True)
class NativePins:
    """`--filter native`: the module build for the mesh's Envoy, its sha256 and its image."""

    module_file: str
    sha256: str
    image: str

    @property
    def sidecar_path(self) -> str:
        return native_module.sidecar_path(self.module_file)


def native_pins_for(opts: RenderOptions) -> NativePins | None:
    """None for the Wasm host; ValueError when the mesh's Istio cannot run the native one."""
    hosts.check(opts.filter_host, opts.istio_version)
    if opts.filter_host != "native":
        return None
    module_file = hosts.native_module_file(opts.istio_version)
    image = native_module.check_image(opts.native_image)
    path = opts.module_path.parent / module_file
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: build the module for this Istio's Envoy (make filter)")
    return NativePins(module_file, oci.sha256_hex(path.read_bytes()), image)


def own_engine(objects: list[Obj]) -> bool:
    """Whether the build deploys meshcache's own engine (colours apply) or fronts the user's
    workloads (overlays kserve, triton: no engine Deployment, no colour labels on their pods)."""
    return any(o["kind"] == "Deployment" and o["metadata"].get("labels", {}).get("app") == ENGINE_APP
               for o in objects)


def workloads_from_env(env: dict[str, str]) -> Workloads:
    """The cached pods and ports as the control plane reads them (control_plane/settings.py)."""
    http = parse_ports(env.get("MESHCACHE_CP_ISTIO_HTTP_PORTS", str(extensions.HTTP_PORT)))
    grpc = parse_ports(env.get("MESHCACHE_CP_ISTIO_GRPC_PORTS", str(extensions.GRPC_PORT)))
    return Workloads(parse_selector(env.get("MESHCACHE_CP_ISTIO_SELECTOR", "")), http, grpc,
                     parse_ports(env.get("MESHCACHE_CP_ISTIO_SERVICE_PORTS", "")) or (*http, *grpc))


def workloads_for(opts: RenderOptions, current: Workloads, service: Obj | None) -> Workloads:
    """The build's workloads (its control plane's env) with the options' selector and ports. The
    Service ports (the client role's outbound listeners): the flags', else those of the engine
    Service when the build has it (meshcache's own), else the build's env."""
    ports = opts.engine_ports
    http = (int(ports["http"]),) if ports.get("http") else current.http_ports
    grpc = current.grpc_ports
    if "grpc" in ports:
        grpc = (ports["grpc"],) if ports["grpc"] else ()
    n = len(current.http_ports)
    svc_http, svc_grpc = current.service_ports[:n], current.service_ports[n:]
    if service is not None:
        by_target = {p.get("targetPort"): p["port"] for p in service["spec"].get("ports", [])}
        svc_http = tuple(by_target[t] for t in ("http",) if t in by_target) or svc_http
        svc_grpc = tuple(by_target[t] for t in ("grpc",) if t in by_target) if grpc else ()
    if ports.get("service-http"):
        svc_http = (int(ports["service-http"]),)
    if "service-grpc" in ports:
        svc_grpc = (ports["service-grpc"],) if ports["service-grpc"] else ()
    elif not grpc:
        svc_grpc = ()
    return Workloads(opts.engine_selector or dict(current.labels), http, grpc,
                     (*svc_http, *svc_grpc) or (*http, *grpc))


def render(opts: RenderOptions) -> list[Obj]:
    check_namespace(opts.namespace)
    objects = kustomize.build(opts.source)
    own = own_engine(objects)
    if not own and (opts.color or opts.also_colors):
        raise ValueError(f"{opts.source} caches your own workloads, whose pods carry no meshcache colour label: "
                         "--color/--also-color apply to meshcache's own engine only")
    for c in opts.colors(own):
        if not COLOR_RE.fullmatch(c):  # fullmatch: `$` alone lets a trailing newline through
            raise ValueError(f"colour {c!r} must be a DNS label of at most 32 characters")
    principals = tuple(normalize_principal(p) for p in opts.allow_principals)
    ingress = tuple(normalize_principal(p, "--ingress-principal") for p in opts.ingress_principals)
    if opts.authz not in AUTHZ_MODES:
        raise ValueError(f"--authz {opts.authz!r}: use one of {', '.join(AUTHZ_MODES)}")
    if opts.authz == "none" and (principals or ingress):
        raise ValueError("--allow-principal/--ingress-principal name callers of meshcache's AuthorizationPolicy, "
                         "which --authz none does not render")
    for flag, image in (("--engine-image", opts.engine_image), ("--control-plane-image", opts.control_plane_image)):
        if image is not None and not IMAGE_RE.match(image):
            raise ValueError(f"{flag} {image!r} is not an image reference (registry/repository[:tag][@sha256:...])")
    if opts.engine_service is not None and not re.fullmatch(_DNS_LABEL, opts.engine_service):
        raise ValueError(f"--engine-service {opts.engine_service!r} must be a Service name (a DNS label)")
    service = next((o for o in objects if o["kind"] == "Service" and o["metadata"]["name"] == ENGINE_APP), None)
    workloads = workloads_for(opts, workloads_from_env(control_plane_env(objects)), service if own else None)
    if own:
        engine = next(o for o in objects
                      if o["kind"] == "Deployment" and o["metadata"]["labels"].get("app") == ENGINE_APP)
        labels = engine["spec"]["template"]["metadata"]["labels"]
        clash = [f"{k}={labels[k]}" for k, v in workloads.labels.items() if k in labels and labels[k] != v]
        if clash:
            raise ValueError(f"--engine-selector conflicts with meshcache's engine label {', '.join(clash)}: the own "
                             "engine's pods get the selector's labels; pick other labels, or render an overlay for "
                             "your own workloads (istio/overlays/kserve, triton)")
    if opts.delivery not in DELIVERIES:
        raise ValueError(f"--delivery {opts.delivery!r}: use one of {', '.join(DELIVERIES)}")
    if opts.delivery == "kube" and opts.mesh_tls13:
        raise ValueError("--mesh-tls13 changes istiod's mesh config, which --delivery kube leaves alone: set "
                         "meshMTLS.minProtocolVersion in your Istio install instead")
    native = native_pins_for(opts)
    if native is not None:
        mode = control_plane_env(objects).get("MESHCACHE_CP_ISTIO_MODE", "full")
        if mode != "full":
            raise ValueError(f"--filter native replaces the full mode's Wasm filter; {opts.source} renders the "
                             f"{mode} mode (TrafficExtensions are Wasm only): render the base")
        if not own:
            raise ValueError(f"--filter native with {opts.source}: render mounts the module into meshcache's own "
                             "engine pods only; for your own workloads use --filter wasm (docs/istio.md, "
                             "\"The native host under Istio 1.31\")")
    customize(objects, opts, pins_for(opts), workloads, own, principals, ingress, native)
    if opts.authz == "none":  # the user's own policies decide who reaches the cached pods
        objects = [o for o in objects if not (o["kind"] == "AuthorizationPolicy" and o["metadata"]["name"] == AUTHZ)]
    if opts.delivery == "kube":
        objects += kube_delivery(objects, opts.namespace)
    return objects


# ---- delivery kube: the control plane writes the objects itself --------------------------------

DELIVERIES = ("mcp", "kube")
WRITER_ROLE = extensions.WRITER_ROLE


def kube_delivery(objects: list[Obj], namespace: str) -> list[Obj]:
    """Sets the control plane's MESHCACHE_CP_DELIVERY=kube and returns its RBAC: in the namespace it
    writes to (its own, MESHCACHE_CP_ISTIO_NAMESPACE), a Role with exactly the verbs the writer uses
    on exactly its kind (EnvoyFilters in full mode, TrafficExtensions in basic) and `get` on that
    Role itself (the owner of what it writes: deleting the Role deletes them), bound to its
    ServiceAccount. Nothing cluster-wide, no other kind, no other namespace."""
    dep = next(o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == CONTROL_PLANE)
    pod = dep["spec"]["template"]["spec"]
    container = pod["containers"][0]
    container["env"] = [e for e in container.get("env", []) if e["name"] != "MESHCACHE_CP_DELIVERY"] + [
        {"name": "MESHCACHE_CP_DELIVERY", "value": "kube"}]
    pod.pop("automountServiceAccountToken", None)  # the writer authenticates with the pod's token
    resource = extensions.KUBE_RESOURCES[extensions.MODE_KIND[control_plane_env(objects).get(
        "MESHCACHE_CP_ISTIO_MODE", "full")]]
    labels = dict(dep["metadata"].get("labels", {}))
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
            "metadata": {"name": WRITER_ROLE, "namespace": namespace, "labels": labels},
            "rules": [{"apiGroups": [resource.group], "resources": [resource.plural],
                       "verbs": list(extensions.WRITER_VERBS)}, copy.deepcopy(extensions.WRITER_OWNER_RULE)]}
    binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
               "metadata": {"name": WRITER_ROLE, "namespace": namespace, "labels": labels},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": WRITER_ROLE},
               "subjects": [{"kind": "ServiceAccount", "name": pod.get("serviceAccountName", "default"),
                             "namespace": namespace}]}
    return [role, binding]


def delivery_of(objects: list[Obj]) -> str:
    return control_plane_env(objects).get("MESHCACHE_CP_DELIVERY", "mcp")


def render_operators(opts: RenderOptions) -> tuple[Obj, Obj]:
    """(step 1, step 2): Istio without, then with, the control plane as an MCP source."""
    out = []
    for path in (OPERATOR_FILE, OPERATOR_MCP_FILE):
        obj = kustomize._load(path)[0]
        _rename_namespace(obj, opts.namespace)
        if opts.mesh_tls13:  # the one mesh-wide change that is opt-in
            obj["spec"]["meshConfig"] = {"meshMTLS": {"minProtocolVersion": "TLSV1_3"},
                                         **obj["spec"].get("meshConfig", {})}
        out.append(obj)
    return out[0], out[1]


def control_plane_env(objects: list[Obj]) -> dict[str, str]:
    dep = next(o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == CONTROL_PLANE)
    container = dep["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def control_plane_probe(objects: list[Obj] | None = None, kind: str = "livenessProbe") -> Obj:
    """The control plane's probe as rendered (the base's by default): the local meshes'
    supervisors apply the very same one (meshcache/ctl/mesh/healing.py `Liveness`)."""
    objects = objects if objects is not None else kustomize.build(BASE_DIR)
    dep = next(o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == CONTROL_PLANE)
    return dict(dep["spec"]["template"]["spec"]["containers"][0][kind])


def mcp_objects(objects: list[Obj], plugin_config: dict[str, Any]) -> list[Obj]:
    """What the rendered control plane gives istiod for this policy snapshot (its mode, colours,
    cached workloads and module pin come from the Deployment's environment), with the namespace
    set: served over MCP, or with delivery kube exactly as it writes them to the API server."""
    env = control_plane_env(objects)
    namespace = next(o["metadata"]["name"] for o in objects if o["kind"] == "Namespace")
    colors = [c for c in env.get("MESHCACHE_CP_ISTIO_COLOR", "").split(",") if c] or [""]
    out = extensions.objects(env.get("MESHCACHE_CP_ISTIO_MODE", "full"), colors=colors,
                             url=env["MESHCACHE_CP_ISTIO_WASM_URL"], sha256=env["MESHCACHE_CP_ISTIO_WASM_SHA256"],
                             plugin_config=plugin_config, workloads=workloads_from_env(env),
                             native_module=env.get("MESHCACHE_CP_ISTIO_NATIVE_MODULE", ""))
    if env.get("MESHCACHE_CP_DELIVERY") == "kube":
        version = int(plugin_config.get("version") or 0)
        return [extensions.kube_object(o, namespace=namespace, version=version,
                                       revision=env.get("MESHCACHE_CP_ISTIO_REVISION", "")) for o in out]
    for o in out:
        o["metadata"]["namespace"] = namespace
        if env.get("MESHCACHE_CP_ISTIO_REVISION"):
            o["metadata"]["labels"] = {"istio.io/rev": env["MESHCACHE_CP_ISTIO_REVISION"]}
    return out


# ---- the customisations -----------------------------------------------------------------


def customize(objects: list[Obj], opts: RenderOptions, pins: Pins, workloads: Workloads, own: bool,
              principals: tuple[str, ...] = (), ingress: tuple[str, ...] = (), native: NativePins | None = None
              ) -> None:
    colors = opts.colors(own)
    for obj in objects:
        _rename_namespace(obj, opts.namespace)
        kind, name = obj["kind"], obj["metadata"]["name"]
        if kind == "Deployment" and obj["metadata"].get("labels", {}).get("app") == ENGINE_APP:
            _engine_deployment(obj, opts.default_color(), workloads, opts.engine_image)
            if native is not None:
                native_module.add_to_pod_template(obj["spec"]["template"], image=native.image,
                                                  module_file=native.module_file, sha256=native.sha256)
        elif kind == "Deployment" and name == CONTROL_PLANE:
            _control_plane(obj, colors, pins, workloads, opts.control_plane_image)
            if native is not None:
                for c in obj["spec"]["template"]["spec"]["containers"]:
                    _set_env(c, "MESHCACHE_CP_ISTIO_MODE", "native")
                    _upsert_env(c, "MESHCACHE_CP_ISTIO_NATIVE_MODULE", native.sidecar_path)
        elif kind == "DestinationRule" and name == DESTINATION_RULE:
            _destination_rule(obj, colors, opts.engine_service)
        elif kind == "VirtualService" and obj["spec"].get("gateways"):
            obj["spec"]["hosts"] = [opts.ingress_host]
            obj["spec"]["http"] = virtual_service_routes(colors, opts.default_color(), gateway=True)
        elif kind == "VirtualService" and name == ENGINE_APP:
            obj["spec"]["http"] = virtual_service_routes(colors, opts.default_color())
        elif kind == "Gateway":
            for server in obj["spec"]["servers"]:
                server["hosts"] = [opts.ingress_host]
        elif kind == "AuthorizationPolicy" and name == AUTHZ:
            _authorization_policy(obj, workloads, principals, ingress)
        elif kind == "Service" and name == PROXIES_SERVICE:
            obj["spec"]["selector"] = dict(workloads.labels)


def _destination_rule(obj: Obj, colors: list[str], host: str | None) -> None:
    """Cache affinity: a consistent hash on the client role's key, per colour subset (own engine)
    or for the whole host (the user's workloads, no colours)."""
    spec = obj["spec"]
    if host:
        spec["host"] = host
    if colors:
        spec["subsets"] = [{"name": c, "labels": {"color": c},
                            "trafficPolicy": {"loadBalancer": extensions.consistent_hash()}} for c in colors]
    else:
        spec.pop("subsets", None)
        spec.setdefault("trafficPolicy", {})["loadBalancer"] = extensions.consistent_hash()


def _authorization_policy(obj: Obj, workloads: Workloads, principals: tuple[str, ...],
                          ingress: tuple[str, ...] = ()) -> None:
    """The callers' rule (`from` principals) on the inference ports; the rule for every other port
    (`notPorts`, any source) follows them, so metrics and health ports stay reachable."""
    spec = obj["spec"]
    given = tuple(dict.fromkeys((*principals, *ingress)))
    if given:  # named for review, and so `istio validate` knows their accounts live elsewhere
        obj["metadata"].setdefault("annotations", {})["meshcache.io/allowed-principals"] = " ".join(given)
    spec["selector"] = {"matchLabels": dict(workloads.labels)}
    ports = [str(p) for p in workloads.ports]
    for rule in spec.get("rules", []):
        for src in rule.get("from", []):
            listed = src["source"].setdefault("principals", [])
            if ingress:  # the gateway's identities replace the default one (a Helm gateway has its own)
                listed[:] = [p for p in listed if p != INGRESS_PRINCIPAL]
            listed += [p for p in (*ingress, *principals) if p not in listed]
        for to in rule.get("to", []):
            op = to["operation"]
            op["notPorts" if "notPorts" in op else "ports"] = list(ports)


def _rename_namespace(obj: Obj, namespace: str) -> None:
    """Namespace in metadata, and in the strings that embed it (principals, FQDNs, selectors)."""
    if namespace == BASE_NAMESPACE:
        return
    meta = obj["metadata"]
    if obj["kind"] == "Namespace":
        meta["name"] = namespace
    elif "namespace" in meta and meta["namespace"] == BASE_NAMESPACE:
        meta["namespace"] = namespace

    def fix(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: (namespace if k == "kubernetes.io/metadata.name" and v == BASE_NAMESPACE else fix(v))
                    for k, v in node.items()}
        if isinstance(node, list):
            return [fix(v) for v in node]
        if isinstance(node, str):
            return (node.replace(f"/ns/{BASE_NAMESPACE}/", f"/ns/{namespace}/")
                    .replace(f".{BASE_NAMESPACE}.svc", f".{namespace}.svc"))
        return node

    for key in ("spec",):
        if key in obj:
            obj[key] = fix(obj[key])


def _engine_deployment(obj: Obj, color: str, workloads: Workloads, image: str | None) -> None:
    obj["metadata"]["name"] = f"{ENGINE_APP}-{color}"
    obj["metadata"]["labels"]["color"] = color
    obj["spec"]["selector"]["matchLabels"]["color"] = color
    tmpl = obj["spec"]["template"]["metadata"]
    # The selector's labels too, so meshcache's own engine stays among the cached pods.
    tmpl["labels"] |= {**workloads.labels, "color": color, "version": color}
    pod = obj["spec"]["template"]["spec"]
    for c in [*pod.get("initContainers", []), *pod["containers"]]:
        if image and c["image"].startswith(ENGINE_IMAGE_PREFIX):
            c["image"] = image
    engine = pod["containers"][0]
    by_name = {p["name"]: p for p in engine.get("ports", [])}
    for name, flag, ports in (("http", "--http-port", workloads.http_ports), ("grpc", "--grpc-port",
                                                                             workloads.grpc_ports)):
        if ports and name in by_name and by_name[name]["containerPort"] != ports[0]:
            by_name[name]["containerPort"] = ports[0]
            engine["args"] = [*engine.get("args", []), flag, str(ports[0])]
    ann = tmpl["annotations"]
    proxy = yaml.safe_load(ann["proxy.istio.io/config"])
    proxy["proxyMetadata"] |= {"MESHCACHE_TRAFFIC_COLOR": color, "ISTIO_META_MESHCACHE_TRAFFIC_COLOR": color}
    ann["proxy.istio.io/config"] = yaml.safe_dump(proxy, sort_keys=False)


def _set_env(container: Obj, name: str, value: str) -> None:
    for e in container.get("env", []):
        if e["name"] == name:
            e["value"] = value


def _upsert_env(container: Obj, name: str, value: str) -> None:
    env = container.setdefault("env", [])
    if not any(e["name"] == name for e in env):
        env.append({"name": name, "value": value})
    _set_env(container, name, value)


def _control_plane(obj: Obj, colors: list[str], pins: Pins, workloads: Workloads, image: str | None) -> None:
    for c in obj["spec"]["template"]["spec"]["containers"]:
        _set_env(c, "MESHCACHE_CP_ISTIO_COLOR", ",".join(colors))
        _set_env(c, "MESHCACHE_CP_ISTIO_WASM_URL", pins.url)
        _set_env(c, "MESHCACHE_CP_ISTIO_WASM_SHA256", pins.image_digest)
        _set_env(c, "MESHCACHE_CP_ISTIO_SELECTOR", format_selector(workloads.labels))
        _set_env(c, "MESHCACHE_CP_ISTIO_HTTP_PORTS", ",".join(map(str, workloads.http_ports)))
        _set_env(c, "MESHCACHE_CP_ISTIO_GRPC_PORTS", ",".join(map(str, workloads.grpc_ports)))
        _set_env(c, "MESHCACHE_CP_ISTIO_SERVICE_PORTS", ",".join(map(str, workloads.service_ports)))
        if image and c["image"].startswith(CONTROL_PLANE_IMAGE_PREFIX):
            c["image"] = image


# A request that could not reach a replica (connection refused, reset, stream refused) is retried;
# Istio adds the previous_hosts predicate, so the consistent hash walks on to the next replica and
# a lost replica's keys miss there instead of failing (the DestinationRule's outlier detection then
# ejects it). Istio's default retryOn lacks `reset`: a sidecar killed mid-request would fail it.
RETRIES: Obj = {"attempts": 2, "retryOn": "connect-failure,refused-stream,reset,unavailable,cancelled"}


def virtual_service_routes(colors: Iterable[str], default: str, gateway: bool = False) -> list[Obj]:
    """Header routes per colour, then the default colour. Bound to a gateway, each also names the
    port (the gateway's own port 80 is no port of the engine): gRPC to 8001, the rest to 8000."""
    def dest(c: str, port: int | None = None) -> list[Obj]:
        d: Obj = {"host": ENGINE_APP, "subset": c}
        if port is not None:
            d["port"] = {"number": port}
        return [{"destination": d}]

    routes: list[Obj] = []
    for c in [*colors, None]:
        color = {COLOR_HEADER: {"exact": c}} if c else {}
        name, target = (f"color-{c}", c) if c else ("default", default)
        if gateway:
            grpc = {**color, "content-type": {"prefix": "application/grpc"}}
            routes.append({"name": f"{name}-grpc", "match": [{"headers": grpc}],
                           "route": dest(target, extensions.GRPC_PORT)})
            color = {COLOR_HEADER: {"exact": c}} if c else {}  # no shared nodes in the YAML
            route: Obj = {"name": name, "route": dest(target, extensions.HTTP_PORT)}
        else:
            route = {"name": name, "route": dest(target)}
        if color:
            route = {"name": name, "match": [{"headers": color}], "route": route["route"]}
        routes.append(route)
    for route in routes:
        route["retries"] = dict(RETRIES)
    return routes


# ---- output -----------------------------------------------------------------------------


def write(objects: list[Obj], operators: tuple[Obj, Obj], mcp: list[Obj], out_dir: Path,
          opts: RenderOptions | None = None) -> list[Path]:
    """The rendered files, in the order they are applied (install_steps)."""
    opts = opts or RenderOptions()
    out_dir.mkdir(parents=True, exist_ok=True)
    namespace = [o for o in objects if o["kind"] == "Namespace"]
    files = {
        "istio-operator.yaml": yaml.safe_dump(operators[0], sort_keys=False),
        "namespace.yaml": NAMESPACE_HEADER + kustomize.dump(namespace),
        "meshcache-istio.yaml": kustomize.dump(objects),
    }
    if delivery_of(objects) == "kube":  # istiod is not changed at all: no MCP source to add
        files["kube-preview.yaml"] = KUBE_PREVIEW_HEADER + kustomize.dump(mcp)
    else:
        files |= {
            "istio-operator-mcp.yaml": yaml.safe_dump(operators[1], sort_keys=False),
            "istio-operator-existing.yaml": EXISTING_OPERATOR_HEADER + yaml.safe_dump(
                existing_operator(operators[1]), sort_keys=False),
            "istiod-values.yaml": HELM_VALUES_HEADER + yaml.safe_dump(istiod_values(operators[1]), sort_keys=False),
            "mcp-preview.yaml": MCP_PREVIEW_HEADER + kustomize.dump(mcp),
        }
    files["monitoring.yaml"] = MONITORING_HEADER + kustomize.dump(monitors(objects))
    files["prometheus-kubernetes.yml"] = PROMETHEUS_HEADER + yaml.safe_dump(
        {"scrape_configs": scrape_configs(objects)}, sort_keys=False)
    for name, text in files.items():
        (out_dir / name).write_text(text)
    return [out_dir / name for name in files]


def monitors(objects: list[Obj]) -> list[Obj]:
    """PodMonitors for what the rendered manifests run (the cached pods as the control plane selects them)."""
    namespace = next(o["metadata"]["name"] for o in objects if o["kind"] == "Namespace")
    return monitoring.pod_monitors(namespace, workloads_from_env(control_plane_env(objects)), own_engine(objects))


def scrape_configs(objects: list[Obj]) -> list[Obj]:
    """Prometheus scrape jobs (Kubernetes pod discovery) for what the rendered manifests run."""
    return monitoring.kubernetes_scrape_configs(workloads_from_env(control_plane_env(objects)), own_engine(objects))


PROMETHEUS_HEADER = """\
# Without the Prometheus Operator: scrape_configs for your Prometheus (Kubernetes pod discovery),
# the same jobs and relabelling as monitoring.yaml's PodMonitors, the sidecar job keeping the pods
# --engine-selector picks (deploy/README.md). Not a Kubernetes object: not for kubectl apply.
"""
MONITORING_HEADER = """\
# For the Prometheus Operator (its CRDs must be installed): PodMonitors for the cached pods' sidecars
# (the filter's stats on Envoy's :15090), the control plane and meshcache's engine, with one `model`
# label for filter and engine metrics (deploy/README.md). Your Prometheus selects them by its
# podMonitorSelector; the control plane's NetworkPolicy must admit it to port 8080.
"""
NAMESPACE_HEADER = """\
# The namespace alone (also first in meshcache-istio.yaml): applied before the Secrets that live in it.
"""
MCP_PREVIEW_HEADER = """\
# What the control plane serves istiod over MCP for the rendered policy snapshot (it re-sends the
# current one on every change). For review and `meshcache istio validate`; do not also apply it
# with kubectl next to the MCP source, or two cache filters run.
"""
KUBE_PREVIEW_HEADER = """\
# What the control plane writes to the API server for the rendered policy snapshot (delivery kube:
# server-side apply, field manager meshcache-control-plane; it rewrites them on every change and
# deletes those it no longer serves). For review and `meshcache istio validate`; don't apply it
# yourself: an object of the same name that the control plane did not create is left alone and
# reported, not taken over.
"""
EXISTING_OPERATOR_HEADER = """\
# An existing Istio installed with istioctl: an overlay that only adds meshcache's config source.
#   istioctl install -f YOUR-ISTIO-OPERATOR.yaml -f istio-operator-existing.yaml
# (your own file first: this one adds to it). configSources replaces the default list, so k8s:// is
# listed; if your file already sets configSources, copy your entries here too (lists are replaced).
"""
HELM_VALUES_HEADER = """\
# An existing Istio installed with Helm: values for the `istiod` chart that only add meshcache's
# config source to the mesh config.
#   helm upgrade istiod istio/istiod -n istio-system --version <YOUR ISTIOD CHART VERSION> \\
#     --reuse-values -f istiod-values.yaml
# --version: the chart version you run now (`helm -n istio-system list`), or helm takes the newest;
# a revisioned release (istiod-1-30) is upgraded by its own name. Preview first (docs/istio.md,
# "Install with Helm"). configSources replaces the default list, so k8s:// is listed.
"""


def existing_operator(step2: Obj) -> Obj:
    """An IstioOperator overlay with step 2's meshConfig only (configSources, and meshMTLS when
    --mesh-tls13): no profile, no components, nothing else of an existing install changes."""
    return {"apiVersion": step2["apiVersion"], "kind": "IstioOperator",
            "metadata": {"name": step2["metadata"]["name"], "namespace": step2["metadata"]["namespace"]},
            "spec": {"meshConfig": yaml.safe_load(yaml.safe_dump(step2["spec"]["meshConfig"]))}}


def istiod_values(step2: Obj) -> Obj:
    """The same meshConfig as Helm values of the istiod chart (`meshConfig:` is merged into the mesh
    config the chart renders)."""
    return {"meshConfig": yaml.safe_load(yaml.safe_dump(step2["spec"]["meshConfig"]))}


def install_steps(opts: RenderOptions, out_dir: Path) -> str:
    ns = opts.namespace
    if opts.delivery == "kube":
        return f"""next steps, top to bottom (docs/istio.md; delivery kube: istiod is not reconfigured):
  1. Istio, as you run it (fresh: istioctl install -f {out_dir}/istio-operator.yaml)
  2. kubectl apply -f {out_dir}/namespace.yaml
  3. meshcache istio xds-certs --namespace {ns} --out certs/   # then the two kubectl commands it prints
     kubectl -n {ns} create secret generic meshcache-cp-tokens --from-file=tokens=tokens.txt
  4. kubectl apply -f {out_dir}/meshcache-istio.yaml   # with the control plane's Role and RoleBinding
     kubectl -n {ns} rollout status deploy/{CONTROL_PLANE}
     kubectl apply -f {out_dir}/monitoring.yaml   # with the Prometheus Operator only
  5. after the first policy: kubectl -n {ns} get {_kube_plural(opts)} -l app.kubernetes.io/managed-by={CONTROL_PLANE}
"""
    return f"""next steps, top to bottom (docs/istio.md):
  1. Istio without the MCP source:
       fresh:    istioctl install -f {out_dir}/istio-operator.yaml
       existing: nothing yet (your istiod keeps running as it is)
  2. kubectl apply -f {out_dir}/namespace.yaml
  3. meshcache istio xds-certs --namespace {ns} --out certs/   # then the two kubectl commands it prints
     kubectl -n {ns} create secret generic meshcache-cp-tokens --from-file=tokens=tokens.txt
  4. kubectl apply -f {out_dir}/meshcache-istio.yaml
     kubectl -n {ns} rollout status deploy/{CONTROL_PLANE}
     kubectl apply -f {out_dir}/monitoring.yaml   # with the Prometheus Operator only
  5. istiod also reads the control plane:
       fresh:    istioctl install -f {out_dir}/istio-operator-mcp.yaml
       istioctl: istioctl install -f YOUR-ISTIO-OPERATOR.yaml -f {out_dir}/istio-operator-existing.yaml
       Helm:     helm upgrade istiod istio/istiod -n istio-system --version <your istiod chart version> \
                   --reuse-values -f {out_dir}/istiod-values.yaml   # preview: docs/istio.md "Install with Helm"
"""


def _kube_plural(opts: RenderOptions) -> str:
    objects = kustomize.build(opts.source)
    mode = control_plane_env(objects).get("MESHCACHE_CP_ISTIO_MODE", "full")
    return extensions.KUBE_RESOURCES[extensions.MODE_KIND[mode]].plural


def mesh_changes(opts: RenderOptions) -> str:
    """Every mesh-wide change the install files make, in plain words."""
    if opts.delivery == "kube":
        return (f"mesh-wide changes: none. istiod's configuration is not touched (no configSources entry): the "
                f"control plane writes its {_kube_plural(opts)} into namespace {opts.namespace} through the API "
                f"server (Role {WRITER_ROLE}: those objects in that namespace only), and istiod reads them as any "
                "Istio config.\n")
    xds = f"xds://{CONTROL_PLANE}.{opts.namespace}.svc.cluster.local:18000"
    lines = [
        "mesh-wide changes (everything else stays as your Istio has it):",
        f"  - meshConfig.configSources: istiod also reads {xds} (TLS, CA from the Secret "
        "istio-system/meshcache-cp-xds-ca). The list replaces Istio's default, so k8s:// is listed too.",
        "    istiod waits for every config source to sync before it serves xDS or sidecar injection, and exits if it "
        "cannot reach one at start: while no control-plane replica is ready, a restarting istiod does not serve "
        "(the manifests keep one ready: probes through the xDS path, PodDisruptionBudget, anti-affinity, priority "
        "class, surge-only rollouts).",
    ]
    if opts.mesh_tls13:
        lines.append("  - meshConfig.meshMTLS.minProtocolVersion: TLSV1_3 (--mesh-tls13): every sidecar's mTLS, "
                     "mesh-wide, refuses TLS 1.2.")
    else:
        lines.append("  - no TLS change (mesh-wide TLS 1.3 only with --mesh-tls13).")
    lines.append(f"  namespace {opts.namespace} only: the manifests in meshcache-istio.yaml (see docs/istio.md).")
    return "\n".join(lines) + "\n"


def update_base(module_path: Path = FILTER_WASM) -> list[Path]:
    """Re-pin the committed base to the built module (after the filter changed)."""
    pins = pins_for(RenderOptions(module_path=module_path))
    path = BASE_DIR / "control-plane.yaml"
    text = re.sub(r"@sha256:[a-f0-9]{64}", f"@sha256:{pins.image_digest}", path.read_text())
    text = re.sub(r"(MESHCACHE_CP_ISTIO_WASM_SHA256\n\s+value: )[a-f0-9]{64}", rf"\g<1>{pins.image_digest}", text)
    path.write_text(text)
    # The chart's default pin is the base's (tests/istio/test_helm.py).
    chart_values = REPO_ROOT / "charts" / "meshcache" / "values.yaml"
    chart_text = re.sub(r"(\n  digest: )[a-f0-9]{64}", rf"\g<1>{pins.image_digest}", chart_values.read_text())
    chart_values.write_text(chart_text)
    return [path, chart_values]
