"""Cross-reference checks over a set of manifests: what schemas cannot see but a broken rollout
would (a subset nobody matches, a policy selecting no pod, a digest that is not the module's).

Each check returns human-readable errors; `check_all` runs them all. `Pins` (from render.py)
carry the expected image digest and module sha256 for the built module.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import yaml

from meshcache.wasm_filter import ROOT_ID, STUB_ROLE_CONFIG

from .envoyfilter import STUB_LISTENER
from .oci import WASM_FILE_IN_IMAGE
from .validate import validate_object

Obj = dict[str, Any]
WORKLOAD_KINDS = ("Deployment", "StatefulSet")
PRINCIPAL_RE = re.compile(r"^cluster\.local/ns/([a-z0-9-]+)/sa/([a-z0-9-]+)$")
# Secrets the operator creates (docs/istio.md); everything else must be in the manifests.
EXTERNAL_SECRETS = {"meshcache-cp-tokens", "meshcache-redis-url"}


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


def check_workloads(objects: list[Obj]) -> list[str]:
    errors = []
    accounts = {_name(o) for o in _of(objects, "ServiceAccount")}
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
        for port in svc["spec"]["ports"]:
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
    for vs in _of(objects, "VirtualService"):
        for host in vs["spec"]["hosts"]:
            if _service_for_host(objects, host) is None:
                errors.append(f"VirtualService/{_name(vs)}: host {host!r} is no Service here")
        for route in vs["spec"].get("http", []):
            for r in route.get("route", []):
                d = r["destination"]
                short = d["host"].split(".")[0]
                if "subset" in d and d["subset"] not in subsets.get(short, set()):
                    errors.append(f"VirtualService/{_name(vs)}: route {route.get('name')!r} uses subset "
                                  f"{d['subset']!r} that no DestinationRule for {short!r} defines")
    return errors


def check_security(objects: list[Obj]) -> list[str]:
    errors = []
    namespaces = {o["metadata"].get("namespace") for o in objects} - {None}
    accounts = {_name(o) for o in _of(objects, "ServiceAccount")}
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
        for rule in pol["spec"].get("rules", []):
            for to in rule.get("to", []):
                for p in to["operation"].get("ports", []):
                    if int(p) not in ports:
                        errors.append(f"{where}: port {p} is no container port of the selected pods")
            for src in rule.get("from", []):
                for principal in src["source"].get("principals", []):
                    m = PRINCIPAL_RE.match(principal)
                    if not m:
                        errors.append(f"{where}: principal {principal!r} is not cluster.local/ns/<ns>/sa/<sa>")
                    elif m.group(1) in namespaces and m.group(2) not in accounts:
                        errors.append(f"{where}: principal {principal!r} names no ServiceAccount defined here")
    for np in _of(objects, "NetworkPolicy"):
        if not _selected(objects, np["spec"]["podSelector"].get("matchLabels", {})):
            errors.append(f"NetworkPolicy/{_name(np)}: podSelector matches no workload")
    return errors


def _annotation_volumes(w: Obj) -> tuple[list[Obj], list[Obj]]:
    ann = w["spec"]["template"]["metadata"].get("annotations", {})
    return (json.loads(ann.get("sidecar.istio.io/userVolume", "[]")),
            json.loads(ann.get("sidecar.istio.io/userVolumeMount", "[]")))


def check_sidecar_annotations(objects: list[Obj]) -> list[str]:
    """Annotations are opaque strings to the API server but must parse for the injector."""
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
        volumes, mounts = _annotation_volumes(w)
        if volumes or mounts:
            pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "injected"}, "spec": {
                "volumes": volumes,
                "containers": [{"name": "istio-proxy", "image": "proxyv2", "volumeMounts": mounts}]}}
            errors += [f"{where}: sidecar.istio.io/userVolume(Mount): {e}" for e in validate_object(pod)]
            if {m["name"] for m in mounts} - {v["name"] for v in volumes}:
                errors.append(f"{where}: userVolumeMount names a volume userVolume does not define")
    return errors


def check_module(objects: list[Obj], image_digest: str, module_sha256: str) -> list[str]:
    """The WasmPlugin, the image volume and the control plane all pin the built module."""
    errors = []
    for wp in _of(objects, "WasmPlugin"):
        where = f"WasmPlugin/{_name(wp)}"
        spec = wp["spec"]
        if spec.get("sha256") != image_digest:
            errors.append(f"{where}: sha256 {spec.get('sha256')!r} is not the built module's image digest "
                          f"{image_digest} (run `meshcache istio render --update-base` after a filter build)")
        if not spec["url"].startswith("oci://") or not spec["url"].endswith(f"@sha256:{image_digest}"):
            errors.append(f"{where}: url {spec['url']!r} is not oci:// pinned to @sha256:{image_digest}")
        if wp["metadata"].get("annotations", {}).get("meshcache.io/module-sha256") != module_sha256:
            errors.append(f"{where}: module-sha256 annotation is not the built module's sha256 {module_sha256}")
        if spec.get("pluginName") != ROOT_ID:
            errors.append(f"{where}: pluginName must be the filter's root id {ROOT_ID!r}")
        selected = _selected(objects, spec.get("selector", {}).get("matchLabels", {}))
        if not selected:
            errors.append(f"{where}: selector matches no workload")
        ports = set().union(*(_container_ports(w) for w in selected)) if selected else set()
        for m in spec.get("match", []):
            errors += [f"{where}: match port {p['number']} is no container port of the selected pods"
                       for p in m.get("ports", []) if p["number"] not in ports]
        color = spec["pluginConfig"].get("color")
        if any(_pod_labels(w).get("color") != color for w in selected):
            errors.append(f"{where}: pluginConfig.color {color!r} differs from the selected pods' colour")
    for w in _workloads(objects):
        volumes, _ = _annotation_volumes(w)
        for v in volumes:
            ref = v.get("image", {}).get("reference")
            if ref and not ref.endswith(f"@sha256:{image_digest}"):
                errors.append(f"{w['kind']}/{_name(w)}: image volume {ref!r} is not the built module's image")
        for c in w["spec"]["template"]["spec"]["containers"]:
            env = {e["name"]: e.get("value") for e in c.get("env", [])}
            if "MESHCACHE_CP_ISTIO_WASM_SHA256" in env and env["MESHCACHE_CP_ISTIO_WASM_SHA256"] != image_digest:
                errors.append(f"{w['kind']}/{_name(w)}: MESHCACHE_CP_ISTIO_WASM_SHA256 is not {image_digest}")
    return errors


def check_envoy_filters(objects: list[Obj]) -> list[str]:
    errors = []
    for ef in _of(objects, "EnvoyFilter"):
        where = f"EnvoyFilter/{_name(ef)}"
        selected = _selected(objects, ef["spec"].get("workloadSelector", {}).get("labels", {}))
        if not selected:
            errors.append(f"{where}: workloadSelector matches no workload")
            continue
        mounts = {m["mountPath"] for w in selected for m in _annotation_volumes(w)[1]}
        ports = set().union(*(_container_ports(w) for w in selected))
        clusters = {p["patch"]["value"]["name"] for p in ef["spec"]["configPatches"] if p["applyTo"] == "CLUSTER"}
        for p in ef["spec"]["configPatches"]:
            match, value = p.get("match", {}), p["patch"].get("value", {})
            port = match.get("listener", match.get("routeConfiguration", {})).get("portNumber")
            if port is not None and port not in ports:
                errors.append(f"{where}: patch {p['applyTo']} matches port {port}, no container port of the pods")
            for key, v in _walk(value):
                if key == "filename" and str(v).rsplit("/", 1)[0] not in mounts:
                    errors.append(f"{where}: module {v!r} is not under a mounted path {sorted(mounts)}")
                if key == "filename" and not str(v).endswith(WASM_FILE_IN_IMAGE):
                    errors.append(f"{where}: module {v!r} is not the image's {WASM_FILE_IN_IMAGE}")
            if p["applyTo"] == "LISTENER" and value.get("name") == STUB_LISTENER:
                cfgs = [v for k, v in _walk(value) if k == "configuration"]
                if not cfgs or json.loads(cfgs[0]["value"]) != STUB_ROLE_CONFIG:
                    errors.append(f"{where}: the stub listener's plugin configuration must be {STUB_ROLE_CONFIG}")
            if p["applyTo"] == "HTTP_ROUTE" and value["route"]["cluster"] not in clusters:
                errors.append(f"{where}: hit route targets cluster {value['route']['cluster']!r} not added here")
    return errors


def check_all(objects: list[Obj], image_digest: str, module_sha256: str,
              elsewhere: frozenset[str] = frozenset()) -> list[str]:
    return (check_workloads(objects) + check_traffic(objects, elsewhere) + check_security(objects)
            + check_sidecar_annotations(objects) + check_module(objects, image_digest, module_sha256)
            + check_envoy_filters(objects))
