"""Cluster DNS for the test kubelet's pods, as /etc/hosts: what a cluster DNS server answers for
Services, written into each pod's hosts file (`ip netns exec` bind-mounts it over /etc/hosts):

- a ClusterIP Service: its clusterIP, named `svc.ns.svc.cluster.local`, `svc.ns.svc`, `svc.ns`,
  and `svc` for pods of the same namespace (the search path);
- a headless Service: the addresses of its ready endpoints (EndpointSlices), under the same names.

Not done: SRV records, per-pod StatefulSet names (`pod.svc.ns.svc...`), ExternalName. No
kube-proxy runs: a ClusterIP carries traffic only through a pod's sidecar (Istio routes by it),
and, from the host, through the service proxy (services.py) where the mesh runs one.
"""

from __future__ import annotations

from typing import Any

Obj = dict[str, Any]
DOMAIN = "cluster.local"


def service_names(name: str, namespace: str, pod_namespace: str) -> list[str]:
    names = [f"{name}.{namespace}.svc.{DOMAIN}", f"{name}.{namespace}.svc", f"{name}.{namespace}"]
    return names + [name] if namespace == pod_namespace else names


def ready_addresses(slices: list[Obj]) -> dict[tuple[str, str], list[str]]:
    """(namespace, service) -> the ready endpoint addresses of its EndpointSlices."""
    out: dict[tuple[str, str], list[str]] = {}
    for s in slices:
        service = s["metadata"].get("labels", {}).get("kubernetes.io/service-name")
        if not service:
            continue
        addresses = out.setdefault((s["metadata"]["namespace"], service), [])
        for endpoint in s.get("endpoints") or []:
            if (endpoint.get("conditions") or {}).get("ready", True):
                addresses += [a for a in endpoint["addresses"] if a not in addresses]
    return out


def hosts_lines(services: list[Obj], slices: list[Obj], pod_namespace: str) -> list[str]:
    """The /etc/hosts lines that name every Service for a pod of `pod_namespace`."""
    endpoints = ready_addresses(slices)
    lines: list[str] = []
    for svc in sorted(services, key=lambda s: (s["metadata"]["namespace"], s["metadata"]["name"])):
        meta, spec = svc["metadata"], svc["spec"]
        names = " ".join(service_names(meta["name"], meta["namespace"], pod_namespace))
        if spec.get("type") == "ExternalName":
            continue
        if spec.get("clusterIP") in (None, "", "None"):
            lines += [f"{ip} {names}" for ip in endpoints.get((meta["namespace"], meta["name"]), [])]
        else:
            lines.append(f"{spec['clusterIP']} {names}")
    return lines
