"""`meshcache istio render` for the user's cluster: images, callers (--allow-principal), the
workloads whose sidecars cache (--engine-selector, --engine-port), the install order and the
existing-Istio files; every rendering validates (Kubernetes and Istio schemas, cross-references),
and the control plane, given the rendered Deployment's environment, serves istiod what the
preview shows."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from meshcache.control_plane.mcp import IstioMcpRenderer
from meshcache.control_plane.settings import Settings
from meshcache.ctl.cli import main
from meshcache.ctl.istio import crossref, monitoring, render, validate

Obj = dict


def _render(tmp_path: Path, *args: str) -> tuple[list[Obj], list[Obj], Path]:
    out = tmp_path / "out"
    assert main(["istio", "render", "--out", str(out), *args]) == 0
    return (validate.load_yaml_objects(out / "meshcache-istio.yaml"),
            validate.load_yaml_objects(out / "mcp-preview.yaml"), out)


def _get(objects: list[Obj], kind: str, name: str) -> Obj:
    return next(o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name)


def _served_like_the_control_plane(objects: list[Obj], monkeypatch: pytest.MonkeyPatch) -> list[Obj]:
    """What the control plane builds from the rendered Deployment's environment (its Settings)."""
    for name, value in render.control_plane_env(objects).items():
        if name.startswith("MESHCACHE_CP_ISTIO_"):
            monkeypatch.setenv(name, value)
    renderer = IstioMcpRenderer.from_settings(Settings())
    assert renderer is not None
    return renderer.build(render.demo_plugin_config())


def test_every_new_flag(tmp_path: Path, pins: render.Pins, crds: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    objects, served, out = _render(
        tmp_path, "--namespace", "ml",
        "--engine-image", "ghcr.io/acme/meshcache-engine:1.2@sha256:" + "e" * 64,
        "--control-plane-image", "ghcr.io/acme/meshcache-cp:1.2",
        "--allow-principal", "spiffe://cluster.local/ns/shop/sa/checkout",
        "--allow-principal", "cluster.local/ns/ml/sa/batch-scorer",
        "--allow-principal", "web/frontend",
        "--engine-selector", "tier=inference", "--engine-selector", "cache.example.com/enabled=true",
        "--engine-port", "http=9000", "--engine-port", "grpc=9001")
    report = validate.validate_all(objects + served)
    assert report.ok, report.errors
    errors = crossref.check_all(objects + served, pins.image_digest)
    assert not errors, errors

    selector = {"tier": "inference", "cache.example.com/enabled": "true"}
    engine = _get(objects, "Deployment", "meshcache-engine-blue")
    pod = engine["spec"]["template"]
    assert selector.items() <= pod["metadata"]["labels"].items()  # the own engine stays cached
    images = {c["image"] for c in [*pod["spec"]["initContainers"], *pod["spec"]["containers"]]}
    assert images == {"ghcr.io/acme/meshcache-engine:1.2@sha256:" + "e" * 64}
    container = pod["spec"]["containers"][0]
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"http": 9000, "grpc": 9001, "metrics": 8002}
    assert container["args"][-4:] == ["--http-port", "9000", "--grpc-port", "9001"]
    cp = _get(objects, "Deployment", "meshcache-control-plane")
    assert cp["spec"]["template"]["spec"]["containers"][0]["image"] == "ghcr.io/acme/meshcache-cp:1.2"

    authz = _get(objects, "AuthorizationPolicy", "meshcache-engine")
    assert authz["spec"]["selector"]["matchLabels"] == selector
    rule = authz["spec"]["rules"][0]
    assert rule["from"][0]["source"]["principals"] == [
        "cluster.local/ns/ml/sa/meshcache-client",
        "cluster.local/ns/istio-system/sa/istio-ingressgateway-service-account",
        "cluster.local/ns/shop/sa/checkout", "cluster.local/ns/ml/sa/batch-scorer", "cluster.local/ns/web/sa/frontend"]
    assert rule["to"][0]["operation"]["ports"] == ["9000", "9001"]
    assert _get(objects, "Service", "meshcache-engine-proxies")["spec"]["selector"] == selector

    env = render.control_plane_env(objects)
    assert (env["MESHCACHE_CP_ISTIO_SELECTOR"], env["MESHCACHE_CP_ISTIO_HTTP_PORTS"],
            env["MESHCACHE_CP_ISTIO_GRPC_PORTS"]) == ("tier=inference,cache.example.com/enabled=true", "9000", "9001")
    # The Service keeps its ports (8000/8001 -> the named container ports): callers' listeners.
    assert env["MESHCACHE_CP_ISTIO_SERVICE_PORTS"] == "8000,8001"
    ef, client = served
    assert ef["spec"]["workloadSelector"]["labels"] == {**selector, "color": "blue"}
    inbound = {p["match"]["listener"]["portNumber"] for p in ef["spec"]["configPatches"]
               if p["applyTo"] == "HTTP_FILTER"}
    routes = {p["match"]["routeConfiguration"]["portNumber"] for p in ef["spec"]["configPatches"]
              if p["applyTo"] == "HTTP_ROUTE"}
    assert (inbound, routes) == ({9000, 9001}, {9001})
    outbound = [p["match"]["listener"]["portNumber"] for p in client["spec"]["configPatches"]
                if p["applyTo"] == "HTTP_FILTER"]
    assert outbound == [8000, 8001]
    # The control plane, from the rendered environment, serves exactly the preview.
    assert [o["spec"] for o in _served_like_the_control_plane(objects, monkeypatch)] == [o["spec"] for o in served]


def test_defaults_render_the_committed_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No new flag: the control plane's defaults (no env) and the rendered env build the same objects."""
    objects, served, _ = _render(tmp_path)
    assert [o["spec"] for o in _served_like_the_control_plane(objects, monkeypatch)] == [o["spec"] for o in served]
    defaults = Settings(istio_wasm_url="oci://x@sha256:" + "a" * 64).istio_workloads()
    assert render.workloads_from_env(render.control_plane_env(objects)) == defaults


@pytest.mark.parametrize("args, message", [
    (["--allow-principal", "frontend"], "--allow-principal 'frontend': use spiffe://"),
    (["--allow-principal", "spiffe://cluster.local/ns/Web/sa/x"], "--allow-principal"),
    (["--allow-principal", "ns/sa/extra"], "--allow-principal"),
    (["--engine-selector", "app"], "--engine-selector 'app': use KEY=VALUE"),
    (["--engine-selector", "app=has space"], "not a Kubernetes label value"),
    (["--engine-port", "http=0"], "1..65535"),
    (["--engine-port", "metrics=8002"], "KEY one of http, grpc"),
    (["--engine-port", "http=9000", "--engine-port", "grpc=9000"], "listed twice"),
    (["--engine-image", "Registry/Engine:1"], "is not an image reference"),
    (["--engine-service", "Not_A_Service"], "must be a Service name"),
    (["--engine-selector", "app=my-model"], "conflicts with meshcache's engine label app=meshcache-engine"),
])
def test_bad_values_are_clear_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str],
                                     message: str) -> None:
    out = tmp_path / "out"
    assert main(["istio", "render", "--out", str(out), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err
    assert not out.exists()  # nothing half-written


def test_grpc_none_caches_rest_only(tmp_path: Path, pins: render.Pins, crds: dict) -> None:
    objects, served, _ = _render(tmp_path, "--engine-port", "grpc=none")
    assert validate.validate_all(objects + served).ok
    assert not crossref.check_all(objects + served, pins.image_digest)
    ef, client = served
    assert not [p for p in ef["spec"]["configPatches"] if p["applyTo"] == "HTTP_ROUTE"]
    assert {p["match"]["listener"]["portNumber"] for p in ef["spec"]["configPatches"]
            if p["applyTo"] == "HTTP_FILTER"} == {8000}
    assert _get(objects, "AuthorizationPolicy", "meshcache-engine")["spec"]["rules"][0]["to"][0]["operation"][
        "ports"] == ["8000"]
    assert [p["match"]["listener"]["portNumber"] for p in client["spec"]["configPatches"]
            if p["applyTo"] == "HTTP_FILTER"] == [8000]


def test_mesh_wide_changes_only_when_asked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Without --mesh-tls13 no install file touches mesh TLS; the existing-Istio overlay and the Helm
    values carry only the config sources (k8s:// kept); the printed steps put the namespace before
    the Secrets and state each mesh-wide change."""
    _, _, out = _render(tmp_path)
    printed = capsys.readouterr().out
    step1, step2, existing = (validate.load_yaml_objects(out / f)[0] for f in (
        "istio-operator.yaml", "istio-operator-mcp.yaml", "istio-operator-existing.yaml"))
    values = validate.load_yaml_objects(out / "istiod-values.yaml")[0]
    assert "meshConfig" not in step1["spec"] and "meshMTLS" not in step2["spec"]["meshConfig"]
    assert existing["spec"] == {"meshConfig": step2["spec"]["meshConfig"]}  # no profile, no components
    assert values == {"meshConfig": step2["spec"]["meshConfig"]}
    assert [s["address"] for s in values["meshConfig"]["configSources"]] == [
        "k8s://", "xds://meshcache-control-plane.meshcache.svc.cluster.local:18000"]
    assert validate.validate_object(existing) == [] and crossref.check_operator_steps({"spec": {}}, existing) == []
    assert [o["kind"] for o in validate.load_yaml_objects(out / "namespace.yaml")] == ["Namespace"]
    steps = printed[printed.index("next steps"):]
    order = [steps.index(s) for s in ("istio-operator.yaml", "namespace.yaml", "xds-certs", "meshcache-cp-tokens",
                                      "meshcache-istio.yaml", "istio-operator-mcp.yaml")]
    assert order == sorted(order), steps
    assert "no TLS change" in printed and "k8s:// is listed too" in printed

    _, _, out = _render(tmp_path / "tls", "--mesh-tls13")
    printed = capsys.readouterr().out
    for name in ("istio-operator.yaml", "istio-operator-mcp.yaml", "istio-operator-existing.yaml",
                 "istiod-values.yaml"):
        doc = validate.load_yaml_objects(out / name)[0]
        mesh = doc.get("spec", doc)["meshConfig"]
        assert mesh["meshMTLS"] == {"minProtocolVersion": "TLSV1_3"}, name
    assert "TLSV1_3 (--mesh-tls13)" in printed


def test_validate_without_the_crd_file_says_where_to_get_it(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    _, _, out = _render(tmp_path)
    capsys.readouterr()
    monkeypatch.setenv("MESHCACHE_ISTIO_CRDS", str(tmp_path / "missing.yaml"))
    validate.crd_schemas.cache_clear()
    try:
        assert main(["istio", "validate", str(out / "meshcache-istio.yaml")]) == 2
    finally:
        validate.crd_schemas.cache_clear()
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert "customresourcedefinitions.gen.yaml" in err and "MESHCACHE_ISTIO_CRDS" in err


def test_pod_monitors_follow_the_selector_and_validate(tmp_path: Path, crds: dict) -> None:
    """monitoring.yaml: PodMonitors (validated against the Prometheus Operator's CRD models) for the
    cached pods' sidecars, the control plane and the engine, scraping ports those pods have, with
    the rules that give filter and engine metrics one `model` label."""
    objects, _, out = _render(tmp_path, "--engine-selector", "tier=inference")
    monitors = validate.load_yaml_objects(out / "monitoring.yaml")
    assert validate.validate_all(monitors).ok, validate.validate_all(monitors).errors
    assert crossref.check_monitors(objects + monitors) == []
    by_name = {m["metadata"]["name"]: m for m in monitors}
    assert set(by_name) == {"meshcache-sidecars", "meshcache-control-plane", "meshcache-engine"}
    sidecars = by_name["meshcache-sidecars"]["spec"]
    assert sidecars["selector"]["matchLabels"] == {"tier": "inference"}
    assert sidecars["podMetricsEndpoints"][0]["port"] == "http-envoy-prom"
    assert sidecars["podMetricsEndpoints"][0]["metricRelabelings"] == monitoring.operator_rules(
        monitoring.filter_model_rules())
    assert by_name["meshcache-engine"]["spec"]["podMetricsEndpoints"][0]["metricRelabelings"] == \
        monitoring.operator_rules(monitoring.server_model_rules())

    broken = copy.deepcopy(monitors)
    broken[0]["spec"]["podMetricsEndpoints"][0]["portt"] = "x"
    broken[1]["spec"]["podMetricsEndpoints"][0]["relabelings"] = [{"action": "rewrite"}]
    errors = validate.validate_all(broken).errors
    assert any("podMetricsEndpoints.0.portt: unknown field" in e for e in errors), errors
    assert any("relabelings.0.action" in e for e in errors), errors
    wrong_port = copy.deepcopy(monitors)
    wrong_port[2]["spec"]["podMetricsEndpoints"][0]["port"] = "metrix"
    assert any("port 'metrix' is no port" in e for e in crossref.check_monitors(objects + wrong_port))


def test_control_plane_settings_reject_bad_workloads() -> None:
    """MESHCACHE_CP_ISTIO_SELECTOR / _PORTS are checked at startup, not on the first policy change."""
    from pydantic import ValidationError

    for bad, message in [({"istio_selector": "app=bad value"}, "not a Kubernetes label value"),
                         ({"istio_selector": "app"}, "is not KEY=VALUE"),
                         ({"istio_http_ports": "80x"}, "must be comma-separated numbers"),
                         ({"istio_http_ports": "", "istio_grpc_ports": ""}, "at least one REST or gRPC port")]:
        with pytest.raises(ValidationError, match=message):
            Settings(**bad)
    rest_only = Settings(istio_selector="tier=inference", istio_http_ports="8080", istio_grpc_ports="",
                         istio_service_ports="80").istio_workloads()
    assert (dict(rest_only.labels), rest_only.ports, rest_only.service_ports) == ({"tier": "inference"}, (8080,), (80,))
