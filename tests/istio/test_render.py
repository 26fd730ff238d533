"""`meshcache istio render` and `oci-layout`: rendered output validates, pins the built module,
and applies colour, namespace and the policy snapshot from each source."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from control_plane.snapshots import Snapshot
from meshcache.cli import main
from meshcache.istio import crossref, oci, render, validate
from tests.control_plane.helpers import READ_TOKEN, ControlPlaneProc


def _render(tmp_path: Path, *args: str) -> tuple[list[dict], dict]:
    out = tmp_path / "out"
    assert main(["istio", "render", "--out", str(out), *args]) == 0
    objects = validate.load_yaml_objects(out / "meshcache-istio.yaml")
    operator = validate.load_yaml_objects(out / "istio-operator.yaml")[0]
    return objects, operator


def _one(objects: list[dict], kind: str) -> dict:
    found = [o for o in objects if o["kind"] == kind]
    assert len(found) == 1, [o["metadata"]["name"] for o in found]
    return found[0]


def test_render_applies_namespace_and_colour_and_validates(tmp_path: Path, pins: render.Pins,
                                                            filter_wasm: Path, crds: dict) -> None:
    objects, operator = _render(tmp_path, "--namespace", "ml-prod", "--color", "green", "--also-color", "blue")
    report = validate.validate_all([*objects, operator])
    assert report.ok, report.errors
    errors = crossref.check_all(objects, pins.image_digest, pins.module_sha256, elsewhere=frozenset({"blue"}))
    assert not errors, errors
    assert {o["metadata"].get("namespace") for o in objects if o["kind"] != "Namespace"} == {"ml-prod"}
    assert _one(objects, "Namespace")["metadata"]["name"] == "ml-prod"
    text = json.dumps(objects)
    assert "/ns/meshcache/" not in text and ".meshcache.svc" not in text and "cluster.local/ns/ml-prod/sa/" in text
    assert operator["spec"]["meshConfig"]["configSources"][1]["address"] == \
        "xds://meshcache-control-plane.ml-prod.svc.cluster.local:18000"

    engine = next(o for o in objects
                  if o["kind"] == "Deployment" and o["metadata"]["labels"]["app"] == "meshcache-engine")
    assert engine["metadata"]["name"] == "meshcache-engine-green"
    assert engine["spec"]["template"]["metadata"]["labels"]["color"] == "green"
    proxy_config = engine["spec"]["template"]["metadata"]["annotations"]["proxy.istio.io/config"]
    assert "MESHCACHE_TRAFFIC_COLOR: green" in proxy_config
    wp = _one(objects, "WasmPlugin")
    assert wp["metadata"]["name"] == "meshcache-green"
    assert wp["spec"]["selector"]["matchLabels"] == {"app": "meshcache-engine", "color": "green"}
    assert wp["spec"]["pluginConfig"] == {**render.demo_plugin_config(), "color": "green", "hold_headers": False}
    vs = _one(objects, "VirtualService")["spec"]["http"]
    assert [(r["name"], r["route"][0]["destination"]["subset"]) for r in vs] == [
        ("color-green", "green"), ("color-blue", "blue"), ("default", "green")]
    dr = next(o for o in objects if o["kind"] == "DestinationRule" and o["spec"]["host"] == "meshcache-engine")
    assert [s["name"] for s in dr["spec"]["subsets"]] == ["green", "blue"]

    # The pins are the built module's: the image's only layer holds exactly its bytes.
    module = filter_wasm.read_bytes()
    image = oci.build_image(module)
    assert wp["spec"]["sha256"] == image.digest == pins.image_digest
    assert wp["spec"]["url"].endswith(f"@sha256:{image.digest}")
    assert wp["metadata"]["annotations"]["meshcache.io/module-sha256"] == hashlib.sha256(module).hexdigest()
    assert oci.extract_module(image) == module
    manifest = json.loads(image.manifest)
    assert manifest["layers"][0]["digest"] == f"sha256:{hashlib.sha256(image.layer).hexdigest()}"


def test_render_from_snapshot_files(tmp_path: Path) -> None:
    snap = Snapshot.from_record(json.dumps({"version": 7, "policies": [
        {"model_prefix": "llama", "ttl_s": 60, "max_ttl_s": 120, "generation": 3}]}))
    record = tmp_path / "record.json"
    record.write_text(snap.to_record())
    api_body = tmp_path / "api.json"
    api_body.write_text(json.dumps({"version": 7, "plugin_config": snap.plugin_config_json}))
    for source in (record, api_body):
        objects, _ = _render(tmp_path, "--snapshot", str(source), "--color", "red")
        config = _one(objects, "WasmPlugin")["spec"]["pluginConfig"]
        assert config == {**snap.plugin_config(), "color": "red", "hold_headers": False}
        assert config["version"] == "7" and config["policies"][0]["model_prefix"] == "llama"
    (tmp_path / "bad.json").write_text(json.dumps({"version": 1, "policies": [{"model_prefix": "x"}]}))
    with pytest.raises(ValueError):
        render.plugin_config_from_file(tmp_path / "bad.json")


def test_render_from_the_control_plane_api(tmp_path: Path, cp: ControlPlaneProc) -> None:
    assert cp.client().put("/v1/policies/bert", json={"ttl_s": 42}).status_code == 200
    objects, _ = _render(tmp_path, "--control-plane", cp.url, "--token", READ_TOKEN)
    expected = json.loads(cp.client().get("/v1/snapshot").json()["plugin_config"])
    assert _one(objects, "WasmPlugin")["spec"]["pluginConfig"] == {**expected, "color": "blue", "hold_headers": False}
    assert main(["istio", "render", "--control-plane", cp.url, "--token", ""]) == 2


def test_image_digest_override_and_bad_input(tmp_path: Path) -> None:
    digest = "ab" * 32
    objects, _ = _render(tmp_path, "--image-digest", digest, "--filter-repository", "ghcr.io/acme/mc")
    wp = _one(objects, "WasmPlugin")["spec"]
    assert (wp["url"], wp["sha256"]) == (f"oci://ghcr.io/acme/mc@sha256:{digest}", digest)
    assert main(["istio", "render", "--image-digest", "sha256:" + digest]) == 2
    assert main(["istio", "render", "--color", "Not_A_Label"]) == 2


def test_render_the_ecds_overlay_into_another_namespace(tmp_path: Path, pins: render.Pins, crds: dict) -> None:
    objects, _ = _render(tmp_path, "--overlay", str(render.ISTIO_DIR / "overlays" / "ecds"), "--namespace", "ml")
    assert validate.validate_all(objects).ok
    assert not crossref.check_all(objects, pins.image_digest, pins.module_sha256)
    assert not [o for o in objects if o["kind"] == "WasmPlugin"]
    ecds = next(o for o in objects if o["metadata"]["name"] == "meshcache-ecds")
    cluster = ecds["spec"]["configPatches"][0]["patch"]["value"]
    address = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
    assert address["address"] == "meshcache-control-plane.ml.svc.cluster.local"
    assert "spiffe://cluster.local/ns/ml/sa/meshcache-control-plane" in json.dumps(cluster)


def test_oci_layout_is_content_addressed(tmp_path: Path, pins: render.Pins) -> None:
    assert main(["istio", "oci-layout", "--out", str(tmp_path / "layout"), "--tag", "v1"]) == 0
    index = json.loads((tmp_path / "layout" / "index.json").read_text())
    assert index["manifests"][0]["digest"] == f"sha256:{pins.image_digest}"
    for blob in (tmp_path / "layout" / "blobs" / "sha256").iterdir():
        assert hashlib.sha256(blob.read_bytes()).hexdigest() == blob.name
    assert len(list((tmp_path / "layout" / "blobs" / "sha256").iterdir())) == 3
