"""Every object under istio/ validates against Istio's CRD schemas (unknown fields are errors) or
Kubernetes' schemas, cross-references and the startup-order (deadlock) rules hold for every build
and for what the control plane serves istiod, the committed base pins the built module, and
deliberately broken manifests are caught."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from meshcache.ctl.istio import crossref, kustomize, render, validate
from tests.istio.helpers import ISTIO_DIR, KUSTOMIZATIONS, OWN_ENGINE_KUSTOMIZATIONS

Obj = dict


def _resource_files() -> list[Path]:
    """Every YAML under istio/ holding whole objects: not kustomizations, not patch files (those
    are partial objects, validated through the overlay builds)."""
    patches = set()
    for kfile in ISTIO_DIR.rglob(kustomize.KUSTOMIZATION):
        for p in yaml.safe_load(kfile.read_text()).get("patches", []):
            if "path" in p:
                patches.add((kfile.parent / p["path"]).resolve())
    return [p for p in sorted(ISTIO_DIR.rglob("*.yaml"))
            if p.name != kustomize.KUSTOMIZATION and p.resolve() not in patches]


def test_resource_files_are_found() -> None:
    names = {p.relative_to(ISTIO_DIR).as_posix() for p in _resource_files()}
    assert {"base/control-plane.yaml", "base/security.yaml", "base/traffic.yaml",
            "install/istio-operator.yaml", "install/istio-operator-mcp.yaml"} <= names
    assert "overlays/external-redis/redis-url.yaml" not in names  # a patch


@pytest.mark.parametrize("path", _resource_files(), ids=lambda p: p.relative_to(ISTIO_DIR).as_posix())
def test_every_file_validates(path: Path, crds: dict) -> None:
    objects = validate.load_yaml_objects(path)
    report = validate.validate_all(objects)
    assert report.ok, "\n".join(report.errors)


@pytest.mark.parametrize("directory", OWN_ENGINE_KUSTOMIZATIONS, ids=lambda p: p.name)
def test_every_build_validates_and_cross_references_hold(directory: Path, crds: dict, pins: render.Pins) -> None:
    objects = kustomize.build(directory)
    kinds = {o["kind"] for o in objects}
    assert {"PeerAuthentication", "DestinationRule", "AuthorizationPolicy", "VirtualService", "Gateway",
            "NetworkPolicy"} <= kinds
    report = validate.validate_all(objects)
    assert report.ok, "\n".join(report.errors)
    # With what its control plane serves istiod for the demo policies (the MCP preview).
    served = render.mcp_objects(objects, render.demo_plugin_config())
    assert served and validate.validate_all(served).ok, validate.validate_all(served).errors
    errors = crossref.check_all(objects + served, pins.image_digest)
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=lambda p: p.name)
def test_startup_order_cannot_deadlock(directory: Path) -> None:
    """The deadlock rules, statically: the control plane (and what it needs) starts without
    istiod; its xDS port is TLS behind a NetworkPolicy for istiod only; Istio is installed in two
    steps, the second adding the MCP source over TLS."""
    objects = kustomize.build(directory)
    assert crossref.check_startup(objects) == []
    cp = next(o for o in objects if o["metadata"]["name"] == "meshcache-control-plane" and o["kind"] == "Deployment")
    assert not crossref.injected(cp)
    step1, step2 = (validate.load_yaml_objects(ISTIO_DIR / "install" / f)[0]
                    for f in ("istio-operator.yaml", "istio-operator-mcp.yaml"))
    assert crossref.check_operator_steps(step1, step2) == []


def test_committed_base_is_the_render_of_the_defaults(filter_wasm: Path) -> None:
    """The committed files and the renderer agree; pins included (stale after a filter build:
    run `meshcache istio render --update-base`)."""
    assert render.render(render.RenderOptions(module_path=filter_wasm)) == kustomize.build(render.BASE_DIR)


def test_default_install_caches_grpc(pins: render.Pins) -> None:
    """istio/base is the full mode: istiod gets EnvoyFilters with the gRPC-hit pieces, the filter
    holds request headers (allow_on_headers_stop_iteration) and its module is the pinned image."""
    objs = kustomize.build(render.BASE_DIR)
    env = render.control_plane_env(objs)
    assert env["MESHCACHE_CP_ISTIO_MODE"] == "full"
    assert env["MESHCACHE_CP_ISTIO_WASM_URL"] == f"oci://{render.FILTER_REPOSITORY}@sha256:{pins.image_digest}"
    [ef, client] = render.mcp_objects(objs, render.demo_plugin_config())
    assert ef["kind"] == "EnvoyFilter" and ef["spec"]["priority"] == 10
    # Cache affinity: the client role on callers' outbound chains to both engine ports.
    assert client["metadata"]["name"] == "meshcache-client"
    assert client["spec"]["workloadSelector"]["labels"] == {"meshcache.io/cache-affinity": "true"}
    outbound = [p for p in client["spec"]["configPatches"] if p["applyTo"] == "HTTP_FILTER"]
    assert [(p["match"]["context"], p["match"]["listener"]["portNumber"]) for p in outbound] == [
        ("SIDECAR_OUTBOUND", 8000), ("SIDECAR_OUTBOUND", 8001)]
    patches = ef["spec"]["configPatches"]
    wasm = patches[0]["patch"]["value"]["typed_config"]["config"]
    assert wasm["allow_on_headers_stop_iteration"] is True and wasm["vm_config"]["vm_id"] == "meshcache"
    assert wasm["vm_config"]["code"]["remote"]["sha256"] == pins.image_digest
    grpc_filters = [p["patch"]["value"]["name"] for p in patches
                    if p["applyTo"] == "HTTP_FILTER" and p["match"]["listener"]["portNumber"] == 8001]
    assert grpc_filters == ["meshcache", "meshcache.grpc_hit_body"]
    assert [p["patch"]["value"]["name"] for p in patches if p["applyTo"] == "HTTP_ROUTE"] == [
        "meshcache_grpc_stale", "meshcache_grpc_hit"]
    op = validate.load_yaml_objects(ISTIO_DIR / "install" / "istio-operator-mcp.yaml")[0]["spec"]["meshConfig"]
    assert "meshMTLS" not in op  # no mesh-wide TLS change unless asked (render --mesh-tls13)
    assert [s["address"] for s in op["configSources"]] == [
        "k8s://", "xds://meshcache-control-plane.meshcache.svc.cluster.local:18000"]
    assert op["configSources"][1]["tlsSettings"]["mode"] == "SIMPLE"


# ---- deliberately broken manifests ----------------------------------------------------------

def _find(objs: list[Obj], kind: str, name: str | None = None) -> Obj:
    return next(o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name))


def _set_unknown_field(o: list[Obj]) -> None:
    _find(o, "Gateway")["spec"]["servers"][0]["port"]["protocl"] = "HTTP"


def _bad_enum(o: list[Obj]) -> None:
    _find(o, "PeerAuthentication", "default")["spec"]["mtls"]["mode"] = "STRICTEST"


def _nested_unknown_field(o: list[Obj]) -> None:
    _find(o, "VirtualService")["spec"]["http"][0]["route"][0]["destination"]["subsets"] = "blue"


def _core_unknown_field(o: list[Obj]) -> None:
    _find(o, "Deployment", "meshcache-engine-blue")["spec"]["template"]["spec"]["containers"][0]["imagePull"] = "x"


def _bad_patch_operation(o: list[Obj]) -> None:
    _find(o, "EnvoyFilter")["spec"]["configPatches"][1]["patch"]["operation"] = "INSERT_BEHIND"


def _unknown_envoy_filter_field(o: list[Obj]) -> None:
    _find(o, "EnvoyFilter")["spec"]["configPatches"][1]["match"]["listner"] = {}


SCHEMA_BREAKS: dict[str, tuple[Callable[[list[Obj]], None], str]] = {
    "unknown field": (_set_unknown_field, "port.protocl: unknown field"),
    "bad enum": (_bad_enum, "'STRICTEST' is not one of"),
    "nested unknown field": (_nested_unknown_field, "destination.subsets: unknown field"),
    "core unknown field": (_core_unknown_field, "'imagePull' was unexpected"),
    "patch operation": (_bad_patch_operation, "'INSERT_BEHIND' is not one of"),
    "envoy filter unknown field": (_unknown_envoy_filter_field, "match.listner: unknown field"),
}


def _with_mcp(objs: list[Obj]) -> list[Obj]:
    return objs + render.mcp_objects(objs, render.demo_plugin_config())


@pytest.mark.parametrize("name", SCHEMA_BREAKS)
def test_broken_manifest_fails_schema_validation(name: str, crds: dict) -> None:
    objs = _with_mcp(kustomize.build(render.BASE_DIR))
    assert validate.validate_all(objs).ok
    breaker, expected = SCHEMA_BREAKS[name]
    broken = copy.deepcopy(objs)
    breaker(broken)
    errors = validate.validate_all(broken).errors
    assert any(expected in e for e in errors), errors


def _subset_typo(o: list[Obj]) -> None:
    _find(o, "VirtualService")["spec"]["http"][-1]["route"][0]["destination"]["subset"] = "bleu"


def _selector_mismatch(o: list[Obj]) -> None:
    _find(o, "AuthorizationPolicy", "meshcache-engine")["spec"]["selector"]["matchLabels"]["app"] = "engine"


def _stale_digest(o: list[Obj]) -> None:
    for e in _find(o, "Deployment", "meshcache-control-plane")["spec"]["template"]["spec"]["containers"][0]["env"]:
        if e["name"] == "MESHCACHE_CP_ISTIO_WASM_SHA256":
            e["value"] = "0" * 64


def _spiffe_principal(o: list[Obj]) -> None:
    rule = _find(o, "AuthorizationPolicy", "meshcache-engine")["spec"]["rules"][0]
    rule["from"][0]["source"]["principals"][0] = "spiffe://cluster.local/ns/meshcache/sa/meshcache-client"


def _unknown_service_account(o: list[Obj]) -> None:
    rule = _find(o, "AuthorizationPolicy", "meshcache-engine")["spec"]["rules"][0]
    rule["from"][0]["source"]["principals"][0] = "cluster.local/ns/meshcache/sa/nobody"


def _colour_mismatch(o: list[Obj]) -> None:
    ann = _find(o, "Deployment", "meshcache-engine-blue")["spec"]["template"]["metadata"]["annotations"]
    ann["proxy.istio.io/config"] = ann["proxy.istio.io/config"].replace("MESHCACHE_TRAFFIC_COLOR: blue",
                                                                        "MESHCACHE_TRAFFIC_COLOR: green", 1)


def _wrong_port(o: list[Obj]) -> None:
    _find(o, "AuthorizationPolicy", "meshcache-engine")["spec"]["rules"][0]["to"][0]["operation"]["ports"] = ["9000"]


def _volume_array(o: list[Obj]) -> None:
    ann = _find(o, "Deployment", "meshcache-engine-blue")["spec"]["template"]["metadata"]["annotations"]
    ann["sidecar.istio.io/userVolume"] = '[{"name":"extra","emptyDir":{}}]'


def _bad_volume(o: list[Obj]) -> None:
    ann = _find(o, "Deployment", "meshcache-engine-blue")["spec"]["template"]["metadata"]["annotations"]
    ann["sidecar.istio.io/userVolume"] = '{"extra":{"emptyDirr":{}}}'
    ann["sidecar.istio.io/userVolumeMount"] = '{"extra":{"mountPath":"/x"}}'


def _no_priority(o: list[Obj]) -> None:
    del _find(o, "EnvoyFilter")["spec"]["priority"]


def _lua_before_wasm(o: list[Obj]) -> None:
    patches = _find(o, "EnvoyFilter")["spec"]["configPatches"]
    patches[2], patches[3] = patches[3], patches[2]


def _stale_route_dropped(o: list[Obj]) -> None:
    ef = _find(o, "EnvoyFilter")
    ef["spec"]["configPatches"] = [p for p in ef["spec"]["configPatches"]
                                   if p["patch"].get("value", {}).get("name") != "meshcache_grpc_stale"]


def _gateway_route_without_port(o: list[Obj]) -> None:
    del _find(o, "VirtualService", "meshcache-engine-ingress")["spec"]["http"][-1]["route"][0]["destination"]["port"]


def _subset_without_hash(o: list[Obj]) -> None:
    del _find(o, "DestinationRule", "meshcache-engine")["spec"]["subsets"][0]["trafficPolicy"]


def _client_without_held_headers(o: list[Obj]) -> None:
    wasm = _find(o, "EnvoyFilter", "meshcache-client")["spec"]["configPatches"][0]["patch"]["value"]["typed_config"]
    wasm["config"]["allow_on_headers_stop_iteration"] = False


def _client_role_on_another_port(o: list[Obj]) -> None:
    _find(o, "EnvoyFilter", "meshcache-client")["spec"]["configPatches"][1]["match"]["listener"]["portNumber"] = 9000


def _selects_control_plane(o: list[Obj]) -> None:
    _find(o, "EnvoyFilter")["spec"]["workloadSelector"]["labels"] = {"app": "meshcache-control-plane"}


def _cp_env(o: list[Obj], name: str, value: str) -> None:
    for e in _find(o, "Deployment", "meshcache-control-plane")["spec"]["template"]["spec"]["containers"][0]["env"]:
        if e["name"] == name:
            e["value"] = value


def _stats_matcher_dropped(o: list[Obj]) -> None:
    ann = _find(o, "Deployment", "meshcache-engine-blue")["spec"]["template"]["metadata"]["annotations"]
    proxy = yaml.safe_load(ann["proxy.istio.io/config"])
    del proxy["proxyStatsMatcher"]
    ann["proxy.istio.io/config"] = yaml.safe_dump(proxy)


def _stats_service_not_headless(o: list[Obj]) -> None:
    del _find(o, "Service", "meshcache-engine-proxies")["spec"]["clusterIP"]


CROSSREF_BREAKS: dict[str, tuple[Callable[[list[Obj]], None], str]] = {
    "sidecar drops the filter's stats": (_stats_matcher_dropped, "its sidecar drops the filter's stats"),
    "proxy stats Service not headless": (_stats_service_not_headless, "need a headless Service"),
    "proxy stats on the app port": (lambda o: _cp_env(o, "MESHCACHE_CP_PROXY_STATS_TEMPLATE",
                                                     "http://{ip}:8002/metrics"), "is not an Istio sidecar's stats"),
    "proxy stats DNS without {ip}": (lambda o: _cp_env(o, "MESHCACHE_CP_PROXY_STATS_TEMPLATE",
                                                      "http://meshcache-engine:15090/stats/prometheus"),
                                     "needs MESHCACHE_CP_PROXY_STATS_TEMPLATE with {ip}"),
    "proxy stats DNS name of no Service": (lambda o: _cp_env(o, "MESHCACHE_CP_PROXY_STATS_DNS", "meshcache-engin"),
                                           "is no Service here"),
    "subset typo": (_subset_typo, "uses subset 'bleu'"),
    "selector mismatch": (_selector_mismatch, "selector matches no workload"),
    "stale digest": (_stale_digest, "is not the built module's image digest"),
    "spiffe principal": (_spiffe_principal, "is not cluster.local/ns/<ns>/sa/<sa>"),
    "unknown service account": (_unknown_service_account, "names no ServiceAccount"),
    "colour mismatch": (_colour_mismatch, "proxyMetadata colour 'green'"),
    "wrong port": (_wrong_port, "port 9000 is no container port"),
    "userVolume as an array": (_volume_array, "must be JSON objects keyed by volume name"),
    "bad user volume": (_bad_volume, "'emptyDirr' was unexpected"),
    "no EnvoyFilter priority": (_no_priority, "IST0151"),
    "Lua before the wasm filter": (_lua_before_wasm, "must come right after the meshcache filter"),
    "no stale-if-error route": (_stale_route_dropped, "no meshcache_grpc_stale route inserted first"),
    "gateway route without port": (_gateway_route_without_port, "needs a destination port"),
    "filter on a pod without sidecar": (_selects_control_plane, "selects pods without a sidecar"),
    "subset without consistent hash": (_subset_without_hash, "does not hash on x-meshcache-route-key"),
    "client role without held headers": (_client_without_held_headers, "needs held request headers"),
    "client role on a port the engine lacks": (_client_role_on_another_port, "outbound port 9000 is no port"),
}


@pytest.mark.parametrize("name", CROSSREF_BREAKS)
def test_broken_manifest_fails_cross_references(name: str, pins: render.Pins) -> None:
    objs = _with_mcp(kustomize.build(render.BASE_DIR))
    assert not crossref.check_all(objs, pins.image_digest)
    breaker, expected = CROSSREF_BREAKS[name]
    breaker(objs)
    errors = crossref.check_all(objs, pins.image_digest)
    assert any(expected in e for e in errors), errors


def _cp(o: list[Obj]) -> Obj:
    return _find(o, "Deployment", "meshcache-control-plane")


def _injected_with_hold(o: list[Obj]) -> None:
    tmpl = _cp(o)["spec"]["template"]["metadata"]
    tmpl["labels"]["sidecar.istio.io/inject"] = "true"
    tmpl["annotations"] = {"proxy.istio.io/config": "holdApplicationUntilProxyStarts: true\n"}


def _injected_xds_captured(o: list[Obj]) -> None:
    del _cp(o)["spec"]["template"]["metadata"]["labels"]["sidecar.istio.io/inject"]


def _redis_in_mesh(o: list[Obj]) -> None:
    _find(o, "StatefulSet")["spec"]["template"]["metadata"]["labels"]["sidecar.istio.io/inject"] = "true"


def _readiness_on_redis(o: list[Obj]) -> None:
    _cp(o)["spec"]["template"]["spec"]["containers"][0]["readinessProbe"] = {"httpGet": {"path": "/readyz",
                                                                                         "port": "http"}}


def _plaintext_xds(o: list[Obj]) -> None:
    c = _cp(o)["spec"]["template"]["spec"]["containers"][0]
    c["env"] = [e for e in c["env"] if not e["name"].startswith("MESHCACHE_CP_XDS_TLS")]


def _xds_open_to_namespace(o: list[Obj]) -> None:
    _find(o, "NetworkPolicy", "meshcache-control-plane")["spec"]["ingress"][0]["from"].append({"podSelector": {}})


def _no_network_policy(o: list[Obj]) -> None:
    o.remove(_find(o, "NetworkPolicy", "meshcache-control-plane"))


STARTUP_BREAKS: dict[str, tuple[Callable[[list[Obj]], None], str]] = {
    "injected, app held": (_injected_with_hold, "holdApplicationUntilProxyStarts waits"),
    "injected, xDS through the sidecar": (_injected_xds_captured, "istiod could never sync"),
    "Redis in the mesh": (_redis_in_mesh, "must be outside the mesh too"),
    "readiness needs Redis": (_readiness_on_redis, "readiness on /readyz needs Redis"),
    "plaintext xDS": (_plaintext_xds, "must serve TLS"),
    "xDS open to the namespace": (_xds_open_to_namespace, "only istiod may connect"),
    "no NetworkPolicy": (_no_network_policy, "open to every pod"),
}


@pytest.mark.parametrize("name", STARTUP_BREAKS)
def test_deadlock_prone_manifests_are_caught(name: str) -> None:
    objs = kustomize.build(render.BASE_DIR)
    breaker, expected = STARTUP_BREAKS[name]
    breaker(objs)
    errors = crossref.check_startup(objs)
    assert any(expected in e for e in errors), errors


def test_injected_control_plane_with_xds_excluded_and_no_hold_is_allowed() -> None:
    """The other form the rules allow: a sidecar whose capture skips the xDS port, no hold."""
    objs = kustomize.build(render.BASE_DIR)
    tmpl = _cp(objs)["spec"]["template"]["metadata"]
    del tmpl["labels"]["sidecar.istio.io/inject"]
    tmpl["annotations"] = {"traffic.sidecar.istio.io/excludeInboundPorts": "18000"}
    assert crossref.check_startup(objs) == []


def test_operator_steps_are_checked() -> None:
    step1, step2 = (validate.load_yaml_objects(ISTIO_DIR / "install" / f)[0]
                    for f in ("istio-operator.yaml", "istio-operator-mcp.yaml"))
    assert any("step 1" in e for e in crossref.check_operator_steps(step2, step2))
    plain = copy.deepcopy(step2)
    del plain["spec"]["meshConfig"]["configSources"][1]["tlsSettings"]
    assert any("mode SIMPLE" in e for e in crossref.check_operator_steps(step1, plain))
    no_k8s = copy.deepcopy(step2)
    no_k8s["spec"]["meshConfig"]["configSources"].pop(0)
    assert any("k8s://" in e for e in crossref.check_operator_steps(step1, no_k8s))


def test_broken_file_on_disk_is_caught_by_the_cli(tmp_path: Path, filter_wasm: Path) -> None:
    from meshcache.ctl.cli import main
    objs = kustomize.build(render.BASE_DIR)
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text(kustomize.dump(objs))
    _find(objs, "DestinationRule", "meshcache-engine")["spec"]["trafficPolicy"]["tls"]["mode"] = "MUTUAL_ISTIO"
    bad.write_text(kustomize.dump(objs))
    assert main(["istio", "validate", str(good), "--module", str(filter_wasm)]) == 0
    assert main(["istio", "validate", str(bad), "--module", str(filter_wasm)]) == 1


def test_istio_operator_is_validated_strictly() -> None:
    op = yaml.safe_load((ISTIO_DIR / "install" / "istio-operator-mcp.yaml").read_text())
    assert validate.validate_object(op) == []
    op["spec"]["meshConfig"]["configSources"][1]["tlsSettings"]["mode"] = "TLS"
    op["spec"]["meshConfig"]["meshMTLS"] = {"minProtocolVersion": "TLSV1_4"}
    op["spec"]["meshConfig"]["configSources"].append({"address": "http://cp:18000"})
    errors = validate.validate_object(op)
    assert any("TLSV1_4" in e for e in errors) and any("http://cp:18000" in e for e in errors)
    assert any("'TLS' is not one of" in e for e in errors)


def test_missing_crd_file_fails_with_a_clear_message(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHCACHE_ISTIO_CRDS", str(tmp_path / "nope.yaml"))
    with pytest.raises(FileNotFoundError, match="Istio CRD schemas not found .*MESHCACHE_ISTIO_CRDS"):
        validate.crd_file()


@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=lambda p: p.name)
def test_a_lost_replica_is_retried_elsewhere_and_ejected(directory: Path) -> None:
    """Every route to the cached workloads retries connection-level failures, reset included
    (Istio's default retryOn lacks it), and the DestinationRule ejects on local-origin failures
    only (answers, even 5xx, never eject)."""
    objects = kustomize.build(directory)
    for vs in (o for o in objects if o["kind"] == "VirtualService"):
        for route in vs["spec"]["http"]:
            retry_on = set(route["retries"]["retryOn"].split(","))
            assert {"connect-failure", "refused-stream", "reset"} <= retry_on and route["retries"]["attempts"] >= 1
    [dr] = [o for o in objects if o["kind"] == "DestinationRule"]
    outlier = dr["spec"]["trafficPolicy"]["outlierDetection"]
    assert outlier["splitExternalLocalOriginErrors"] and outlier["consecutiveLocalOriginFailures"] >= 1
    assert outlier["consecutive5xxErrors"] == 0
