"""docs/istio.md "Walk-through 2: an existing mesh with a KServe InferenceService", top to bottom,
with kubectl against a local cluster whose test kubelet runs the pods, then the outcome it
promises: the same request twice from `ml/my-app`, the second a hit answered by the predictor's
own sidecar.

The existing mesh the walk-through starts from is made first (not a docs step): Istio from
`my-istio.yaml` (`profile: default`), namespace `ml` labelled `istio-injection: enabled`, the app
`ml/my-app`, and KServe's side of an InferenceService in RawDeployment mode:
- the InferenceService CRD, minimal (`serving.kserve.io/v1beta1`, schema left open): KServe's own
  CRD and controller are not installed;
- what KServe's controller makes of the docs' InferenceService, made by the test from the object
  the docs' `kubectl apply` stored: the Deployment `sklearn-iris-predictor` (pod labels
  `serving.kserve.io/inferenceservice: sklearn-iris`, `component: predictor`, the predictor's
  annotations, `kserve-container` serving REST on 8080) and the Service `sklearn-iris-predictor`
  (80 -> 8080). The predictor container is the project's engine image (the test kubelet runs it),
  not KServe's sklearn server: its storage initializer writes an ONNX model `sklearn-iris` with
  the iris model's input (`input-0`, FP32 [1, 4]) instead of fetching `storageUri`.

Then every command of the walk-through's code blocks runs as written, except (`replaced`):
`istioctl install -y -f my-istio.yaml -f rendered/istio-operator-existing.yaml` (istiod restarted
as the project's kube istiod from the two files merged as istioctl merges them: see
test_walkthrough_fresh), `kubectl -n istio-system rollout restart/status deploy/istiod` (that
istiod is a host process, already restarted and waited for), `kubectl port-forward` (no streaming
server: the Service's proxy on the node address) and `kubectl exec deploy/my-app -- CMD` (no
streaming server: CMD runs in the app pod's network namespace as its user, so its traffic is
captured by the pod's sidecar as an exec'd command's would be).
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.helpers.wait import eventually
from tests.kube.mesh.helpers import APP_UID, ecds_filters
from tests.kube.walkthroughs.node import WalkNode
from tests.kube.walkthroughs.walk import Replaced, Shell, code_blocks, commands, section

NS = "ml"
ISVC = "sklearn-iris"
PREDICTOR = f"{ISVC}-predictor"
TITLE = "Walk-through 2: an existing mesh with a KServe InferenceService"
MY_ISTIO = {"apiVersion": "install.istio.io/v1alpha1", "kind": "IstioOperator", "spec": {"profile": "default"}}
ISVC_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
    "metadata": {"name": "inferenceservices.serving.kserve.io"},
    "spec": {"group": "serving.kserve.io", "scope": "Namespaced",
             "names": {"kind": "InferenceService", "plural": "inferenceservices", "singular": "inferenceservice",
                       "shortNames": ["isvc"]},
             "versions": [{"name": "v1beta1", "served": True, "storage": True,
                           "schema": {"openAPIV3Schema": {"type": "object",
                                                          "x-kubernetes-preserve-unknown-fields": True}}}]},
}
# The storage initializer's stand-in: a linear classifier with the iris model's input and a
# Triton-style repository layout the engine reads (<model>/1/model.onnx).
WRITE_MODEL = """import sys, pathlib, numpy as np, onnx
from onnx import helper, numpy_helper, TensorProto
w = numpy_helper.from_array(np.array([[0.4, -0.2, 0.1], [0.3, 0.5, -0.6], [-1.2, 0.7, 0.9], [-0.8, -0.4, 1.5]],
                                     dtype=np.float32), "w")
graph = helper.make_graph([helper.make_node("MatMul", ["input-0", "w"], ["output-0"])], "iris",
                          [helper.make_tensor_value_info("input-0", TensorProto.FLOAT, [1, 4])],
                          [helper.make_tensor_value_info("output-0", TensorProto.FLOAT, [1, 3])], [w])
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
out = pathlib.Path(sys.argv[1]) / "sklearn-iris" / "1"
out.mkdir(parents=True, exist_ok=True)
onnx.save(model, str(out / "model.onnx"))
"""
ENGINE_IMAGE = "registry.example.com/meshcache/engine:0.1.0"


def kserve_objects(isvc: dict) -> list[dict]:
    """What KServe's RawDeployment controller makes of the InferenceService (module docstring)."""
    labels = {"serving.kserve.io/inferenceservice": ISVC, "component": "predictor", "app": f"isvc.{PREDICTOR}"}
    annotations = isvc["spec"]["predictor"].get("annotations", {})
    models = {"name": "kserve-provision-location", "mountPath": "/mnt/models"}
    pod = {"metadata": {"labels": labels, "annotations": annotations},
           "spec": {"volumes": [{"name": "kserve-provision-location", "emptyDir": {}}],
                    "initContainers": [{"name": "storage-initializer", "image": ENGINE_IMAGE,
                                        "command": ["python", "-c", WRITE_MODEL, "/mnt/models"],
                                        "volumeMounts": [models]}],
                    "containers": [{"name": "kserve-container", "image": ENGINE_IMAGE, "command": ["meshcache-engine"],
                                    "args": ["--model-repository", "/mnt/models", "--host", "0.0.0.0",
                                             "--http-port", "8080", "--grpc-port", "8081", "--metrics-port", "8082"],
                                    "ports": [{"name": "http1", "containerPort": 8080, "protocol": "TCP"}],
                                    "readinessProbe": {"httpGet": {"path": "/v2/health/ready", "port": 8080},
                                                       "periodSeconds": 1},
                                    "volumeMounts": [models]}]}}
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": PREDICTOR, "namespace": NS,
                                                                           "labels": labels},
                  "spec": {"replicas": 1, "selector": {"matchLabels": {"app": f"isvc.{PREDICTOR}"}}, "template": pod}}
    service = {"apiVersion": "v1", "kind": "Service",
               "metadata": {"name": PREDICTOR, "namespace": NS, "labels": labels},
               "spec": {"selector": {"app": f"isvc.{PREDICTOR}"},
                        "ports": [{"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP"}]}}
    return [deployment, service]


@pytest.fixture(scope="module")
def existing(tmp_path_factory: pytest.TempPathFactory, filter_wasm: Path) -> Iterator[WalkNode]:
    node = WalkNode(tmp_path_factory.mktemp("walkthrough-2"), filter_wasm)
    try:
        node.start()
        yield node
    finally:
        node.stop()


def apply(shell: Shell, objects: list[dict]) -> None:
    shell.run(f"kubectl apply --server-side -f - <<'EOF'\n{yaml.safe_dump_all(objects)}\nEOF")


def test_walkthrough_2_kserve_inference_service_top_to_bottom(existing: WalkNode, tmp_path: Path) -> None:
    text = section(TITLE)
    blocks = code_blocks(text)
    isvc_yaml = [body for info, body in blocks if info == "yaml"]
    shell_blocks = [body for info, body in blocks if info == ""]
    assert len(isvc_yaml) == 1 and len(shell_blocks) == 3, [info for info, _ in blocks]
    shell = Shell(tmp_path / "repo", existing.cluster.kubeconfig)  # type: ignore[union-attr]

    # The existing mesh (not a docs step).
    (shell.work / "my-istio.yaml").write_text(yaml.safe_dump(MY_ISTIO))
    existing.istioctl_install(shell, "istioctl install -y -f my-istio.yaml")
    shell.run(f"kubectl create namespace {NS} && kubectl label namespace {NS} istio-injection=enabled")
    apply(shell, [ISVC_CRD])
    shell.run("kubectl wait --for=condition=Established crd/inferenceservices.serving.kserve.io --timeout=60s")
    app = existing.app_pod(shell, NS)

    # 1. the InferenceService, applied as the docs say; KServe's part done by the test.
    (shell.work / "sklearn-iris.yaml").write_text(isvc_yaml[0])
    apply_isvc = re.search(r"`(kubectl apply[^`]*sklearn-iris\.yaml)`", text)
    assert apply_isvc, "step 1 names its kubectl apply"
    shell.run(apply_isvc.group(1))
    isvc = json.loads(shell.run(f"kubectl -n {NS} get inferenceservice {ISVC} -o json"))
    apply(shell, kserve_objects(isvc))
    shell.run(f"kubectl -n {NS} rollout status deploy/{PREDICTOR} --timeout=180s")

    answers: list[str] = []

    def exec_in_app(command: str) -> None:
        inner = re.fullmatch(r"kubectl -n ml exec deploy/my-app -- (.*)", command)
        assert inner
        argv = app.net.exec_argv("setpriv", f"--reuid={APP_UID}", f"--regid={APP_UID}", "--clear-groups",
                                 "bash", "-c", inner.group(1))
        for _ in range(2):  # "the same request twice from the app"
            out = subprocess.run(argv, cwd=shell.work, capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, out.stderr
            answers.append(out.stdout)

    def restart_istiod(command: str) -> None:
        assert existing.istiod is not None and len(existing.operators) == 2  # the install step restarted it

    def policy_reached_the_predictor() -> bool:
        assert existing.kubelet is not None
        pods = [p for key, p in existing.kubelet.pods.items() if key.startswith(f"{NS}/{PREDICTOR}")]
        assert pods
        for pod in pods:
            config = ecds_filters(pod).get("meshcache", {}).get("typed_config", {})
            assert config.get("@type", "").endswith("wasm.v3.Wasm") and ISVC in json.dumps(config), config
        return True

    replaced = [
        Replaced(r"istioctl install -y -f my-istio\.yaml -f rendered/istio-operator-existing\.yaml",
                 "istiod as a host process from the merged IstioOperators",
                 lambda c: existing.istioctl_install(shell, c)),
        Replaced(r"kubectl -n istio-system rollout (restart|status) deploy/istiod",
                 "the install step restarted that process and waited for it", restart_istiod),
        Replaced(r"kubectl -n ml port-forward deploy/meshcache-control-plane 8080 &",
                 "no streaming server in the test kubelet: the Service's proxy on the node address",
                 lambda c: shell.rewrites.update({"localhost:8080": existing.control_plane_api()})),
        Replaced(r"kubectl -n ml exec deploy/my-app -- curl .*",
                 "no streaming server: in the app pod's network namespace as its user",
                 lambda c: (eventually(policy_reached_the_predictor, timeout=90, interval=1), exec_in_app(c))),
    ]
    for block in shell_blocks:
        shell.walk(commands(block), replaced)

    assert [r.pattern for r in replaced if not any(r.matches(c) for c in shell.replaced)] == []
    assert existing.operators == ["my-istio.yaml", "my-istio.yaml rendered/istio-operator-existing.yaml"]
    assert any(c.startswith(".venv/bin/meshcache istio validate rendered/ --workload isvc.yaml") for c in shell.ran)
    first, second = answers
    assert first.startswith("HTTP/1.1 200"), first
    assert re.search(r"^cache-status: meshcache; fwd=miss; stored\r?$", first, re.M | re.I), first
    assert re.search(r"^cache-status: meshcache; hit", second, re.M | re.I), second
    # text mode reads curl's CRLFs as newlines: the body follows the first empty line
    assert first.split("\n\n", 1)[1] == second.split("\n\n", 1)[1], (first, second)
