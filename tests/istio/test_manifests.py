"""Every object under istio/ validates against Istio's CRD schemas (unknown fields are errors) or
Kubernetes' schemas, cross-references hold, the committed base pins the built module, and
deliberately broken manifests are caught."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from meshcache.istio import crossref, envoyfilter, kustomize, render, validate
from tests.istio.conftest import ISTIO_DIR, KUSTOMIZATIONS

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
    assert {"base/wasmplugin.yaml", "base/envoyfilter.yaml", "base/security.yaml", "base/traffic.yaml",
            "install/istio-operator.yaml", "overlays/ecds/envoyfilter-ecds.yaml"} <= names
    assert "overlays/external-redis/redis-url.yaml" not in names  # a patch


@pytest.mark.parametrize("path", _resource_files(), ids=lambda p: p.relative_to(ISTIO_DIR).as_posix())
def test_every_file_validates(path: Path, crds: dict) -> None:
    objects = validate.load_yaml_objects(path)
    report = validate.validate_all(objects)
    assert report.ok, "\n".join(report.errors)


@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=lambda p: p.name)
def test_every_build_validates_and_cross_references_hold(directory: Path, crds: dict, pins: render.Pins) -> None:
    objects = kustomize.build(directory)
    kinds = {o["kind"] for o in objects}
    assert {"PeerAuthentication", "DestinationRule", "AuthorizationPolicy", "VirtualService", "EnvoyFilter"} <= kinds
    report = validate.validate_all(objects)
    assert report.ok, "\n".join(report.errors)
    errors = crossref.check_all(objects, pins.image_digest, pins.module_sha256)
    assert not errors, "\n".join(errors)


def test_committed_base_is_the_render_of_the_defaults(filter_wasm: Path) -> None:
    """The committed files and the renderer agree; pins included (stale after a filter build:
    run `meshcache istio render --update-base`)."""
    assert render.render(render.RenderOptions(module_path=filter_wasm)) == kustomize.build(render.BASE_DIR)


def test_committed_envoy_filters_are_the_generated_ones() -> None:
    def load(rel: str) -> Obj:
        return validate.load_yaml_objects(ISTIO_DIR / rel)[0]
    assert load("base/envoyfilter.yaml") == envoyfilter.envoy_filter()
    assert load("overlays/ecds/envoyfilter-ecds.yaml") == envoyfilter.ecds_envoy_filter()


def test_wasm_plugin_contract(pins: render.Pins) -> None:
    objs = kustomize.build(render.BASE_DIR)
    wp = next(o for o in objs if o["kind"] == "WasmPlugin")["spec"]
    assert wp["url"] == f"oci://{render.FILTER_REPOSITORY}@sha256:{pins.image_digest}"
    assert (wp["sha256"], wp["failStrategy"], wp["phase"], wp["priority"]) == \
        (pins.image_digest, "FAIL_OPEN", "STATS", -100)
    assert wp["match"] == [{"mode": "SERVER", "ports": [{"number": 8000}, {"number": 8001}]}]
    assert wp["pluginConfig"] == {**render.demo_plugin_config(), "color": "blue", "hold_headers": False}
    op = validate.load_yaml_objects(ISTIO_DIR / "install" / "istio-operator.yaml")[0]["spec"]["meshConfig"]
    assert op["meshMTLS"]["minProtocolVersion"] == "TLSV1_3"
    assert [s["address"] for s in op["configSources"]] == [
        "k8s://", "xds://meshcache-control-plane.meshcache.svc.cluster.local:18000"]


# ---- deliberately broken manifests ----------------------------------------------------------

def _find(objs: list[Obj], kind: str, name: str | None = None) -> Obj:
    return next(o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name))


def _set_unknown_wasm_field(o: list[Obj]) -> None:
    _find(o, "WasmPlugin")["spec"]["failstrategy"] = "FAIL_OPEN"


def _bad_enum(o: list[Obj]) -> None:
    _find(o, "PeerAuthentication", "default")["spec"]["mtls"]["mode"] = "STRICTEST"


def _nested_unknown_field(o: list[Obj]) -> None:
    _find(o, "VirtualService")["spec"]["http"][0]["route"][0]["destination"]["subsets"] = "blue"


def _core_unknown_field(o: list[Obj]) -> None:
    _find(o, "Deployment", "meshcache-engine-blue")["spec"]["template"]["spec"]["containers"][0]["imagePull"] = "x"


def _bad_sha_pattern(o: list[Obj]) -> None:
    _find(o, "WasmPlugin")["spec"]["sha256"] = "sha256:abc"


def _duplicate_list_map_key(o: list[Obj]) -> None:
    spec = _find(o, "WasmPlugin")["spec"]
    spec["match"][0]["ports"].append({"number": 8000})


SCHEMA_BREAKS: dict[str, tuple[Callable[[list[Obj]], None], str]] = {
    "unknown field": (_set_unknown_wasm_field, "spec.failstrategy: unknown field"),
    "bad enum": (_bad_enum, "'STRICTEST' is not one of"),
    "nested unknown field": (_nested_unknown_field, "destination.subsets: unknown field"),
    "core unknown field": (_core_unknown_field, "'imagePull' was unexpected"),
    "sha256 pattern": (_bad_sha_pattern, "does not match"),
    "list-map duplicate": (_duplicate_list_map_key, "duplicate entries for list-map keys"),
}


@pytest.mark.parametrize("name", SCHEMA_BREAKS)
def test_broken_manifest_fails_schema_validation(name: str, crds: dict) -> None:
    objs = kustomize.build(render.BASE_DIR)
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
    _find(o, "WasmPlugin")["spec"]["sha256"] = "0" * 64


def _spiffe_principal(o: list[Obj]) -> None:
    rule = _find(o, "AuthorizationPolicy", "meshcache-engine")["spec"]["rules"][0]
    rule["from"][0]["source"]["principals"][0] = "spiffe://cluster.local/ns/meshcache/sa/meshcache-client"


def _unknown_service_account(o: list[Obj]) -> None:
    rule = _find(o, "AuthorizationPolicy", "meshcache-redis")["spec"]["rules"][0]
    rule["from"][0]["source"]["principals"][0] = "cluster.local/ns/meshcache/sa/nobody"


def _colour_mismatch(o: list[Obj]) -> None:
    ann = _find(o, "Deployment", "meshcache-engine-blue")["spec"]["template"]["metadata"]["annotations"]
    ann["proxy.istio.io/config"] = ann["proxy.istio.io/config"].replace("MESHCACHE_TRAFFIC_COLOR: blue",
                                                                        "MESHCACHE_TRAFFIC_COLOR: green", 1)


def _unmounted_module(o: list[Obj]) -> None:
    ann = _find(o, "Deployment", "meshcache-engine-blue")["spec"]["template"]["metadata"]["annotations"]
    ann["sidecar.istio.io/userVolumeMount"] = ann["sidecar.istio.io/userVolumeMount"].replace("/etc/meshcache", "/opt")


def _wrong_port(o: list[Obj]) -> None:
    _find(o, "AuthorizationPolicy", "meshcache-engine")["spec"]["rules"][0]["to"][0]["operation"]["ports"] = ["9000"]


def _bad_image_volume(o: list[Obj]) -> None:
    ann = _find(o, "Deployment", "meshcache-engine-blue")["spec"]["template"]["metadata"]["annotations"]
    ann["sidecar.istio.io/userVolume"] = ann["sidecar.istio.io/userVolume"].replace('"pullPolicy"', '"pullPolice"')


CROSSREF_BREAKS: dict[str, tuple[Callable[[list[Obj]], None], str]] = {
    "subset typo": (_subset_typo, "uses subset 'bleu'"),
    "selector mismatch": (_selector_mismatch, "selector matches no workload"),
    "stale digest": (_stale_digest, "is not the built module's image digest"),
    "spiffe principal": (_spiffe_principal, "is not cluster.local/ns/<ns>/sa/<sa>"),
    "unknown service account": (_unknown_service_account, "names no ServiceAccount"),
    "colour mismatch": (_colour_mismatch, "proxyMetadata colour 'green'"),
    "unmounted module": (_unmounted_module, "is not under a mounted path"),
    "wrong port": (_wrong_port, "port 9000 is no container port"),
    "bad image volume": (_bad_image_volume, "'pullPolice' was unexpected"),
}


@pytest.mark.parametrize("name", CROSSREF_BREAKS)
def test_broken_manifest_fails_cross_references(name: str, pins: render.Pins) -> None:
    objs = kustomize.build(render.BASE_DIR)
    breaker, expected = CROSSREF_BREAKS[name]
    breaker(objs)
    errors = crossref.check_all(objs, pins.image_digest, pins.module_sha256)
    assert any(expected in e for e in errors), errors


def test_broken_file_on_disk_is_caught_by_the_cli(tmp_path: Path, filter_wasm: Path) -> None:
    from meshcache.cli import main
    objs = kustomize.build(render.BASE_DIR)
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text(kustomize.dump(objs))
    _find(objs, "DestinationRule", "meshcache-engine")["spec"]["trafficPolicy"]["tls"]["mode"] = "MUTUAL_ISTIO"
    bad.write_text(kustomize.dump(objs))
    assert main(["istio", "validate", str(good), "--module", str(filter_wasm)]) == 0
    assert main(["istio", "validate", str(bad), "--module", str(filter_wasm)]) == 1


def test_istio_operator_is_validated_strictly() -> None:
    op = yaml.safe_load((ISTIO_DIR / "install" / "istio-operator.yaml").read_text())
    assert validate.validate_object(op) == []
    op["spec"]["meshConfig"]["meshMTLS"]["minProtocolVersion"] = "TLSV1_4"
    op["spec"]["meshConfig"]["configSources"].append({"address": "http://cp:18000"})
    errors = validate.validate_object(op)
    assert any("TLSV1_4" in e for e in errors) and any("http://cp:18000" in e for e in errors)


def test_missing_crd_file_fails_with_a_clear_message(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHCACHE_ISTIO_CRDS", str(tmp_path / "nope.yaml"))
    with pytest.raises(FileNotFoundError, match="Istio CRD schemas not found .*MESHCACHE_ISTIO_CRDS"):
        validate.crd_file()
