"""`meshcache istio render`: the kustomize build of istio/ customised for a namespace, a traffic
colour, the current policy snapshot and the built filter module.

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

from control_plane.models import Policy
from control_plane.snapshots import Snapshot
from meshcache.paths import FILTER_WASM, REPO_ROOT

from . import kustomize, oci
from .wasmplugin import oci_url, wasm_plugin_spec  # noqa: F401 - re-exported

ISTIO_DIR = REPO_ROOT / "istio"
BASE_DIR = ISTIO_DIR / "base"
OPERATOR_FILE = ISTIO_DIR / "install" / "istio-operator.yaml"
BASE_NAMESPACE = "meshcache"
BASE_COLOR = "blue"
FILTER_REPOSITORY = "registry.example.com/meshcache/filter"
ENGINE_APP = "meshcache-engine"
MODULE_ANNOTATION = "meshcache.io/module-sha256"
COLOR_RE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,30}[a-z0-9])?$")
Obj = dict[str, Any]


def demo_plugin_config() -> dict[str, Any]:
    """The demo models' policies, as a snapshot would render them (no control plane needed)."""
    policies = (
        Policy(model_prefix="mlp-classifier", ttl_s=300, max_ttl_s=1800, generation=1),
        Policy(model_prefix="resnet-mini", ttl_s=300, max_ttl_s=1800, generation=1),
        Policy(model_prefix="text-embedder", ttl_s=600, max_ttl_s=3600, generation=1),
    )
    return Snapshot(version=1, policies=policies, action="demo").plugin_config()


def plugin_config_from_file(path: Path) -> dict[str, Any]:
    """A snapshot JSON file: the API's `GET /v1/snapshot` body, or a stored snapshot record."""
    data = json.loads(Path(path).read_text())
    if isinstance(data, dict) and isinstance(data.get("plugin_config"), str):
        return json.loads(data["plugin_config"])  # type: ignore[no-any-return]
    return Snapshot.from_record(json.dumps(data)).plugin_config()


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


def render_operator(opts: RenderOptions) -> Obj:
    obj = kustomize._load(OPERATOR_FILE)[0]
    _rename_namespace(obj, opts.namespace)
    return obj


# ---- the customisations -----------------------------------------------------------------


def customize(objects: list[Obj], opts: RenderOptions, pins: Pins) -> None:
    for obj in objects:
        _rename_namespace(obj, opts.namespace)
        kind, name = obj["kind"], obj["metadata"]["name"]
        if kind == "Deployment" and obj["metadata"].get("labels", {}).get("app") == ENGINE_APP:
            _engine_deployment(obj, opts.color, pins)
        elif kind == "Deployment" and name == "meshcache-control-plane":
            _control_plane(obj, opts.color, pins)
        elif kind == "WasmPlugin":
            _wasm_plugin(obj, opts, pins)
        elif kind == "DestinationRule" and obj["spec"]["host"] == ENGINE_APP:
            obj["spec"]["subsets"] = [{"name": c, "labels": {"color": c}} for c in opts.colors()]
        elif kind == "VirtualService" and name == ENGINE_APP:
            obj["spec"]["http"] = virtual_service_routes(opts.colors(), opts.color)


def _rename_namespace(obj: Obj, namespace: str) -> None:
    """Namespace in metadata, and in the strings that embed it (principals, FQDNs, selectors)."""
    if namespace == BASE_NAMESPACE:
        return
    meta = obj["metadata"]
    if obj["kind"] == "Namespace":
        meta["name"] = namespace
    elif "namespace" in meta:
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


def _engine_deployment(obj: Obj, color: str, pins: Pins) -> None:
    obj["metadata"]["name"] = f"{ENGINE_APP}-{color}"
    obj["metadata"]["labels"]["color"] = color
    obj["spec"]["selector"]["matchLabels"]["color"] = color
    tmpl = obj["spec"]["template"]["metadata"]
    tmpl["labels"] |= {"color": color, "version": color}
    ann = tmpl["annotations"]
    proxy = yaml.safe_load(ann["proxy.istio.io/config"])
    proxy["proxyMetadata"] |= {"MESHCACHE_TRAFFIC_COLOR": color, "ISTIO_META_MESHCACHE_TRAFFIC_COLOR": color}
    ann["proxy.istio.io/config"] = yaml.safe_dump(proxy, sort_keys=False)
    volumes = json.loads(ann["sidecar.istio.io/userVolume"])
    for v in volumes:
        if "image" in v:
            v["image"]["reference"] = pins.url.removeprefix("oci://")
    ann["sidecar.istio.io/userVolume"] = json.dumps(volumes, separators=(",", ":"))
    ann[MODULE_ANNOTATION] = pins.module_sha256


def _set_env(container: Obj, name: str, value: str) -> None:
    for e in container.get("env", []):
        if e["name"] == name:
            e["value"] = value


def _control_plane(obj: Obj, color: str, pins: Pins) -> None:
    for c in obj["spec"]["template"]["spec"]["containers"]:
        _set_env(c, "MESHCACHE_CP_ISTIO_COLOR", color)
        _set_env(c, "MESHCACHE_CP_ISTIO_WASM_URL", pins.url)
        _set_env(c, "MESHCACHE_CP_ISTIO_WASM_SHA256", pins.image_digest)


def _wasm_plugin(obj: Obj, opts: RenderOptions, pins: Pins) -> None:
    obj["metadata"]["name"] = f"meshcache-{opts.color}"
    obj["metadata"].setdefault("annotations", {})[MODULE_ANNOTATION] = pins.module_sha256
    selector = {**obj["spec"].get("selector", {}).get("matchLabels", {}), "color": opts.color}
    obj["spec"] = wasm_plugin_spec(url=pins.url, sha256=pins.image_digest, selector=selector,
                                   plugin_config={**opts.plugin_config, "color": opts.color},
                                   pull_secret=obj["spec"].get("imagePullSecret", ""))


def virtual_service_routes(colors: Iterable[str], default: str) -> list[Obj]:
    def dest(c: str) -> list[Obj]:
        return [{"destination": {"host": ENGINE_APP, "subset": c}}]
    routes = [{"name": f"color-{c}", "match": [{"headers": {"x-traffic-color": {"exact": c}}}], "route": dest(c)}
              for c in colors]
    return [*routes, {"name": "default", "route": dest(default)}]


# ---- output -----------------------------------------------------------------------------


def write(objects: list[Obj], operator: Obj, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    manifests = out_dir / "meshcache-istio.yaml"
    manifests.write_text(kustomize.dump(objects))
    op = out_dir / "istio-operator.yaml"
    op.write_text(yaml.safe_dump(operator, sort_keys=False))
    return [manifests, op]


WASMPLUGIN_HEADER = """\
# Generated by `meshcache istio render --update-base` (tests/istio check it is current).
# phase STATS + priority -100: after Istio authn/authz (the cache must never answer a request the
# AuthorizationPolicy denies) and after other STATS plugins; see meshcache/istio/wasmplugin.py.
# sha256 is the OCI *image manifest* digest (what Istio verifies for oci:// URLs), pinned in the URL
# too; the module's own sha256 is the annotation (and the image's only layer holds exactly it).
"""


def update_base(module_path: Path = FILTER_WASM) -> list[Path]:
    """Re-pin the committed base to the built module (after the filter changed)."""
    opts = RenderOptions(module_path=module_path)
    pins = pins_for(opts)
    plugin = kustomize._load(BASE_DIR / "wasmplugin.yaml")[0]
    _wasm_plugin(plugin, opts, pins)
    (BASE_DIR / "wasmplugin.yaml").write_text(WASMPLUGIN_HEADER + yaml.safe_dump(plugin, sort_keys=False, width=120))
    changed = [BASE_DIR / "wasmplugin.yaml"]
    for name in ("engine.yaml", "control-plane.yaml"):
        path = BASE_DIR / name
        text = re.sub(r"@sha256:[a-f0-9]{64}", f"@sha256:{pins.image_digest}", path.read_text())
        text = re.sub(r"(MESHCACHE_CP_ISTIO_WASM_SHA256\n\s+value: )[a-f0-9]{64}", rf"\g<1>{pins.image_digest}", text)
        text = re.sub(rf"({re.escape(MODULE_ANNOTATION)}: )[a-f0-9]{{64}}", rf"\g<1>{pins.module_sha256}", text)
        path.write_text(text)
        changed.append(path)
    return changed

