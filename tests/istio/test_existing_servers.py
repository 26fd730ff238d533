"""meshcache in front of the user's own inference servers (istio/overlays/kserve, triton): rendered
for a KServe InferenceService and a Triton Deployment, validated, and cross-referenced against
representative manifests of those workloads, so the EnvoyFilter, AuthorizationPolicy,
DestinationRule and proxy-stats Service select exactly their pods, ports and Service.

Where the reference manifests' labels and ports come from:
- KServe RawDeployment (kserve/kserve): the predictor Deployment and its pods carry
  `app: isvc.<name>-predictor`, `component: predictor` (constants.KServiceComponentLabel) and
  `serving.kserve.io/inferenceservice: <name>` (constants.InferenceServicePodLabelKey); the
  container is `kserve-container` (constants.InferenceServiceContainerName) on port 8080
  (InferenceServiceDefaultHttpPort); the Service `<name>-predictor` maps port 80
  (CommonDefaultHttpPort) to 8080 and selects `app: isvc.<name>-predictor` (the raw-deployment
  reconciler's tests, GetExpectedServiceSpec). `spec.predictor.annotations` reach the pod template:
  that is where docs/istio.md puts the sidecar stats matcher.
- Triton (triton-inference-server/server deploy/k8s-onprem chart): pods labelled
  `app: triton-inference-server` and `release: <release>`, container ports http 8000, grpc 8001,
  metrics 8002, probes on /v2/health/*; the Service maps 8000/8001/8002 to the named ports.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import yaml

from meshcache.ctl.cli import main
from meshcache.ctl.istio import crossref, kustomize, render, validate

Obj = dict
KSERVE = render.ISTIO_DIR / "overlays" / "kserve"
TRITON = render.ISTIO_DIR / "overlays" / "triton"
# What docs/istio.md has the user add to their pods (InferenceService spec.predictor.annotations,
# or the Triton Deployment's pod template) so the sidecar keeps the filter's stats.
STATS_ANNOTATION = {"proxy.istio.io/config": "proxyStatsMatcher:\n  inclusionPrefixes:\n"
                                             "  - wasmcustom.meshcache\n  - wasm.\n  - extension_config_discovery\n"}


def kserve_predictor(name: str, namespace: str) -> list[Obj]:
    """The Deployment and Service KServe (RawDeployment) creates for InferenceService `name`."""
    labels = {"app": f"isvc.{name}-predictor", "component": "predictor",
              "serving.kserve.io/inferenceservice": name}
    return [
        {"apiVersion": "apps/v1", "kind": "Deployment",
         "metadata": {"name": f"{name}-predictor", "namespace": namespace, "labels": dict(labels)},
         "spec": {"selector": {"matchLabels": {"app": f"isvc.{name}-predictor"}},
                  "template": {"metadata": {"labels": dict(labels), "annotations": dict(STATS_ANNOTATION)},
                               "spec": {"containers": [{
                                   "name": "kserve-container", "image": "kserve/sklearnserver:v0.14.1",
                                   "args": [f"--model_name={name}", "--model_dir=/mnt/models", "--http_port=8080"],
                                   "ports": [{"containerPort": 8080, "protocol": "TCP"}]}]}}}},
        {"apiVersion": "v1", "kind": "Service",
         "metadata": {"name": f"{name}-predictor", "namespace": namespace, "labels": dict(labels)},
         "spec": {"selector": {"app": f"isvc.{name}-predictor"},
                  "ports": [{"name": f"{name}-predictor", "protocol": "TCP", "port": 80, "targetPort": 8080}]}},
    ]


def triton_deployment(namespace: str, release: str = "models") -> list[Obj]:
    """Triton's chart (deploy/k8s-onprem) Deployment pod template, behind a Service `triton`."""
    labels = {"app": "triton-inference-server", "release": release}
    return [
        {"apiVersion": "apps/v1", "kind": "Deployment",
         "metadata": {"name": "triton", "namespace": namespace, "labels": dict(labels)},
         "spec": {"selector": {"matchLabels": dict(labels)},
                  "template": {"metadata": {"labels": dict(labels), "annotations": dict(STATS_ANNOTATION)},
                               "spec": {"containers": [{
                                   "name": "triton-inference-server",
                                   "image": "nvcr.io/nvidia/tritonserver:24.08-py3",
                                   "args": ["tritonserver", "--model-repository=/models"],
                                   "ports": [{"containerPort": 8000, "name": "http"},
                                             {"containerPort": 8001, "name": "grpc"},
                                             {"containerPort": 8002, "name": "metrics"}],
                                   "readinessProbe": {"httpGet": {"path": "/v2/health/ready", "port": "http"}},
                                   "livenessProbe": {"httpGet": {"path": "/v2/health/live", "port": "http"}}}]}}}},
        {"apiVersion": "v1", "kind": "Service",
         "metadata": {"name": "triton", "namespace": namespace, "labels": dict(labels)},
         "spec": {"selector": dict(labels),
                  "ports": [{"name": "http-inference-server", "port": 8000, "targetPort": "http"},
                            {"name": "grpc-inference-server", "port": 8001, "targetPort": "grpc"},
                            {"name": "metrics-inference-server", "port": 8002, "targetPort": "metrics"}]}},
    ]


def _render(tmp_path: Path, overlay: Path, *args: str) -> tuple[list[Obj], list[Obj]]:
    out = tmp_path / "out"
    assert main(["istio", "render", "--overlay", str(overlay), "--out", str(out), *args]) == 0
    # The manifests with the PodMonitors (monitoring.yaml): they select the same pods.
    return (validate.load_yaml_objects(out / "meshcache-istio.yaml") + validate.load_yaml_objects(
        out / "monitoring.yaml"), validate.load_yaml_objects(out / "mcp-preview.yaml"))


def _get(objects: list[Obj], kind: str, name: str) -> Obj:
    return next(o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name)


def _selects(selector: dict, workload: Obj) -> bool:
    labels = workload["spec"]["template"]["metadata"]["labels"]
    return all(labels.get(k) == v for k, v in selector.items())


def _check_in_front_of(objects: list[Obj], served: list[Obj], servers: list[Obj], digest: str,
                       ports: set[int], service_ports: list[int]) -> None:
    """Valid, cross-referenced with the user's workloads, and every selector picks their pods."""
    report = validate.validate_all(objects + served + servers)
    assert report.ok, report.errors
    errors = crossref.check_all(objects + served + servers, digest)
    assert not errors, errors
    [deployment] = [s for s in servers if s["kind"] == "Deployment"]
    [service] = [s for s in servers if s["kind"] == "Service"]
    assert not render.own_engine(objects)
    ef, client = served
    assert ef["metadata"]["name"] == "meshcache" and _selects(ef["spec"]["workloadSelector"]["labels"], deployment)
    assert {p["match"]["listener"]["portNumber"] for p in ef["spec"]["configPatches"]
            if p["applyTo"] == "HTTP_FILTER"} == ports
    assert [p["match"]["listener"]["portNumber"] for p in client["spec"]["configPatches"]
            if p["applyTo"] == "HTTP_FILTER"] == service_ports
    assert {p["port"] for p in service["spec"]["ports"]} >= set(service_ports)
    authz = _get(objects, "AuthorizationPolicy", "meshcache-engine")
    assert _selects(authz["spec"]["selector"]["matchLabels"], deployment)
    assert _selects(_get(objects, "Service", "meshcache-engine-proxies")["spec"]["selector"], deployment)
    dr = _get(objects, "DestinationRule", "meshcache-engine")
    assert dr["spec"]["host"] == service["metadata"]["name"] and "subsets" not in dr["spec"]
    assert dr["spec"]["trafficPolicy"]["loadBalancer"]["consistentHash"]["httpHeaderName"] == "x-meshcache-route-key"
    env = render.control_plane_env(objects)
    assert env["MESHCACHE_CP_ISTIO_COLOR"] == ""
    # Nothing of meshcache's own engine, and no namespace-wide mTLS change.
    assert not {"PeerAuthentication", "VirtualService", "Gateway"} & {o["kind"] for o in objects}
    sidecars = _get(objects, "PodMonitor", "meshcache-sidecars")
    assert _selects(sidecars["spec"]["selector"]["matchLabels"], deployment)
    assert "meshcache-engine" not in {o["metadata"]["name"] for o in objects if o["kind"] == "PodMonitor"}


@pytest.mark.parametrize("overlay", [KSERVE, TRITON], ids=lambda p: p.name)
def test_overlays_are_a_fixed_point_of_render(overlay: Path, filter_wasm: Path) -> None:
    assert render.render(render.RenderOptions(source=overlay, module_path=filter_wasm)) == kustomize.build(overlay)


def test_kserve_inference_service(tmp_path: Path, pins: render.Pins, crds: dict) -> None:
    objects, served = _render(tmp_path, KSERVE, "--namespace", "ml",
                              "--engine-selector", "serving.kserve.io/inferenceservice=iris",
                              "--engine-selector", "component=predictor", "--engine-service", "iris-predictor",
                              "--allow-principal", "ml/frontend")
    servers = kserve_predictor("iris", "ml")
    _check_in_front_of(objects, served, servers, pins.image_digest, {8080}, [80])
    # The plain-Prometheus scrape config follows the selector too: its sidecar job and the
    # servers' own metrics (KServe's, through the agent's merged page) keep these pods (every keep
    # rule matches their labels) and not meshcache's engine; no engine job.
    scrape = yaml.safe_load((tmp_path / "out" / "prometheus-kubernetes.yml").read_text())["scrape_configs"]
    assert [j["job_name"] for j in scrape] == ["meshcache-sidecars", "meshcache-control-plane", "meshcache-servers"]
    keeps = [r for r in scrape[0]["relabel_configs"] if r.get("action") == "keep"
             and r["source_labels"][0].startswith("__meta_kubernetes_pod_label_")]
    assert len(keeps) == 2, keeps
    assert keeps == [r for r in scrape[2]["relabel_configs"] if r.get("action") == "keep"
                     and r["source_labels"][0].startswith("__meta_kubernetes_pod_label_")]

    def kept(labels: dict[str, str]) -> bool:
        discovered = {"__meta_kubernetes_pod_label_" + re.sub(r"[^A-Za-z0-9_]", "_", k): v for k, v in labels.items()}
        return all(re.fullmatch(r["regex"], discovered.get(r["source_labels"][0], "")) for r in keeps)

    [deployment] = [s for s in servers if s["kind"] == "Deployment"]
    assert kept(deployment["spec"]["template"]["metadata"]["labels"])
    assert not kept({"app": "meshcache-engine"})
    assert not kept(kserve_predictor("bert", "ml")[0]["spec"]["template"]["metadata"]["labels"])
    rule = _get(objects, "AuthorizationPolicy", "meshcache-engine")["spec"]["rules"][0]
    assert rule["to"][0]["operation"]["ports"] == ["8080"]
    assert "cluster.local/ns/ml/sa/frontend" in rule["from"][0]["source"]["principals"]
    # The other InferenceServices of the namespace are not touched.
    other = kserve_predictor("bert", "ml")
    errors = crossref.check_all(objects + served + other, pins.image_digest)
    assert any("EnvoyFilter/meshcache: selector matches no workload" in e for e in errors), errors


def test_kserve_grpc_predictor(tmp_path: Path, pins: render.Pins, crds: dict) -> None:
    """A v2 gRPC predictor: kserve-container also listens on 8081 (h2c); its Service port too."""
    objects, served = _render(tmp_path, KSERVE, "--namespace", "ml", "--engine-port", "grpc=8081",
                              "--engine-port", "service-grpc=8081")
    servers = copy.deepcopy(kserve_predictor("my-model", "ml"))
    servers[0]["spec"]["template"]["spec"]["containers"][0]["ports"].append(
        {"name": "h2c", "containerPort": 8081, "protocol": "TCP"})
    servers[1]["spec"]["ports"].append({"name": "grpc", "port": 8081, "targetPort": 8081, "protocol": "TCP"})
    _check_in_front_of(objects, served, servers, pins.image_digest, {8080, 8081}, [80, 8081])
    ef = served[0]
    assert {p["match"]["routeConfiguration"]["portNumber"] for p in ef["spec"]["configPatches"]
            if p["applyTo"] == "HTTP_ROUTE"} == {8081}


def test_triton_deployment(tmp_path: Path, pins: render.Pins, crds: dict) -> None:
    objects, served = _render(tmp_path, TRITON, "--namespace", "inference")
    _check_in_front_of(objects, served, triton_deployment("inference"), pins.image_digest, {8000, 8001},
                       [8000, 8001])
    # Never the metrics port.
    assert "8002" not in _get(objects, "AuthorizationPolicy", "meshcache-engine")["spec"]["rules"][0]["to"][0][
        "operation"]["ports"]


def test_a_selector_that_misses_the_pods_is_caught(tmp_path: Path, pins: render.Pins) -> None:
    objects, served = _render(tmp_path, TRITON, "--namespace", "inference", "--engine-selector", "app=tritonserver")
    errors = crossref.check_all(objects + served + triton_deployment("inference"), pins.image_digest)
    for what in ("EnvoyFilter/meshcache", "AuthorizationPolicy/meshcache-engine", "Service/meshcache-engine-proxies"):
        assert any(e.startswith(what) and "selector matches no workload" in e for e in errors), (what, errors)


def test_colours_are_for_the_own_engine_only(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["istio", "render", "--overlay", str(TRITON), "--color", "green", "--out", str(tmp_path)]) == 2
    assert "apply to meshcache's own engine only" in capsys.readouterr().err


def test_validate_with_and_without_the_workloads(tmp_path: Path, filter_wasm: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert main(["istio", "render", "--overlay", str(KSERVE), "--namespace", "ml", "--out", str(out)]) == 0
    files = [str(p) for p in sorted(out.glob("*.yaml"))]
    capsys.readouterr()
    assert main(["istio", "validate", *files, "--module", str(filter_wasm)]) == 0
    assert "cross-references of the cached workloads skipped" in capsys.readouterr().out
    # As `kubectl get deploy,svc my-model-predictor -o yaml` prints them: a List.
    theirs = tmp_path / "theirs.yaml"
    theirs.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": kserve_predictor("my-model", "ml")}))
    assert main(["istio", "validate", *files, "--module", str(filter_wasm), "--workload", str(theirs)]) == 0
    assert "skipped" not in capsys.readouterr().out
    theirs.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": kserve_predictor("iris", "ml")}))
    assert main(["istio", "validate", *files, "--module", str(filter_wasm), "--workload", str(theirs)]) == 1
    assert "EnvoyFilter/meshcache: selector matches no workload" in capsys.readouterr().err
