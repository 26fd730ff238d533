"""The rendered istio/ objects as istiod reads them without Kubernetes (its `fs://` config source).

In a cluster istiod learns services and pods from the Kubernetes registry. Here there is none
(`--registries=` empty), so each stands in as Istio's own kinds:
- a Service with a selector -> a ServiceEntry `<svc>.<ns>.svc.cluster.local` (MESH_INTERNAL,
  STATIC, `workloadSelector` = the Service's selector, ports with the Service's names and
  protocols, `targetPort` the container port);
- a Pod (a Deployment's template, placed by the caller: `Pod`) -> a WorkloadEntry (its IP, the
  template's labels, its service account);
- the Istio objects (PeerAuthentication, AuthorizationPolicy, DestinationRule, VirtualService,
  Gateway, ...) pass through as rendered.
What does not translate: Namespace (istiod has no namespace objects without Kubernetes),
ServiceAccount, Deployment/StatefulSet (their pods are `Pod`s), NetworkPolicy, headless Services
without ports (istiod builds nothing for them), Services of pods not placed here (the control
plane and Redis run outside the mesh, as in the cluster).

No iptables: the one addition. In a pod, istio-iptables redirects traffic into the sidecar. On one
machine without it, each pod gets a `Sidecar` resource (Istio's own API for sidecars without
traffic capture, `captureMode: NONE`) that makes its Envoy *bind* the ports: a server pod's
ingress ports on its own loopback IP (`127.x.y.z:8001` forwarded to where its app listens), a
calling pod's egress listeners on its IP (the app sends to `POD_IP:8001` instead of the Service
address). The sidecar stays in REDIRECT mode otherwise, so istiod builds the same inbound filter
chains, clusters and routes, and the EnvoyFilter from MCP patches them as in a cluster. Each pod
carries the label `meshcache.io/local-pod: <name>` so its Sidecar selects it alone.

The mesh config is the rendered IstioOperator's (`istio-operator-mcp.yaml`) with the cluster's
addresses replaced by local ones: `k8s://` -> `fs://DIR`; the control plane's Service name ->
127.0.0.1:PORT (the SNI and subject-alt-name check stay); `tlsSettings.credentialName` (a Secret
istiod reads from Kubernetes) -> `caCertificates`, the same CA inline.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

Obj = dict[str, Any]
DOMAIN = "cluster.local"
LOCAL_POD_LABEL = "meshcache.io/local-pod"
PASS_THROUGH_GROUPS = ("networking.istio.io", "security.istio.io", "telemetry.istio.io", "extensions.istio.io")
# Service port -> Istio protocol: appProtocol first, else the name prefix (Istio's own rule).
_PROTOCOLS = {"http": "HTTP", "http2": "HTTP2", "grpc": "GRPC", "https": "HTTPS", "tls": "TLS", "tcp": "TCP",
              "redis": "REDIS", "mongo": "MONGO", "mysql": "MYSQL"}


@dataclass(frozen=True)
class Pod:
    """One pod of a rendered workload, placed on this machine."""

    name: str
    namespace: str
    ip: str  # its own loopback address: what istiod knows it by (WorkloadEntry, node id)
    labels: dict[str, str]
    service_account: str
    container_ports: dict[str, int]  # name -> port, from the pod template
    # container port -> 127.0.0.1 port where the app really listens (Sidecar defaultEndpoint)
    app_ports: dict[int, int] = field(default_factory=dict)
    caller: bool = False  # binds egress listeners on its IP (it calls Services)

    @property
    def all_labels(self) -> dict[str, str]:
        return {**self.labels, LOCAL_POD_LABEL: self.name}

    @property
    def proxy_id(self) -> str:
        """istiod's proxy id (`/debug/config_dump?proxyID=`)."""
        return f"{self.name}.{self.namespace}"


def pod_from_template(workload: Obj, name: str, ip: str, app_ports: dict[int, int] | None = None,
                      caller: bool = False) -> Pod:
    """A pod of a rendered Deployment/StatefulSet: its template's labels, account and ports."""
    spec = workload["spec"]["template"]
    ports = {p["name"]: p["containerPort"] for c in spec["spec"]["containers"] for p in c.get("ports", [])
             if "name" in p}
    return Pod(name=name, namespace=workload["metadata"]["namespace"], ip=ip,
               labels=dict(spec["metadata"].get("labels", {})),
               service_account=spec["spec"].get("serviceAccountName", "default"),
               container_ports=ports, app_ports=dict(app_ports or {}), caller=caller)


def service_host(name: str, namespace: str) -> str:
    return f"{name}.{namespace}.svc.{DOMAIN}"


def _protocol(port: Obj) -> str:
    key = port.get("appProtocol") or port.get("name", "").split("-", 1)[0]
    return _PROTOCOLS.get(str(key).lower(), "TCP")


def _selects(selector: dict[str, str], pod: Pod) -> bool:
    return bool(selector) and all(pod.labels.get(k) == v for k, v in selector.items())


def _target_port(port: Obj, pods: list[Pod]) -> int:
    target = port.get("targetPort", port["port"])
    if isinstance(target, int):
        return target
    for pod in pods:
        if target in pod.container_ports:
            return pod.container_ports[target]
    raise ValueError(f"service port {port.get('name')}: targetPort {target!r} is no container port of its pods")


def service_entry(service: Obj, pods: list[Pod]) -> Obj:
    meta = service["metadata"]
    return {
        "apiVersion": "networking.istio.io/v1",
        "kind": "ServiceEntry",
        "metadata": {"name": meta["name"], "namespace": meta["namespace"], "labels": dict(meta.get("labels", {}))},
        "spec": {
            "hosts": [service_host(meta["name"], meta["namespace"])],
            "location": "MESH_INTERNAL",
            "resolution": "STATIC",
            "ports": [{"number": p["port"], "name": p["name"], "protocol": _protocol(p),
                       "targetPort": _target_port(p, pods)} for p in service["spec"]["ports"]],
            "workloadSelector": {"labels": dict(service["spec"]["selector"])},
        },
    }


def workload_entry(pod: Pod) -> Obj:
    return {
        "apiVersion": "networking.istio.io/v1",
        "kind": "WorkloadEntry",
        "metadata": {"name": pod.name, "namespace": pod.namespace},
        "spec": {"address": pod.ip, "labels": pod.all_labels, "serviceAccount": pod.service_account},
    }


def sidecar(pod: Pod, services: list[Obj]) -> Obj | None:
    """The no-iptables stand-in (module docstring): bound ingress and/or egress listeners."""
    spec: Obj = {"workloadSelector": {"labels": {LOCAL_POD_LABEL: pod.name}}}
    ingress = []
    for svc in services:
        if not _selects(svc["spec"].get("selector", {}), pod):
            continue
        for p in svc["spec"].get("ports", []):
            target = _target_port(p, [pod])
            if target not in pod.app_ports:
                raise ValueError(f"pod {pod.name}: no app port for container port {target} "
                                 f"(Service {svc['metadata']['name']})")
            ingress.append({"port": {"number": target, "protocol": _protocol(p), "name": p["name"]},
                            "bind": pod.ip, "captureMode": "NONE",
                            "defaultEndpoint": f"127.0.0.1:{pod.app_ports[target]}"})
    # The pod's other ports its app listens on (the engine's metrics): in a cluster iptables hands
    # them to the sidecar's inbound chain too, where the AuthorizationPolicy applies to them.
    served = {i["port"]["number"] for i in ingress}
    for name, number in sorted(pod.container_ports.items(), key=lambda kv: kv[1]):
        if number not in served and number in pod.app_ports:
            ingress.append({"port": {"number": number, "protocol": _protocol({"name": name}), "name": name},
                            "bind": pod.ip, "captureMode": "NONE",
                            "defaultEndpoint": f"127.0.0.1:{pod.app_ports[number]}"})
    if ingress:
        spec["ingress"] = ingress
    if pod.caller:
        spec["egress"] = [{"bind": pod.ip, "captureMode": "NONE", "hosts": ["*/*"]}]
    if len(spec) == 1:
        return None
    return {"apiVersion": "networking.istio.io/v1", "kind": "Sidecar",
            "metadata": {"name": pod.name, "namespace": pod.namespace}, "spec": spec}


def translate(objects: list[Obj], pods: list[Pod]) -> list[Obj]:
    """What istiod reads from `fs://` for the rendered `objects` with `pods` placed here."""
    services = [o for o in objects if o["kind"] == "Service" and o["spec"].get("selector")
                and o["spec"].get("ports") and any(_selects(o["spec"]["selector"], p) for p in pods)]
    out: list[Obj] = []
    for svc in services:
        out.append(service_entry(svc, [p for p in pods if _selects(svc["spec"]["selector"], p)]))
    for pod in pods:
        out.append(workload_entry(pod))
        sc = sidecar(pod, services)
        if sc is not None:
            out.append(sc)
    for obj in objects:
        group = obj.get("apiVersion", "").split("/", 1)[0]
        if group in PASS_THROUGH_GROUPS:
            out.append(copy.deepcopy(obj))
    return out


def write(objects: list[Obj], directory: Path) -> Path:
    """One file for istiod's file watcher (replaced atomically, so it never reads half of it)."""
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / ".meshcache.yaml.tmp"
    tmp.write_text(yaml.safe_dump_all(objects, sort_keys=False))
    tmp.replace(directory / "meshcache.yaml")
    return directory


def mesh_config(operator: Obj, fs_dir: Path, xds_port: int, xds_ca_pem: str) -> Obj:
    """The rendered operator's meshConfig with local addresses (module docstring)."""
    mesh = copy.deepcopy(operator["spec"]["meshConfig"])
    sources = []
    for source in mesh.get("configSources", []):
        address = source["address"]
        if address.startswith("k8s://"):
            sources.append({"address": f"fs://{fs_dir}"})
        elif address.startswith("xds://"):
            local = copy.deepcopy(source)
            local["address"] = f"xds://127.0.0.1:{xds_port}"
            tls = local.get("tlsSettings")
            if tls is not None and tls.pop("credentialName", None) is not None:
                tls["caCertificates"] = xds_ca_pem
            sources.append(local)
        else:
            raise ValueError(f"config source {address!r}: only k8s:// and xds:// are translated")
    mesh["configSources"] = sources
    return mesh
