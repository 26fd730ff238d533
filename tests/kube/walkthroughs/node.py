"""The node a walk-through runs on: a local cluster, the test node's network, the filter's
registry and the test kubelet; istiod as `istioctl install -f FILE...` would make it (the
project's kube istiod from the same IstioOperators, stopped and started again on a new install)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from meshcache.ctl.kube import istiod as kube_istiod
from meshcache.ctl.kube import kubelet as test_kubelet
from meshcache.ctl.kube import registry
from meshcache.ctl.kube.cluster import LocalCluster, start_cluster
from meshcache.ctl.kube.kubelet import RunningPod
from meshcache.ctl.kube.netns import NodeNetwork
from meshcache.ctl.kube.services import ServiceProxy
from tests.helpers.wait import eventually
from tests.kube.mesh.helpers import proxy_status
from tests.kube.walkthroughs.walk import Shell

Obj = dict[str, Any]


def merge(base: Obj, overlay: Obj) -> Obj:
    """istioctl's merge of `-f` files: maps merged key by key, lists and scalars replaced."""
    out = dict(base)
    for key, value in overlay.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


class WalkNode:
    """The cluster, node and registry of an empty cluster; istiod as the walk-through installs it."""

    def __init__(self, work: Path, module: Path) -> None:
        self.work = work
        self.module = module
        self.cluster: LocalCluster | None = None
        self.network: NodeNetwork | None = None
        self.kubelet: test_kubelet.TestKubelet | None = None
        self.istiod: kube_istiod.KubeIstiod | None = None
        self.cp_service: ServiceProxy | None = None
        self.procs: list = []
        self.operators: list[str] = []

    def start(self) -> None:
        self.cluster = start_cluster(self.work / "cluster")
        self.network = NodeNetwork.create()
        self.procs.append(registry.start_registry(self.network.node_ip, self.module, self.work / "registry"))
        self.kubelet = test_kubelet.TestKubelet(self.cluster, self.network, self.work / "kubelet",
                                   hosts={registry.HOST: self.network.node_ip})
        self.kubelet.start()

    def istioctl_install(self, shell: Shell, command: str) -> None:
        """`istioctl install -y -f FILE`: istiod (re)started from FILE (module docstring)."""
        assert self.cluster is not None and self.network is not None
        paths = re.findall(r"-f\s+(\S+)", command)
        assert paths, command
        operator: Obj = {}
        for path in paths:
            operator = merge(operator, yaml.safe_load((shell.work / path).read_text()))
        self.operators.append(" ".join(paths))
        if self.istiod is not None:
            self.istiod.stop()
            self.istiod = None
        sources = [s["address"].removeprefix("xds://").rsplit(":", 1)
                   for s in operator["spec"].get("meshConfig", {}).get("configSources", [])
                   if s["address"].startswith("xds://")]
        for host, _ in sources:  # the control plane's Service as cluster DNS + kube-proxy would reach it
            name, namespace = host.split(".")[:2]
            if self.cp_service is None:
                self.cp_service = ServiceProxy(self.cluster, namespace, name, self.network.node_ip)
                self.cp_service.start()
        self.istiod = kube_istiod.start(
            self.cluster, operator, None, None, self.work / f"istiod-{len(self.operators)}",
            pod_facing_host=self.network.node_ip,
            proxy_metadata={"WASM_INSECURE_REGISTRIES": registry.HOST},
            hosts={host: self.network.node_ip for host, _ in sources})

    def app_pod(self, shell: Shell, namespace: str, name: str = "my-app",
                labels: dict[str, str] | None = None) -> RunningPod:
        """The app `<namespace>/<name>` the walk-throughs call from: a Deployment of one pod,
        ServiceAccount `name`, injected like any pod of the namespace. Its app is the test (a
        process in the pod's network namespace, not UID 1337: its outbound traffic is captured)."""
        shell.run(f"kubectl -n {namespace} create serviceaccount {name}")
        deployment = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "namespace": namespace},
                      "spec": {"replicas": 1, "selector": {"matchLabels": {"app": name}},
                               "template": {"metadata": {"labels": {"app": name, **(labels or {})}},
                                            "spec": {"serviceAccountName": name, "containers": [
                                                {"name": "app", "image": f"example.invalid/{name}:1"}]}}}}
        shell.run(f"kubectl apply --server-side -f - <<'EOF'\n{json.dumps(deployment)}\nEOF")

        def ready() -> RunningPod:
            assert self.cluster is not None and self.kubelet is not None
            pods = (self.cluster.get(f"/api/v1/namespaces/{namespace}/pods?labelSelector=app%3D{name}") or {})
            ready = [p for p in pods.get("items", []) if (proxy_status(p) or {}).get("ready")]
            assert ready, pods
            return self.kubelet.pods[f"{namespace}/{ready[0]['metadata']['name']}"]

        return eventually(ready, timeout=120, interval=0.5)

    def control_plane_api(self) -> str:
        """The control plane's Service, port 8080, as its proxy on the node address serves it."""
        assert self.cp_service is not None and self.network is not None
        return f"{self.network.node_ip}:8080"

    def stop(self) -> None:
        for part in (self.kubelet, self.istiod, self.cp_service, *reversed(self.procs), self.cluster):
            if part is not None:
                try:
                    part.stop()
                except Exception:  # noqa: BLE001 - stop the rest regardless
                    pass
        if self.network is not None:
            self.network.delete()


