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

from meshcache.contract import oci
from meshcache.contract.extensions import AFFINITY_LABEL
from meshcache.ctl.istio import render
from tests.helpers.kserve import mlp_json
from tests.helpers.wait import eventually
from tests.kube.mesh.helpers import ecds_filters, http_call
from tests.kube.walkthroughs.node import WalkNode
from tests.kube.walkthroughs.walk import Replaced, Shell, code_blocks, commands, section

NS = "ml"
CP = "meshcache-control-plane"


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory, filter_wasm: Path) -> Iterator[WalkNode]:
    mesh = WalkNode(tmp_path_factory.mktemp("walkthrough-1"), filter_wasm)
    try:
        mesh.start()
        yield mesh
    finally:
        mesh.stop()


def test_walkthrough_1_fresh_mesh_top_to_bottom(fresh: WalkNode, tmp_path: Path) -> None:
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

    # The applies above went through istiod's validation webhook: it is on and refuses a broken
    # EnvoyFilter (schema-valid for the CRD, a patch without a value for Istio).
    broken = {"apiVersion": "networking.istio.io/v1alpha3", "kind": "EnvoyFilter",
              "metadata": {"name": "broken", "namespace": NS},
              "spec": {"configPatches": [{"applyTo": "HTTP_FILTER", "match": {"context": "SIDECAR_INBOUND"},
                                          "patch": {"operation": "INSERT_BEFORE"}}]}}
    err = shell.refused(f"kubectl apply --server-side --dry-run=server -f - <<'EOF'\n{json.dumps(broken)}\nEOF")
    assert 'admission webhook "validation.istio.io" denied the request' in err and "missing patch value" in err, err

    # "Verify": the same request twice from a caller's pod, through its sidecar to the engine's.
    assert fresh.cluster is not None
    service = fresh.cluster.get(f"/api/v1/namespaces/{NS}/services/{render.ENGINE_APP}")
    assert service is not None
    # The app's pods carry the cache-affinity label the walk-through asks for (two engine replicas).
    app = fresh.app_pod(shell, NS, labels={AFFINITY_LABEL: "true"})

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
        # The caller's client-role filter, which sets the route key the replicas are hashed by.
        client = ecds_filters(app).get("meshcache-client", {}).get("typed_config", {})
        assert client.get("@type", "").endswith("wasm.v3.Wasm") and "mlp-classifier" in json.dumps(client), client
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
