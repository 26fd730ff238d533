"""docs/istio.md "Walk-through 1: a fresh mesh", top to bottom, with kubectl against a local
cluster whose test kubelet runs the pods (the control plane, Redis and the engine for real, every
injected pod with istio-agent and Envoy), then the outcome "Verify" promises: the same request
twice from a caller's pod (`ml/my-app`, as the walk-through names callers), a MISS then a HIT
answered by the engine's sidecar.

Run as written, from the docs' code block: render, validate, the namespace, `xds-certs`, the three
Secrets (`kubectl create secret`, `openssl rand`), the manifests (`kubectl apply --server-side`,
through istiod's validation webhook), both `rollout status`, `oci-layout`. Replaced (`REPLACED`):
- `make images` and `buildah push`: the test kubelet runs the images
  `registry.example.com/meshcache/{engine,control-plane}` as this virtualenv's entrypoints
  (meshcache.ctl.kube.kubelet), so nothing is built or pushed;
- `skopeo copy ... docker://registry.example.com/...`: the node's registry (meshcache.ctl.kube.registry)
  already holds the same module image, pushed by skopeo from the same layout; the test checks
  that `oci-layout`'s digest is the one render pinned;
- `istioctl install -y -f rendered/<operator>`: istiod runs as a host process of the project's
  kube istiod (meshcache.ctl.kube.istiod), started from the same rendered IstioOperator through
  `istioctl manifest generate` plus `istioctl tag set default` (what install applies), because
  istiod as a pod would need the API server and its webhooks routed from the pod network; step 5
  stops the first istiod and starts it again from `istio-operator-mcp.yaml`, as install's
  rollout would;
- `kubectl port-forward` to the control plane: the test kubelet serves no streaming (port-forward,
  exec); the Service's proxy on the node address (meshcache.ctl.kube.services) serves its port
  8080 instead, and the later commands' `localhost:8080` read that address;
- `kubectl apply --server-side -f rendered/monitoring.yaml` (optional in the docs): PodMonitor is the
  Prometheus Operator's kind, which this cluster does not have.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from meshcache.contract import oci
from meshcache.ctl.istio import render
from meshcache.ctl.kube import istiod as kube_istiod
from meshcache.ctl.kube import kubelet as test_kubelet
from meshcache.ctl.kube import registry
from meshcache.ctl.kube.cluster import LocalCluster, start_cluster
from meshcache.ctl.kube.kubelet import RunningPod
from meshcache.ctl.kube.netns import NodeNetwork
from meshcache.ctl.kube.services import ServiceProxy
from tests.helpers.kserve import mlp_json
from tests.helpers.wait import eventually
from tests.kube.mesh.helpers import ecds_filters, http_call, proxy_status
from tests.kube.walkthroughs.walk import Replaced, Shell, code_blocks, commands, section

NS = "ml"
CALLER_SA = "my-app"  # "callers run as `ml/my-app`"
CP = "meshcache-control-plane"


class FreshMesh:
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
        path = re.search(r"-f\s+(\S+)", command)
        assert path, command
        operator = yaml.safe_load((shell.work / path.group(1)).read_text())
        self.operators.append(path.group(1))
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


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory, filter_wasm: Path) -> Iterator[FreshMesh]:
    mesh = FreshMesh(tmp_path_factory.mktemp("walkthrough-1"), filter_wasm)
    try:
        mesh.start()
        yield mesh
    finally:
        mesh.stop()


def caller(mesh: FreshMesh, shell: Shell) -> RunningPod:
    """A pod of the app `ml/my-app`, injected like any pod of the namespace; its app is this test
    (a process in the pod's network namespace, not UID 1337: its outbound traffic is captured)."""
    shell.run(f"kubectl -n {NS} create serviceaccount {CALLER_SA}")
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "my-app", "namespace": NS, "labels": {"app": "my-app"}},
           "spec": {"serviceAccountName": CALLER_SA,
                    "containers": [{"name": "app", "image": "example.invalid/my-app:1"}]}}
    shell.run(f"kubectl apply --server-side -f - <<'EOF'\n{json.dumps(pod)}\nEOF")

    def ready() -> RunningPod:
        assert mesh.cluster is not None and mesh.kubelet is not None
        got = mesh.cluster.get(f"/api/v1/namespaces/{NS}/pods/my-app")
        assert got is not None and (proxy_status(got) or {}).get("ready"), got and got["status"]
        return mesh.kubelet.pods[f"{NS}/my-app"]

    return eventually(ready, timeout=120, interval=0.5)


def test_walkthrough_1_fresh_mesh_top_to_bottom(fresh: FreshMesh, tmp_path: Path) -> None:
    blocks = [body for info, body in code_blocks(section("Walk-through 1: a fresh mesh")) if info in ("", "sh")]
    assert len(blocks) == 1, "walk-through 1 is one command block"
    steps = commands(blocks[0])
    shell = Shell(tmp_path / "repo", fresh.cluster.kubeconfig)  # type: ignore[union-attr]
    digests: list[str] = []

    def oci_layout(command: str) -> None:  # run as written; its digest is checked against render's pin
        digests.extend(re.findall(r"sha256:[0-9a-f]{64}", shell.run(command))[:1])

    replaced = [
        Replaced(r"make images", "the test kubelet runs the images as this virtualenv's entrypoints", lambda c: None),
        Replaced(r"buildah push meshcache/\S+ docker://registry\.example\.com/\S+",
                 "nothing to push: the test kubelet runs the images", lambda c: None),
        Replaced(r"\.venv/bin/meshcache istio oci-layout .*", "run as written (its digest checked)", oci_layout),
        Replaced(r"skopeo copy --preserve-digests oci:dist/oci:v0\.1\.0 docker://registry\.example\.com/meshcache/filter:v0\.1\.0",
                 "the node's registry holds the same image (registry.py)", lambda c: None),
        Replaced(r"istioctl install -y -f rendered/istio-operator(-mcp)?\.yaml",
                 "istiod as a host process from the same IstioOperator", lambda c: fresh.istioctl_install(shell, c)),
        Replaced(r"kubectl -n ml port-forward deploy/meshcache-control-plane 8080 &",
                 "no streaming server in the test kubelet: the Service's proxy on the node address",
                 lambda c: shell.rewrites.update({"localhost:8080": fresh.control_plane_api()})),
        Replaced(r"kubectl apply (--server-side )?-f rendered/monitoring\.yaml",
                 "optional; no Prometheus Operator here", lambda c: None),
    ]
    shell.walk(steps, replaced)

    # Every replacement was used (a docs step that vanished or changed shape fails here), and
    # nothing else was: the rest ran verbatim.
    assert [r.pattern for r in replaced if not any(r.matches(c) for c in shell.replaced)] == []
    assert fresh.operators == ["rendered/istio-operator.yaml", "rendered/istio-operator-mcp.yaml"]
    assert sum(c.startswith("kubectl apply") for c in shell.ran) >= 2  # the namespace and the manifests
    assert digests and digests[0] in (shell.work / "rendered" / "mcp-preview.yaml").read_text(), digests
    assert digests[0] == f"sha256:{oci.image_for(fresh.module).digest}"  # the image the registry holds

    # "Verify": the same request twice from a caller's pod, through its sidecar to the engine's.
    assert fresh.cluster is not None
    service = fresh.cluster.get(f"/api/v1/namespaces/{NS}/services/{render.ENGINE_APP}")
    assert service is not None
    app = caller(fresh, shell)

    def filter_has_the_policy() -> bool:
        """Every engine sidecar runs the Wasm module (not the agent's fail-open stand-in) with the
        policy step 6 set (control plane -> istiod over MCP -> ECDS)."""
        assert fresh.kubelet is not None
        engines = [p for key, p in fresh.kubelet.pods.items() if key.startswith(f"{NS}/{render.ENGINE_APP}")]
        assert engines
        for pod in engines:
            config = ecds_filters(pod).get("meshcache", {}).get("typed_config", {})
            assert config.get("@type", "").endswith("wasm.v3.Wasm"), config
            assert "mlp-classifier" in json.dumps(config), config
        return True

    eventually(filter_has_the_policy, timeout=90, interval=1)
    path, body = "/v2/models/mlp-classifier/infer", json.dumps(mlp_json(seed=3411))

    def post() -> dict:
        result = http_call(app, path, render.ENGINE_APP, service["spec"]["clusterIP"], body=body)
        assert result["status"] == 200, result  # 503 until the caller's sidecar has the engine endpoints
        return result

    first = eventually(post, timeout=90, interval=1)
    assert first["headers"].get("cache-status") == "meshcache; fwd=miss; stored", first["headers"]
    second = post()
    assert second["headers"].get("cache-status", "").startswith("meshcache; hit; ttl="), second["headers"]
    assert second["body"] == first["body"]
