"""The kustomize subset (meshcache/ctl/istio/kustomize.py): every overlay builds, and each supported
feature does what kustomize does."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from meshcache.ctl.istio import kustomize
from tests.istio.helpers import ISTIO_DIR, KUSTOMIZATIONS, KUSTOMIZE, OVERLAYS


def _ids(objs: list[dict]) -> set[tuple[str, str]]:
    return {(o["kind"], o["metadata"]["name"]) for o in objs}


@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=lambda p: p.name)
def test_each_kustomization_builds(directory: Path) -> None:
    objs = kustomize.build(directory)
    assert len(objs) >= 13
    assert len(_ids(objs)) == len(objs), "duplicate kind/name after build"
    for o in objs:
        assert o["metadata"]["labels"]["app.kubernetes.io/part-of"] == "meshcache"
        if o["kind"] not in kustomize.CLUSTER_SCOPED:
            assert o["metadata"]["namespace"] == "meshcache"
        else:
            assert "namespace" not in o["metadata"]


def test_overlays_change_what_they_say() -> None:
    assert {p.name for p in OVERLAYS} == {"basic", "external-redis", "revision", "kserve", "triton"}
    by_name = {p.name: kustomize.build(p) for p in OVERLAYS}
    ns = next(o for o in by_name["revision"] if o["kind"] == "Namespace")
    labels = ns["metadata"]["labels"]
    assert labels.get("istio.io/rev") == "1-30-3" and "istio-injection" not in labels
    assert _env(by_name["revision"])["MESHCACHE_CP_ISTIO_REVISION"] == {
        "name": "MESHCACHE_CP_ISTIO_REVISION", "value": "1-30-3"}
    ext = by_name["external-redis"]
    assert ("StatefulSet", "meshcache-redis") not in _ids(ext)
    assert ("NetworkPolicy", "meshcache-redis") not in _ids(ext)
    env = _env(ext)
    assert env["MESHCACHE_CP_REDIS_URL"] == {"name": "MESHCACHE_CP_REDIS_URL", "valueFrom": {
        "secretKeyRef": {"name": "meshcache-redis-url", "key": "url"}}}
    assert _env(by_name["basic"])["MESHCACHE_CP_ISTIO_MODE"]["value"] == "basic"
    assert _env(kustomize.build(OVERLAYS[0].parent.parent / "base"))["MESHCACHE_CP_ISTIO_MODE"]["value"] == "full"


def _env(objs: list[dict]) -> dict[str, dict]:
    cp = next(o for o in objs if o["metadata"]["name"] == "meshcache-control-plane" and o["kind"] == "Deployment")
    env = cp["spec"]["template"]["spec"]["containers"][0]["env"]
    by_name = {e["name"]: e for e in env}
    assert len(by_name) == len(env), "env merged by name"
    return by_name


def _write(tmp: Path, files: dict[str, object]) -> Path:
    for name, body in files.items():
        (tmp / name).write_text(body if isinstance(body, str) else yaml.safe_dump_all(body))
    return tmp


def _cm(name: str, **data: str) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}, "data": data}


def test_strategic_merge_and_json6902(tmp_path: Path) -> None:
    dep = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d", "labels": {"a": "1", "b": "2"}},
           "spec": {"template": {"spec": {"containers": [
               {"name": "c1", "image": "x", "env": [{"name": "A", "value": "1"}]}, {"name": "c2", "image": "y"}]}}}}
    _write(tmp_path, {"res.yaml": [dep, _cm("keep"), _cm("gone")], "kustomization.yaml": yaml.safe_dump({
        "resources": ["res.yaml"], "namespace": "ns1",
        "patches": [
            {"patch": yaml.safe_dump({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {
                "name": "d", "labels": {"b": None, "c": "3"}}, "spec": {"template": {"spec": {"containers": [
                    {"name": "c1", "env": [{"name": "B", "value": "2"}]}, {"name": "c3", "image": "z"}]}}}})},
            {"patch": yaml.safe_dump({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "gone"},
                                      "$patch": "delete"})},
            {"target": {"kind": "ConfigMap", "name": "keep"},
             "patch": yaml.safe_dump([{"op": "add", "path": "/data/k~1x", "value": "v"},
                                      {"op": "replace", "path": "/metadata/name", "value": "kept"}])},
        ]})})
    objs = kustomize.build(tmp_path)
    assert _ids(objs) == {("Deployment", "d"), ("ConfigMap", "kept")}
    d = objs[0]
    assert d["metadata"]["labels"] == {"a": "1", "c": "3"} and d["metadata"]["namespace"] == "ns1"
    containers = d["spec"]["template"]["spec"]["containers"]
    # As kustomize v5 prints a merged list: the patch's items first (test_real_kustomize_agrees).
    assert [c["name"] for c in containers] == ["c1", "c3", "c2"]
    assert containers[0]["env"] == [{"name": "B", "value": "2"}, {"name": "A", "value": "1"}]
    assert objs[1]["data"] == {"k/x": "v"}


@pytest.mark.parametrize("kustomization, error", [
    ({"resources": ["res.yaml"], "commonLabels": {"a": "b"}}, "unsupported fields"),
    ({"resources": ["res.yaml"], "patches": [{"patch": "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: nope}\n"}]},
     "matches no object"),
    ({"resources": ["res.yaml"], "patches": [{"target": {"kind": "ConfigMap"},
                                              "patch": "- {op: test, path: /data/a, value: wrong}"}]}, "test failed"),
    ({"resources": ["res.yaml"], "patches": [{"patch": "- {op: add, path: /x, value: 1}"}]}, "needs a target"),
])
def test_unsupported_or_failing_kustomizations_are_errors(tmp_path: Path, kustomization: dict, error: str) -> None:
    _write(tmp_path, {"res.yaml": [_cm("cm", a="1")], "kustomization.yaml": yaml.safe_dump(kustomization)})
    with pytest.raises(kustomize.KustomizeError, match=error):
        kustomize.build(tmp_path)


def _real_build(directory: Path) -> list[dict]:
    assert KUSTOMIZE.is_file(), f"{KUSTOMIZE} missing: run `make setup` (scripts/setup.sh builds kustomize)"
    out = subprocess.run([str(KUSTOMIZE), "build", str(directory)], capture_output=True, text=True, timeout=60,
                         check=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def _by_key(objs: list[dict]) -> dict[tuple[str, str, str], dict]:
    keyed = {(o["kind"], o["metadata"].get("namespace", ""), o["metadata"]["name"]): o for o in objs}
    assert len(keyed) == len(objs)
    return keyed


@pytest.mark.parametrize("directory", [*KUSTOMIZATIONS, ISTIO_DIR / "front"], ids=lambda p: p.name)
def test_real_kustomize_agrees(directory: Path) -> None:
    """`kubectl apply -k` / `kustomize build` and `meshcache istio render` start from the same
    objects (kustomize prints them sorted by kind; the content, list order included, is equal)."""
    real, ours = _by_key(_real_build(directory)), _by_key(kustomize.build(directory))
    assert real.keys() == ours.keys()
    for key in real:
        assert real[key] == ours[key], key


def test_targeted_null_is_refused_like_kustomize_would_mangle_it(tmp_path: Path) -> None:
    cm = {**_cm("cm", a="1"), "metadata": {"name": "cm", "labels": {"x": "1", "y": "2"}}}
    _write(tmp_path, {"res.yaml": [cm], "kustomization.yaml": yaml.safe_dump({
        "resources": ["res.yaml"], "patches": [{"target": {"kind": "ConfigMap", "name": "cm"}, "patch": yaml.safe_dump(
            {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cm", "labels": {"x": None}}})}]})})
    # What kustomize itself makes of it (the revision overlay had this: istio-injection "null").
    assert _real_build(tmp_path)[0]["metadata"]["labels"] == {"x": "null", "y": "2"}
    with pytest.raises(kustomize.KustomizeError, match="JSON 6902 remove"):
        kustomize.build(tmp_path)
