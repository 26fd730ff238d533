"""`meshcache istio render`: the kustomize build of istio/ customised for a namespace, traffic
colours and the built filter module; the two IstioOperator steps; and a preview of what the control
plane serves istiod over MCP for a policy snapshot (the same builders, meshcache/contract/extensions.py).

The committed base (namespace `meshcache`, colour `blue`, demo policies, the module built at
commit time) is a fixed point of this function: rendering it with the defaults gives it back, so
the committed files and the renderer cannot drift apart unnoticed (tests/istio).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from meshcache.contract import extensions, oci
from meshcache.contract.extensions import oci_url
from meshcache.contract.filter_config import Limits, Policy, demo_policies, plugin_config
from meshcache.contract.headers import COLOR_HEADER
from meshcache.contract.paths import FILTER_WASM, REPO_ROOT

from . import kustomize

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
COLOR_RE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,30}[a-z0-9])?$")
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


@dataclass
class RenderOptions:
    namespace: str = BASE_NAMESPACE
    color: str = BASE_COLOR
    also_colors: tuple[str, ...] = ()  # colours already live: keep their subsets and routes
    plugin_config: dict[str, Any] = field(default_factory=demo_plugin_config)
    module_path: Path = FILTER_WASM
    image_digest: str | None = None  # manifest digest of the pushed image, if not ours
    filter_repository: str = FILTER_REPOSITORY
    source: Path = BASE_DIR  # the base or an overlay directory
    ingress_host: str = INGRESS_HOST

    def colors(self) -> list[str]:
        return [self.color, *[c for c in dict.fromkeys(self.also_colors) if c != self.color]]


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


def render(opts: RenderOptions) -> list[Obj]:
    for c in opts.colors():
        if not COLOR_RE.match(c):
            raise ValueError(f"colour {c!r} must be a DNS label of at most 32 characters")
    objects = kustomize.build(opts.source)
    customize(objects, opts, pins_for(opts))
    return objects


def render_operators(opts: RenderOptions) -> tuple[Obj, Obj]:
    """(step 1, step 2): Istio without, then with, the control plane as an MCP source."""
    out = []
    for path in (OPERATOR_FILE, OPERATOR_MCP_FILE):
        obj = kustomize._load(path)[0]
        _rename_namespace(obj, opts.namespace)
        out.append(obj)
    return out[0], out[1]


def control_plane_env(objects: list[Obj]) -> dict[str, str]:
    dep = next(o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == CONTROL_PLANE)
    container = dep["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def mcp_objects(objects: list[Obj], plugin_config: dict[str, Any]) -> list[Obj]:
    """What the rendered control plane serves istiod over MCP for this policy snapshot (its mode,
    colours and module pin come from the Deployment's environment), with the namespace set."""
    env = control_plane_env(objects)
    namespace = next(o["metadata"]["name"] for o in objects if o["kind"] == "Namespace")
    colors = [c for c in env.get("MESHCACHE_CP_ISTIO_COLOR", "").split(",") if c] or [""]
    out = extensions.objects(env.get("MESHCACHE_CP_ISTIO_MODE", "full"), colors=colors,
                             url=env["MESHCACHE_CP_ISTIO_WASM_URL"], sha256=env["MESHCACHE_CP_ISTIO_WASM_SHA256"],
                             plugin_config=plugin_config)
    for o in out:
        o["metadata"]["namespace"] = namespace
        if env.get("MESHCACHE_CP_ISTIO_REVISION"):
            o["metadata"]["labels"] = {"istio.io/rev": env["MESHCACHE_CP_ISTIO_REVISION"]}
    return out


# ---- the customisations -----------------------------------------------------------------


def customize(objects: list[Obj], opts: RenderOptions, pins: Pins) -> None:
    for obj in objects:
        _rename_namespace(obj, opts.namespace)
        kind, name = obj["kind"], obj["metadata"]["name"]
        if kind == "Deployment" and obj["metadata"].get("labels", {}).get("app") == ENGINE_APP:
            _engine_deployment(obj, opts.color)
        elif kind == "Deployment" and name == CONTROL_PLANE:
            _control_plane(obj, opts.colors(), pins)
        elif kind == "DestinationRule" and obj["spec"]["host"] == ENGINE_APP:
            obj["spec"]["subsets"] = [{"name": c, "labels": {"color": c},
                                       "trafficPolicy": {"loadBalancer": extensions.consistent_hash()}}
                                      for c in opts.colors()]
        elif kind == "VirtualService" and obj["spec"].get("gateways"):
            obj["spec"]["hosts"] = [opts.ingress_host]
            obj["spec"]["http"] = virtual_service_routes(opts.colors(), opts.color, gateway=True)
        elif kind == "VirtualService" and name == ENGINE_APP:
            obj["spec"]["http"] = virtual_service_routes(opts.colors(), opts.color)
        elif kind == "Gateway":
            for server in obj["spec"]["servers"]:
                server["hosts"] = [opts.ingress_host]


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


def _engine_deployment(obj: Obj, color: str) -> None:
    obj["metadata"]["name"] = f"{ENGINE_APP}-{color}"
    obj["metadata"]["labels"]["color"] = color
    obj["spec"]["selector"]["matchLabels"]["color"] = color
    tmpl = obj["spec"]["template"]["metadata"]
    tmpl["labels"] |= {"color": color, "version": color}
    ann = tmpl["annotations"]
    proxy = yaml.safe_load(ann["proxy.istio.io/config"])
    proxy["proxyMetadata"] |= {"MESHCACHE_TRAFFIC_COLOR": color, "ISTIO_META_MESHCACHE_TRAFFIC_COLOR": color}
    ann["proxy.istio.io/config"] = yaml.safe_dump(proxy, sort_keys=False)


def _set_env(container: Obj, name: str, value: str) -> None:
    for e in container.get("env", []):
        if e["name"] == name:
            e["value"] = value


def _control_plane(obj: Obj, colors: list[str], pins: Pins) -> None:
    for c in obj["spec"]["template"]["spec"]["containers"]:
        _set_env(c, "MESHCACHE_CP_ISTIO_COLOR", ",".join(colors))
        _set_env(c, "MESHCACHE_CP_ISTIO_WASM_URL", pins.url)
        _set_env(c, "MESHCACHE_CP_ISTIO_WASM_SHA256", pins.image_digest)


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
    return routes


# ---- output -----------------------------------------------------------------------------


def write(objects: list[Obj], operators: tuple[Obj, Obj], mcp: list[Obj], out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {
        "meshcache-istio.yaml": kustomize.dump(objects),
        "istio-operator.yaml": yaml.safe_dump(operators[0], sort_keys=False),
        "istio-operator-mcp.yaml": yaml.safe_dump(operators[1], sort_keys=False),
        "mcp-preview.yaml": MCP_PREVIEW_HEADER + kustomize.dump(mcp),
    }
    for name, text in files.items():
        (out_dir / name).write_text(text)
    return [out_dir / name for name in files]


MCP_PREVIEW_HEADER = """\
# What the control plane serves istiod over MCP for the rendered policy snapshot (it re-sends the
# current one on every change). For review and `meshcache istio validate`; do not also apply it
# with kubectl next to the MCP source, or two cache filters run.
"""


def install_steps(opts: RenderOptions, out_dir: Path) -> str:
    ns = opts.namespace
    return f"""next steps (docs/istio.md):
  1. istioctl install -f {out_dir}/istio-operator.yaml        # Istio without the MCP source
  2. meshcache istio xds-certs --namespace {ns} --out certs/   # then the two kubectl commands it prints
     kubectl -n {ns} create secret generic meshcache-cp-tokens --from-file=tokens=tokens.txt
  3. kubectl apply -f {out_dir}/meshcache-istio.yaml
     kubectl -n {ns} rollout status deploy/{CONTROL_PLANE}
  4. istioctl install -f {out_dir}/istio-operator-mcp.yaml    # istiod now also reads the control plane
"""


def update_base(module_path: Path = FILTER_WASM) -> list[Path]:
    """Re-pin the committed base to the built module (after the filter changed)."""
    pins = pins_for(RenderOptions(module_path=module_path))
    path = BASE_DIR / "control-plane.yaml"
    text = re.sub(r"@sha256:[a-f0-9]{64}", f"@sha256:{pins.image_digest}", path.read_text())
    text = re.sub(r"(MESHCACHE_CP_ISTIO_WASM_SHA256\n\s+value: )[a-f0-9]{64}", rf"\g<1>{pins.image_digest}", text)
    path.write_text(text)
    return [path]
