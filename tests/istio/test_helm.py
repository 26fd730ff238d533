"""charts/meshcache with the real Helm (built by scripts/setup.sh): it lints, and `helm template`
makes, object by object, what `meshcache istio render` writes for the same settings (render is the
source of truth; the chart leaves out only the Namespace, which is created before the release).
The templated objects pass the same schema and cross-reference checks as rendered ones."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from meshcache.ctl.istio import crossref, render, validate
from meshcache.ctl.istio import filter_host as hosts
from meshcache.ctl.istiod import binary as istiod_binary
from tests.istio.helpers import CHART, HELM, HELM_VERSION, ISTIO_DIR
from tests.istio.test_existing_servers import kserve_predictor, triton_deployment

Obj = dict[str, Any]
DEFAULTS = yaml.safe_load((CHART / "values.yaml").read_text())
DIGEST = DEFAULTS["filter"]["digest"]
SCRAPE_CONFIGMAP = "meshcache-prometheus-scrape"
NATIVE_IMAGE = "registry.example.com/meshcache/filter-native@sha256:" + "ab" * 32
# The module's sha256 is whatever render computes from this checkout's build (filter/dist/): the
# chart is given the same value (`make images` prints it), never a copy of it.
MODULE_SHA256 = "<module sha256>"


def native_values(istio_version: str = "1.31.0", **native: str) -> Obj:
    return {"istio": {"version": istio_version},
            "filter": {"host": "native", "native": {"image": NATIVE_IMAGE, "sha256": MODULE_SHA256, **native}}}


def _with_module_sha256(values: Obj, istio_version: str = "1.31.0") -> Obj:
    if MODULE_SHA256 not in json.dumps(values):
        return values
    pins = render.native_pins_for(render.RenderOptions(filter_host="native", istio_version=istio_version,
                                                       native_image=NATIVE_IMAGE))
    assert pins is not None
    return json.loads(json.dumps(values).replace(MODULE_SHA256, pins.sha256))


def helm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(HELM), *args], capture_output=True, text=True, timeout=120)


def template(tmp_path: Path, namespace: str, values: Obj) -> list[Obj]:
    path = tmp_path / "values.json"
    path.write_text(json.dumps(_with_module_sha256(values)))  # JSON is YAML: exact types, no quoting surprises
    r = helm("template", "meshcache", str(CHART), "--namespace", namespace, "-f", str(path))
    assert r.returncode == 0, r.stderr
    return [o for o in yaml.safe_load_all(r.stdout) if o]


def _normal(obj: Obj) -> Obj:
    """Differences that carry no meaning: env order (kustomize puts patched entries first) and the
    YAML layout of the sidecar's proxy config annotation."""
    obj = json.loads(json.dumps(obj))
    pod = obj.get("spec", {}).get("template", {}).get("spec", {})
    for c in pod.get("containers", []):
        if "env" in c:
            c["env"] = sorted(c["env"], key=lambda e: e["name"])
    ann = obj.get("spec", {}).get("template", {}).get("metadata", {}).get("annotations", {})
    if "proxy.istio.io/config" in ann:
        ann["proxy.istio.io/config"] = yaml.safe_load(ann["proxy.istio.io/config"])
    return obj


def _by_id(objects: list[Obj]) -> dict[tuple[str, str], Obj]:
    out = {(o["kind"], o["metadata"]["name"]): _normal(o) for o in objects}
    assert len(out) == len(objects), "duplicate kind/name"
    return out


# (id, render options, chart values): the defaults; meshcache in front of a KServe predictor (no
# engine, its selector, ports, Service and another caller); Triton's overlay; delivery kube in another
# namespace with two colours and images of one's own; meshcache's engine on other ports and labels;
# the basic, revision and external-redis overlays.
CASES: list[tuple[str, render.RenderOptions, Obj]] = [
    ("default", render.RenderOptions(image_digest=DIGEST), {}),
    ("kserve", render.RenderOptions(
        image_digest=DIGEST, source=ISTIO_DIR / "overlays" / "kserve", engine_service="sklearn-predictor",
        engine_selector={"component": "predictor", "serving.kserve.io/inferenceservice": "sklearn"},
        allow_principals=("apps/frontend", "spiffe://cluster.local/ns/batch/sa/scorer")),
     {"engine": {"enabled": False},
      "cache": {"selector": {"serving.kserve.io/inferenceservice": "sklearn", "component": "predictor"},
                "httpPorts": [8080], "grpcPorts": [], "servicePorts": [80], "service": "sklearn-predictor",
                "allowPrincipals": ["apps/frontend", "spiffe://cluster.local/ns/batch/sa/scorer"]}}),
    ("triton", render.RenderOptions(image_digest=DIGEST, source=ISTIO_DIR / "overlays" / "triton"),
     {"engine": {"enabled": False},
      "cache": {"selector": {"app": "triton-inference-server"}, "service": "triton"}}),
    ("kube", render.RenderOptions(
        namespace="ml-cache", delivery="kube", color="green", also_colors=("blue",), image_digest="ab" * 32,
        filter_repository="registry.corp.example/ml/meshcache-filter", ingress_host="infer.corp.example",
        engine_image="registry.corp.example/ml/engine:1.2", control_plane_image="registry.corp.example/ml/cp:1.2",
        allow_principals=("cluster.local/ns/apps/sa/frontend",)),
     {"delivery": "kube",
      "filter": {"repository": "registry.corp.example/ml/meshcache-filter", "digest": "ab" * 32},
      "engine": {"color": "green", "alsoColors": ["blue"], "ingressHost": "infer.corp.example",
                 "image": "registry.corp.example/ml/engine:1.2"},
      "controlPlane": {"image": "registry.corp.example/ml/cp:1.2"},
      "cache": {"allowPrincipals": ["cluster.local/ns/apps/sa/frontend"]}}),
    ("own-engine-ports", render.RenderOptions(
        image_digest=DIGEST, engine_selector={"app": "meshcache-engine", "tier": "ml"},
        engine_ports={"http": 9000, "grpc": None}),
     {"cache": {"selector": {"app": "meshcache-engine", "tier": "ml"}, "httpPorts": [9000], "grpcPorts": []}}),
    ("basic-kube", render.RenderOptions(image_digest=DIGEST, source=ISTIO_DIR / "overlays" / "basic", delivery="kube"),
     {"mode": "basic", "delivery": "kube"}),
    ("revision", render.RenderOptions(image_digest=DIGEST, source=ISTIO_DIR / "overlays" / "revision"),
     {"revision": "1-30-3"}),
    ("external-redis", render.RenderOptions(image_digest=DIGEST, source=ISTIO_DIR / "overlays" / "external-redis"),
     {"redis": {"enabled": False}}),
    ("helm-gateway", render.RenderOptions(image_digest=DIGEST, ingress_principals=("gateways/public-gw",),
                                          allow_principals=("apps/frontend",)),
     {"cache": {"ingressPrincipals": ["gateways/public-gw"], "allowPrincipals": ["apps/frontend"]}}),
    ("authz-none", render.RenderOptions(image_digest=DIGEST, authz="none"), {"cache": {"authz": "none"}}),
    # The native host (issue 37): the engine pods' init container, emptyDir and sidecar
    # annotations and the control plane's native mode, exactly as render gives them.
    ("native", render.RenderOptions(image_digest=DIGEST, filter_host="native", istio_version="1.31.0",
                                    native_image=NATIVE_IMAGE), native_values()),
    ("native-kube", render.RenderOptions(
        image_digest=DIGEST, filter_host="native", istio_version="1.31.2", native_image=NATIVE_IMAGE, delivery="kube",
        color="green", also_colors=("blue",)),
     {**native_values("1.31.2"), "delivery": "kube", "engine": {"color": "green", "alsoColors": ["blue"]}}),
]


@pytest.mark.parametrize(("opts", "values"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_helm_template_equals_render(tmp_path: Path, opts: render.RenderOptions, values: Obj,
                                     crds: dict) -> None:
    rendered = render.render(opts)
    templated = template(tmp_path, opts.namespace, {**values, "monitoring": {"podMonitors": True,
                                                                             "scrapeConfig": True}})
    # render's prometheus-kubernetes.yml, as the ConfigMap's one key (the same jobs, rule for rule).
    scrape = next(o for o in templated if o["kind"] == "ConfigMap" and o["metadata"]["name"] == SCRAPE_CONFIGMAP)
    assert scrape["metadata"]["namespace"] == opts.namespace
    assert yaml.safe_load(scrape["data"]["prometheus-kubernetes.yml"]) == {
        "scrape_configs": render.scrape_configs(rendered)}
    templated.remove(scrape)
    # render's meshcache-istio.yaml and monitoring.yaml together
    want = {k: v for k, v in _by_id(rendered + render.monitors(rendered)).items() if k[0] != "Namespace"}
    got = _by_id(templated)
    assert sorted(got) == sorted(want)
    for key, obj in want.items():
        assert got[key] == obj, key
    # Checked like rendered manifests: schemas (core kinds and Istio's CRDs), then the cross
    # references with what the control plane would serve (the Namespace is the release's).
    report = validate.validate_all(templated)
    assert report.ok, report.errors
    plain = template(tmp_path, opts.namespace, values)
    assert {o["kind"] for o in plain} == {o["kind"] for o in rendered} - {
        "Namespace"}  # PodMonitors only when asked (their CRDs may be missing)
    assert SCRAPE_CONFIGMAP not in {o["metadata"]["name"] for o in plain}  # nor the scrape config
    namespace = next(o for o in rendered if o["kind"] == "Namespace")
    # In front of KServe or Triton: their workloads, as test_existing_servers has them.
    theirs = {"kserve": kserve_predictor("sklearn", opts.namespace),
              "triton": triton_deployment(opts.namespace)}.get(opts.source.name, [])
    objects = [namespace, *templated, *theirs]
    served = render.mcp_objects(objects, render.demo_plugin_config())
    assert not crossref.check_all(objects + served, opts.image_digest or DIGEST,
                                  elsewhere=frozenset(opts.also_colors))


def test_helm_lint_strict(tmp_path: Path) -> None:
    for i, (_, _, values) in enumerate(CASES):
        path = tmp_path / f"values-{i}.json"
        path.write_text(json.dumps(_with_module_sha256(
            {**values, "monitoring": {"podMonitors": i % 2 == 0, "scrapeConfig": i % 3 == 0}})))
        r = helm("lint", "--strict", str(CHART), "-f", str(path))
        assert r.returncode == 0, r.stdout + r.stderr
        assert "1 chart(s) linted, 0 chart(s) failed" in r.stdout


def test_chart_pins_the_base_module() -> None:
    """The chart's default filter digest is the one istio/base pins (`render --update-base` moves both)."""
    env = render.control_plane_env(render.kustomize.build(render.BASE_DIR))
    assert env["MESHCACHE_CP_ISTIO_WASM_SHA256"] == DIGEST
    # and its default Istio is render's (--istio-version's default), with render's default host
    assert (DEFAULTS["istio"]["version"], DEFAULTS["filter"]["host"]) == (
        hosts.ISTIO_VERSION, render.RenderOptions().filter_host)


@pytest.mark.parametrize(("namespace", "values", "message"), [
    ("istio-system", {}, "namespace istio-system: that is Istio's or Kubernetes' own namespace"),
    ("kserve-apps", {"engine": {"enabled": False}}, "cache.selector: set the pod labels"),
    ("meshcache", {"filter": {"digest": "sha256:" + "a" * 64}}, "/filter/digest"),
    ("meshcache", {"delivery": "istiod"}, "/delivery"),
    ("meshcache", {"mode": "lite"}, "/mode"),
    ("meshcache", {"cache": {"allowPrincipals": ["Frontend"]}}, 'cache.allowPrincipals "Frontend"'),
    ("meshcache", {"controlPlane": {"replicas": 1}}, "/controlPlane/replicas"),
    ("meshcache", {"engine": {"colour": "red"}}, "colour"),
    ("meshcache", {"cache": {"ingressPrincipals": ["Gateway"]}}, 'cache.ingressPrincipals "Gateway"'),
    ("meshcache", {"cache": {"authz": "off"}}, "/cache/authz"),
    ("meshcache", {"cache": {"authz": "none", "allowPrincipals": ["apps/frontend"]}}, "cache.authz none renders no"),
    ("meshcache", {"filter": {"host": "native"}}, "filter.host native needs Istio 1.31 or later"),
    ("meshcache", native_values(image=""), "filter.host native needs filter.native.image REPO@sha256:DIGEST"),
    ("meshcache", native_values(image="registry.example.com/m:latest"), "/filter/native/image"),
    ("meshcache", native_values(sha256=""), "filter.host native needs filter.native.sha256"),
    ("meshcache", {**native_values(), "mode": "basic"}, "TrafficExtensions, which are Wasm only"),
    ("meshcache", {**native_values(), "engine": {"enabled": False}, "cache": {"selector": {"app": "x"}}},
     "meshcache's own engine pods only"),
    ("meshcache", {"istio": {"version": "latest"}}, "/istio/version"),
    ("meshcache", {"filter": {"host": "lua"}}, "/filter/host"),
], ids=["reserved-namespace", "no-selector", "digest-prefix", "delivery", "mode", "principal", "one-replica", "typo",
        "ingress-principal", "authz-mode", "authz-none-with-callers", "native-istio-1.30", "native-no-image",
        "native-tag", "native-no-sha256", "native-basic", "native-no-engine", "istio-version", "host"])
def test_helm_refuses_bad_values(tmp_path: Path, namespace: str, values: Obj, message: str) -> None:
    path = tmp_path / "values.json"
    path.write_text(json.dumps(_with_module_sha256(values)))
    r = helm("template", "meshcache", str(CHART), "--namespace", namespace, "-f", str(path))
    assert r.returncode != 0
    assert message in r.stderr, r.stderr


@pytest.mark.parametrize("istio_version", [
    *[f"{m}.{n}.0" for m, n in sorted(hosts.ISTIO_ENVOY)], "1.29", "1.31", "1.31.0-beta.1", "1.32.0", "2.0.0"])
def test_helm_native_gate_matches_render(tmp_path: Path, istio_version: str) -> None:
    """filter.host native per Istio release: the chart takes the module build render takes (the
    Envoy ABI table in _helpers.tpl is filter_host's), or refuses with render's reason."""
    try:
        module: str | None = hosts.native_module_file(istio_version)
        reason = ""
    except ValueError as e:
        module, reason = None, str(e)
    path = tmp_path / "values.json"
    values = native_values(istio_version, sha256="ef" * 32)
    path.write_text(json.dumps(values))
    r = helm("template", "meshcache", str(CHART), "--namespace", "meshcache", "-f", str(path))
    if module is None:
        assert r.returncode != 0
        # render's flags are the chart's values
        want = reason.replace("--filter ", "filter.host ").replace("give --istio-version", "set istio.version")
        assert want in r.stderr, r.stderr
        return
    assert r.returncode == 0, r.stderr
    objects = [o for o in yaml.safe_load_all(r.stdout) if o]
    env = render.control_plane_env(objects)
    assert (env["MESHCACHE_CP_ISTIO_MODE"], env["MESHCACHE_CP_ISTIO_NATIVE_MODULE"]) == (
        "native", f"/var/lib/meshcache/modules/{module}")
    engine = next(o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == "meshcache-engine-blue")
    init = engine["spec"]["template"]["spec"]["initContainers"][-1]
    assert init["command"] == render.native_module.copy_command(module, "ef" * 32)


def test_docs_values_example_equals_render(tmp_path: Path) -> None:
    """docs/istio.md "Install with Helm": its values file, with a digest, makes what render does
    for the KServe walk-through's flags, and cross-references with that predictor."""
    doc = (render.REPO_ROOT / "docs" / "istio.md").read_text()
    section = doc[doc.index("## Install with Helm"):]
    body = section[section.index("<<'VALUES'\n") + len("<<'VALUES'\n"):section.index("\nVALUES\n")]
    values = yaml.safe_load(body.replace("<DIGEST>", DIGEST))
    assert "helm install meshcache charts/meshcache -n ml -f meshcache-values.yaml" in section
    templated = template(tmp_path, "ml", values)
    opts = render.RenderOptions(
        namespace="ml", image_digest=DIGEST, source=ISTIO_DIR / "overlays" / "kserve",
        engine_selector={"component": "predictor", "serving.kserve.io/inferenceservice": "sklearn-iris"},
        engine_service="sklearn-iris-predictor", allow_principals=("ml/my-app",))
    rendered = render.render(opts)
    assert _by_id(templated) == {k: v for k, v in _by_id(rendered).items() if k[0] != "Namespace"}
    namespace = next(o for o in rendered if o["kind"] == "Namespace")
    objects = [namespace, *templated, *kserve_predictor("sklearn-iris", "ml")]
    served = render.mcp_objects(objects, render.demo_plugin_config())
    assert not crossref.check_all(objects + served, DIGEST)


def test_docs_native_values_equal_render(tmp_path: Path) -> None:
    """docs/istio.md "The native host under Istio 1.31": its Helm values, with a pushed digest and
    the module's sha256 filled in, make what `render --filter native` makes for them."""
    doc = (render.REPO_ROOT / "docs" / "istio.md").read_text()
    section = doc[doc.index("## The native host under Istio 1.31"):]
    body = section[section.index("```yaml\n") + len("```yaml\n"):]
    body = body[:body.index("```")]
    values = yaml.safe_load(body.replace("<pushed digest>", "ab" * 32)
                            .replace("<the libmeshcache_native-envoy-1.39.so sha256 `make images` printed>",
                                     MODULE_SHA256))
    assert values["filter"]["native"]["image"] == NATIVE_IMAGE
    opts = render.RenderOptions(image_digest=DIGEST, filter_host="native", istio_version=values["istio"]["version"],
                                native_image=NATIVE_IMAGE)
    templated = template(tmp_path, opts.namespace, values)
    assert _by_id(templated) == {k: v for k, v in _by_id(render.render(opts)).items() if k[0] != "Namespace"}


def _istiod_chart() -> Path:
    """The istiod chart of the pinned istio.io/istio module (the one scripts/build_istiod.sh builds
    istiod from), from Go's module cache."""
    go = shutil.which("go") or "/usr/local/go/bin/go"
    r = subprocess.run([go, "mod", "download", "-json", f"istio.io/istio@{istiod_binary.module_version()}"],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "GOTOOLCHAIN": "local"})
    assert r.returncode == 0, r.stderr
    return Path(json.loads(r.stdout)["Dir"]) / "manifests" / "charts" / "istio-control" / "istio-discovery"


@pytest.mark.parametrize("revision", ["", "1-30"], ids=["default", "revisioned"])
def test_istiod_values_preview(tmp_path: Path, revision: str) -> None:
    """docs/istio.md's preview of the istiod upgrade, on the istiod chart itself: with render's
    istiod-values.yaml only the mesh ConfigMap gains the config sources (and the values ConfigMap
    records them); the Deployment is unchanged, which is why the docs restart istiod."""
    chart = _istiod_chart()
    values = tmp_path / "istiod-values.yaml"
    values.write_text(yaml.safe_dump(render.istiod_values(render.render_operators(
        render.RenderOptions(namespace="ml"))[1])))
    args = ["template", "istiod", str(chart), "--namespace", "istio-system", "--set", f"revision={revision}"]
    before, after = (helm(*args, *extra) for extra in ((), ("-f", str(values))))
    assert before.returncode == 0 and after.returncode == 0, before.stderr + after.stderr
    objects = [{(o["kind"], o["metadata"]["name"]): o for o in yaml.safe_load_all(r.stdout) if o}
               for r in (before, after)]
    assert objects[0].keys() == objects[1].keys()
    changed = {k for k in objects[0] if objects[0][k] != objects[1][k]}
    suffix = f"-{revision}" if revision else ""
    assert changed == {("ConfigMap", f"istio{suffix}"), ("ConfigMap", f"values{suffix}")}
    mesh = [yaml.safe_load(o[("ConfigMap", f"istio{suffix}")]["data"]["mesh"]) for o in objects]
    sources = yaml.safe_load(values.read_text())["meshConfig"]["configSources"]
    assert mesh[1].pop("configSources") == sources
    assert mesh[0] == mesh[1]  # nothing else in the mesh config moves
    assert sources[1]["address"] == "xds://meshcache-control-plane.ml.svc.cluster.local:18000"
    # The docs' undo: Kubernetes alone again.
    unset = 'meshConfig.configSources=[{"address":"k8s://"}]'
    assert f"--set-json '{unset}'" in (render.REPO_ROOT / "docs" / "istio.md").read_text()
    undo = helm(*args, "-f", str(values), "--set-json", unset)
    assert undo.returncode == 0, undo.stderr
    undone = {(o["kind"], o["metadata"]["name"]): o for o in yaml.safe_load_all(undo.stdout) if o}
    assert yaml.safe_load(undone[("ConfigMap", f"istio{suffix}")]["data"]["mesh"]) == {
        **mesh[0], "configSources": [{"address": "k8s://"}]}


def test_helm_is_the_pinned_build() -> None:
    r = helm("version", "--template", "{{ .Version }}")
    assert r.returncode == 0 and r.stdout.strip() == HELM_VERSION
