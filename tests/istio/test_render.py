"""`meshcache istio render`, `oci-layout` and `xds-certs`: rendered output validates, pins the
built module, applies colour, namespace and the policy snapshot from each source, and gives both
install steps."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from meshcache.contract import oci
from meshcache.contract.native_filter import DYNAMIC_MODULE_TYPE_URL
from meshcache.contract.paths import filter_native
from meshcache.control_plane.snapshots import Snapshot
from meshcache.ctl.cli import main
from meshcache.ctl.istio import crossref, kustomize, render, validate
from tests.helpers.control_plane import READ_TOKEN, ControlPlaneProc


def _render(tmp_path: Path, *args: str) -> tuple[list[dict], dict, list[dict]]:
    """(manifests, step-2 IstioOperator, MCP preview)."""
    out = tmp_path / "out"
    assert main(["istio", "render", "--out", str(out), *args]) == 0
    objects = validate.load_yaml_objects(out / "meshcache-istio.yaml")
    step1 = validate.load_yaml_objects(out / "istio-operator.yaml")[0]
    step2 = validate.load_yaml_objects(out / "istio-operator-mcp.yaml")[0]
    assert crossref.check_operator_steps(step1, step2) == []
    assert validate.validate_object(step1) == []
    return objects, step2, validate.load_yaml_objects(out / "mcp-preview.yaml")


def _one(objects: list[dict], kind: str) -> dict:
    found = [o for o in objects if o["kind"] == kind]
    assert len(found) == 1, [o["metadata"]["name"] for o in found]
    return found[0]


def test_render_applies_namespace_and_colour_and_validates(tmp_path: Path, pins: render.Pins,
                                                            filter_wasm: Path, crds: dict) -> None:
    objects, operator, served = _render(tmp_path, "--namespace", "ml-prod", "--color", "green",
                                        "--also-color", "blue", "--ingress-host", "infer.example.org")
    report = validate.validate_all([*objects, operator, *served])
    assert report.ok, report.errors
    errors = crossref.check_all(objects + served, pins.image_digest, elsewhere=frozenset({"blue"}))
    assert not errors, errors
    assert {o["metadata"].get("namespace") for o in objects + served
               if o["kind"] not in kustomize.CLUSTER_SCOPED} == {"ml-prod"}
    assert _one(objects, "Namespace")["metadata"]["name"] == "ml-prod"
    text = json.dumps(objects)
    assert "/ns/meshcache/" not in text and ".meshcache.svc" not in text and "cluster.local/ns/ml-prod/sa/" in text
    source = operator["spec"]["meshConfig"]["configSources"][1]
    assert source["address"] == "xds://meshcache-control-plane.ml-prod.svc.cluster.local:18000"
    assert source["tlsSettings"]["subjectAltNames"] == ["meshcache-control-plane.ml-prod.svc"]

    engine = next(o for o in objects
                  if o["kind"] == "Deployment" and o["metadata"]["labels"]["app"] == "meshcache-engine")
    assert engine["metadata"]["name"] == "meshcache-engine-green"
    assert engine["spec"]["template"]["metadata"]["labels"]["color"] == "green"
    proxy_config = engine["spec"]["template"]["metadata"]["annotations"]["proxy.istio.io/config"]
    assert "MESHCACHE_TRAFFIC_COLOR: green" in proxy_config
    env = render.control_plane_env(objects)
    assert env["MESHCACHE_CP_ISTIO_COLOR"] == "green,blue"
    assert [o["metadata"]["name"] for o in served] == ["meshcache-green", "meshcache-blue", "meshcache-client"]
    assert served[0]["spec"]["workloadSelector"]["labels"] == {"app": "meshcache-engine", "color": "green"}
    for name in ("meshcache-engine", "meshcache-engine-ingress"):
        vs = next(o for o in objects if o["kind"] == "VirtualService" and o["metadata"]["name"] == name)
        subsets = [(r["name"], r["route"][0]["destination"]["subset"]) for r in vs["spec"]["http"]]
        assert subsets[0] == ("color-green" + ("-grpc" if "ingress" in name else ""), "green")
        assert subsets[-1] == ("default", "green") and ("color-blue", "blue") in subsets
    ingress = next(o for o in objects if o["metadata"]["name"] == "meshcache-engine-ingress")
    assert ingress["spec"]["hosts"] == ["infer.example.org"] and ingress["spec"]["gateways"] == ["meshcache-ingress"]
    dr = next(o for o in objects if o["kind"] == "DestinationRule" and o["spec"]["host"] == "meshcache-engine")
    assert [s["name"] for s in dr["spec"]["subsets"]] == ["green", "blue"]
    # Cache affinity within each colour: the subsets hash on the client role's routing key.
    for s in dr["spec"]["subsets"]:
        assert s["trafficPolicy"]["loadBalancer"]["consistentHash"]["httpHeaderName"] == "x-meshcache-route-key"

    # The pins are the built module's: the image's only layer holds exactly its bytes.
    module = filter_wasm.read_bytes()
    image = oci.build_image(module)
    assert env["MESHCACHE_CP_ISTIO_WASM_SHA256"] == image.digest == pins.image_digest
    assert env["MESHCACHE_CP_ISTIO_WASM_URL"].endswith(f"@sha256:{image.digest}")
    assert oci.extract_module(image) == module
    manifest = json.loads(image.manifest)
    assert manifest["layers"][0]["digest"] == f"sha256:{hashlib.sha256(image.layer).hexdigest()}"


def _served_config(served: list[dict]) -> dict:
    ext = served[0]["spec"]["configPatches"][0]["patch"]["value"]
    return json.loads(ext["typed_config"]["config"]["configuration"]["value"])  # type: ignore[no-any-return]


def test_render_from_snapshot_files(tmp_path: Path) -> None:
    snap = Snapshot.from_record(json.dumps({"version": 7, "policies": [
        {"model_prefix": "llama", "ttl_s": 60, "max_ttl_s": 120, "generation": 3}]}))
    record = tmp_path / "record.json"
    record.write_text(snap.to_record())
    api_body = tmp_path / "api.json"
    api_body.write_text(json.dumps({"version": 7, "plugin_config": snap.plugin_config_json}))
    for source in (record, api_body):
        _, _, served = _render(tmp_path, "--snapshot", str(source), "--color", "red")
        config = _served_config(served)
        assert config == {**snap.plugin_config(), "color": "red"}
        assert config["version"] == "7" and config["policies"][0]["model_prefix"] == "llama"
    (tmp_path / "bad.json").write_text(json.dumps({"version": 1, "policies": [{"model_prefix": "x"}]}))
    with pytest.raises(ValueError):
        render.plugin_config_from_file(tmp_path / "bad.json")


def test_render_from_the_control_plane_api(tmp_path: Path, cp: ControlPlaneProc) -> None:
    assert cp.client().put("/v1/policies/bert", json={"ttl_s": 42}).status_code == 200
    _, _, served = _render(tmp_path, "--control-plane", cp.url, "--token", READ_TOKEN)
    expected = json.loads(cp.client().get("/v1/snapshot").json()["plugin_config"])
    assert _served_config(served) == {**expected, "color": "blue"}
    assert main(["istio", "render", "--control-plane", cp.url, "--token", ""]) == 2


def test_image_digest_override_and_bad_input(tmp_path: Path) -> None:
    digest = "ab" * 32
    objects, _, served = _render(tmp_path, "--image-digest", digest, "--filter-repository", "ghcr.io/acme/mc")
    env = render.control_plane_env(objects)
    assert (env["MESHCACHE_CP_ISTIO_WASM_URL"], env["MESHCACHE_CP_ISTIO_WASM_SHA256"]) == (
        f"oci://ghcr.io/acme/mc@sha256:{digest}", digest)
    code = served[0]["spec"]["configPatches"][0]["patch"]["value"]["typed_config"]["config"]["vm_config"]["code"]
    assert code["remote"]["sha256"] == digest
    assert main(["istio", "render", "--image-digest", "sha256:" + digest]) == 2
    assert main(["istio", "render", "--color", "Not_A_Label"]) == 2


def test_namespace_must_be_a_dns_label_and_not_istio_or_kubernetes_own(capsys: pytest.CaptureFixture[str],
                                                                       tmp_path: Path) -> None:
    """`--namespace` (issue 32): a DNS-1123 label, as `--color` is checked, and never Istio's or
    Kubernetes' own namespace; refused with exit 2 and a message naming the flag, nothing written."""
    out = tmp_path / "out"
    for bad in ("*", "", "ml\n", "ml\nkind: Secret", "ML", "-ml", "ml-", "a" * 64, "ml.prod", "ml_prod"):
        assert main(["istio", "render", f"--namespace={bad}", "--out", str(out)]) == 2, repr(bad)
        err = capsys.readouterr().err
        assert "--namespace" in err and "DNS-1123 label" in err, (bad, err)
    for reserved in render.RESERVED_NAMESPACES:
        assert main(["istio", "render", "--namespace", reserved, "--out", str(out)]) == 2, reserved
        err = capsys.readouterr().err
        assert f"--namespace {reserved}" in err and "own namespace" in err, err
        assert main(["istio", "xds-certs", "--namespace", reserved, "--out", str(out)]) == 2
    assert not out.exists()
    assert "istio-system" in render.RESERVED_NAMESPACES and "kube-system" in render.RESERVED_NAMESPACES
    assert main(["istio", "render", "--color", "blue\n"]) == 2, "a trailing newline is not a label either"
    assert main(["istio", "render", "--namespace", "a" * 63]) == 0


NATIVE_IMAGE = "registry.example.com/meshcache/filter-native@sha256:" + "ab" * 32


def test_filter_native_is_refused_for_an_istio_without_dynamic_modules(capsys: pytest.CaptureFixture[str],
                                                                         tmp_path: Path) -> None:
    """`--filter native` (issue 37): istio-proxy links envoy.filters.http.dynamic_modules from 1.31
    on; with an older Istio (the default, 1.30.3, what the manifests target) render refuses and
    says why, writing nothing. So does an Istio whose Envoy (so module ABI) is not known here,
    a native render without its pinned image, and one of a mode or overlay it cannot serve."""
    out = tmp_path / "out"
    for older in ([], ["--istio-version", "1.30.3"], ["--istio-version", "1.29"]):
        assert main(["istio", "render", "--filter", "native", *older, "--native-image", NATIVE_IMAGE,
                     "--out", str(out)]) == 2, older
        err = capsys.readouterr().err
        assert "--filter native needs Istio 1.31 or later" in err, err
        assert "does not link envoy.filters.http.dynamic_modules" in err and "--filter wasm" in err, err
    assert "built on Envoy 1.38" in (main(["istio", "render", "--filter", "native"]), capsys.readouterr().err)[1]
    refused = {
        ("--istio-version", "1.32", "--native-image", NATIVE_IMAGE): "is not known here",
        ("--istio-version", "1.31"): "needs --native-image REPO@sha256:DIGEST",
        ("--istio-version", "1.31", "--native-image", "registry.example.com/m:latest"): "pinned by digest",
        ("--istio-version", "1.31", "--native-image", NATIVE_IMAGE, "--overlay", "basic"): "TrafficExtensions are "
                                                                                            "Wasm only",
        ("--istio-version", "1.31", "--native-image", NATIVE_IMAGE, "--overlay", "kserve"): "own engine pods only",
    }
    for args, says in refused.items():
        assert main(["istio", "render", "--filter", "native", *args, "--out", str(out)]) == 2, args
        err = capsys.readouterr().err
        assert says in err, (args, err)
    assert main(["istio", "render", "--filter", "native", "--istio-version", "one.31"]) == 2
    assert "expected MAJOR.MINOR[.PATCH]" in capsys.readouterr().err
    assert not out.exists()
    assert main(["istio", "render", "--filter", "wasm", "--out", str(out)]) == 0, "the default host renders"


def test_render_filter_native_for_istio_1_31(tmp_path: Path, pins: render.Pins, crds: dict) -> None:
    """The native mode: EnvoyFilters that put the dynamic module where the Wasm filter goes, with
    the same plugin configuration; the module (the 1.39 build, for istio-proxy 1.31's Envoy)
    copied by a digest-pinned init container into an emptyDir that istio-proxy mounts, checked
    against the build's sha256; classic sidecars (a native sidecar would start before the copy).
    It validates (Istio's CRDs, Kubernetes schemas, the cross-references)."""
    objects, operator, served = _render(tmp_path, "--filter", "native", "--istio-version", "1.31.0",
                                        "--native-image", NATIVE_IMAGE, "--color", "green")
    wasm_objects, _, wasm_served = _render(tmp_path / "wasm", "--color", "green")
    report = validate.validate_all([*objects, operator, *served])
    assert report.ok, report.errors
    assert crossref.check_all(objects + served, pins.image_digest) == []
    module = filter_native("1.39")
    path = f"/var/lib/meshcache/modules/{module.name}"
    env = render.control_plane_env(objects)
    assert env["MESHCACHE_CP_ISTIO_MODE"] == "native" and env["MESHCACHE_CP_ISTIO_NATIVE_MODULE"] == path

    assert [o["metadata"]["name"] for o in served] == [o["metadata"]["name"] for o in wasm_served]
    for native, wasm in zip(served, wasm_served, strict=True):
        n_patches, w_patches = native["spec"]["configPatches"], wasm["spec"]["configPatches"]
        ext = n_patches[0]["patch"]["value"]
        assert ext["name"] == w_patches[0]["patch"]["value"]["name"]
        typed = ext["typed_config"]
        assert typed["@type"] == DYNAMIC_MODULE_TYPE_URL and typed["filter_name"] == "meshcache"
        assert typed["dynamic_module_config"]["module"]["local"]["filename"] == path
        wasm_config = w_patches[0]["patch"]["value"]["typed_config"]["config"]["configuration"]["value"]
        assert typed["filter_config"]["value"] == wasm_config, "the same plugin configuration JSON"
        # Where the Wasm filter goes (the same matches and operation); no Lua filter, no hit route.
        wasm_filters = [(p["match"], p["patch"]["operation"]) for p in w_patches if p["applyTo"] == "HTTP_FILTER"
                        and p["patch"]["value"]["name"] == ext["name"]]
        assert [(p["match"], p["patch"]["operation"]) for p in n_patches if p["applyTo"] == "HTTP_FILTER"] \
            == wasm_filters
        assert {p["applyTo"] for p in n_patches} == {"EXTENSION_CONFIG", "HTTP_FILTER"}
        assert native["spec"]["priority"] == wasm["spec"]["priority"]

    engine = next(o for o in objects
                  if o["kind"] == "Deployment" and o["metadata"]["labels"]["app"] == "meshcache-engine")
    pod = engine["spec"]["template"]
    ann = pod["metadata"]["annotations"]
    assert json.loads(ann["sidecar.istio.io/userVolumeMount"]) == {
        "meshcache-module": {"mountPath": "/var/lib/meshcache/modules", "readOnly": True}}
    assert ann["sidecar.istio.io/nativeSidecar"] == "false"
    assert {"name": "meshcache-module", "emptyDir": {"sizeLimit": "64Mi"}} in pod["spec"]["volumes"]
    init = next(c for c in pod["spec"]["initContainers"] if c["name"] == "meshcache-module")
    assert init["image"] == NATIVE_IMAGE
    assert f"{hashlib.sha256(module.read_bytes()).hexdigest()}  " in init["command"][-1]
    # What the cross-references catch: a pod the native filter selects that does not mount it.
    del ann["sidecar.istio.io/userVolumeMount"]
    ann.pop("sidecar.istio.io/nativeSidecar")
    errors = crossref.check_all(objects + served, pins.image_digest)
    assert any("does not mount the native module" in e for e in errors), errors
    assert any("nativeSidecar" in e for e in errors), errors
    # The Wasm render is unchanged by any of it.
    assert not [o for o in wasm_objects if "meshcache-module" in json.dumps(o)]


def test_render_the_basic_overlay(tmp_path: Path, pins: render.Pins, crds: dict) -> None:
    objects, _, served = _render(tmp_path, "--overlay", str(render.ISTIO_DIR / "overlays" / "basic"),
                                 "--namespace", "ml")
    assert validate.validate_all(objects + served).ok
    assert not crossref.check_all(objects + served, pins.image_digest)
    [te] = served
    assert (te["kind"], te["metadata"]["namespace"]) == ("TrafficExtension", "ml")
    assert te["spec"]["wasm"]["pluginConfig"]["hold_headers"] is False


def test_xds_certs_verify_as_istiod_checks_them(tmp_path: Path) -> None:
    """istiod (SIMPLE): the chain against the CA from the Secret, the DNS SAN against
    subjectAltNames, the SNI it sends."""
    from cryptography import x509

    assert main(["istio", "xds-certs", "--namespace", "ml", "--out", str(tmp_path)]) == 0
    ca = x509.load_pem_x509_certificate((tmp_path / "ca.crt").read_bytes())
    cert = x509.load_pem_x509_certificate((tmp_path / "tls.crt").read_bytes())
    cert.verify_directly_issued_by(ca)
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
        x509.DNSName)
    assert "meshcache-control-plane.ml.svc" in names
    assert oct((tmp_path / "tls.key").stat().st_mode & 0o777) == "0o600"


def test_oci_layout_is_content_addressed(tmp_path: Path, pins: render.Pins) -> None:
    assert main(["istio", "oci-layout", "--out", str(tmp_path / "layout"), "--tag", "v1"]) == 0
    index = json.loads((tmp_path / "layout" / "index.json").read_text())
    assert index["manifests"][0]["digest"] == f"sha256:{pins.image_digest}"
    for blob in (tmp_path / "layout" / "blobs" / "sha256").iterdir():
        assert hashlib.sha256(blob.read_bytes()).hexdigest() == blob.name
    assert len(list((tmp_path / "layout" / "blobs" / "sha256").iterdir())) == 3


def test_validate_takes_the_whole_rendered_directory(tmp_path: Path, filter_wasm: Path) -> None:
    """`meshcache istio validate rendered/*.yaml`: manifests, both install steps and the MCP
    preview together (startup rules and operator steps included); a step-1 file with the MCP
    source fails."""
    out = tmp_path / "out"
    assert main(["istio", "render", "--out", str(out)]) == 0
    files = sorted(str(p) for p in out.glob("*.yaml"))
    assert [Path(f).name for f in files] == sorted(
        ["namespace.yaml", "meshcache-istio.yaml", "istio-operator.yaml", "istio-operator-mcp.yaml",
         "istio-operator-existing.yaml", "istiod-values.yaml", "mcp-preview.yaml", "monitoring.yaml"])
    assert (out / "prometheus-kubernetes.yml").is_file()  # a scrape config, not an object: not validated
    files.remove(str(out / "istiod-values.yaml"))  # Helm values, not an object
    assert main(["istio", "validate", *files, "--module", str(filter_wasm)]) == 0
    (out / "istio-operator.yaml").write_text((out / "istio-operator-mcp.yaml").read_text())
    assert main(["istio", "validate", *files, "--module", str(filter_wasm)]) == 1
