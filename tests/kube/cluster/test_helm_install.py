"""charts/meshcache installed with the real Helm into the real Kubernetes API server (with Istio's
CRDs): every object `helm template` makes is created and validated server-side (core kinds by the
API server, Istio kinds by their CRD schemas), a `helm upgrade` to KServe settings with delivery
kube removes meshcache's engine and adds the writer's Role, and `helm uninstall` removes it all,
the EnvoyFilters a real control plane wrote as the release's ServiceAccount included (owned by
the release's Role, they go with it)."""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from meshcache.contract import extensions
from meshcache.ctl.kube.cluster import LocalCluster
from tests.helpers.control_plane import ControlPlaneProc
from tests.helpers.wait import eventually
from tests.istio.helpers import CHART, HELM
from tests.kube.cluster.helpers import service_account_kubeconfig

Obj = dict[str, Any]
DIGEST = yaml.safe_load((CHART / "values.yaml").read_text())["filter"]["digest"]
KSERVE = {"delivery": "kube", "engine": {"enabled": False},
          "cache": {"selector": {"serving.kserve.io/inferenceservice": "sklearn", "component": "predictor"},
                    "httpPorts": [8080], "grpcPorts": [], "servicePorts": [80], "service": "sklearn-predictor"}}

# filter.host native (nothing runs here: any sha256 the init container would check)
NATIVE = {"istio": {"version": "1.31.0"},
          "filter": {"host": "native", "native": {
              "image": "registry.example.com/meshcache/filter-native@sha256:" + "ab" * 32, "sha256": "ef" * 32}}}


@pytest.fixture
def namespace() -> str:
    return f"helm-{uuid.uuid4().hex[:8]}"  # a deleted namespace takes a while to go


@pytest.fixture
def helm_env(tmp_path: Path, istio_cluster: LocalCluster, namespace: str) -> Iterator[dict[str, str]]:
    env = {**os.environ, "KUBECONFIG": str(istio_cluster.kubeconfig), "HELM_CACHE_HOME": str(tmp_path / "cache"),
           "HELM_CONFIG_HOME": str(tmp_path / "config"), "HELM_DATA_HOME": str(tmp_path / "data")}
    istio_cluster.kubectl("create", "namespace", namespace)
    istio_cluster.kubectl("label", "namespace", namespace, "istio-injection=enabled")
    yield env
    helm(env, "uninstall", "meshcache", "--namespace", namespace, check=False)
    istio_cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def helm(env: dict[str, str], *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run([str(HELM), *args], capture_output=True, text=True, timeout=180, env=env)
    if check:
        assert r.returncode == 0, r.stderr
    return r


def _ref(obj: Obj) -> str:
    group = obj["apiVersion"].rpartition("/")[0]
    return f"{obj['kind'].lower()}{'.' + group if group else ''}/{obj['metadata']['name']}"


def _live(istio_cluster: LocalCluster, obj: Obj) -> Obj | None:
    args = ["get", _ref(obj), "-o", "json", "--ignore-not-found"]
    if "namespace" in obj["metadata"]:
        args += ["-n", obj["metadata"]["namespace"]]
    out = istio_cluster.kubectl(*args).stdout
    return json.loads(out) if out.strip() else None


def _env(container: Obj) -> dict[str, str | None]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def _manifest(env: dict[str, str], namespace: str) -> list[Obj]:
    text = helm(env, "get", "manifest", "meshcache", "--namespace", namespace).stdout
    return [o for o in yaml.safe_load_all(text) if o]


def test_helm_install_upgrade_uninstall(istio_cluster: LocalCluster, helm_env: dict[str, str], namespace: str,
                                        tmp_path: Path) -> None:
    notes = helm(helm_env, "install", "meshcache", str(CHART), "--namespace", namespace).stdout
    # The next step (delivery mcp): istiod's values change, pinned, and the restart it needs.
    assert f"meshcache istio render --namespace {namespace} --out rendered/" in notes
    assert "helm upgrade istiod istio/istiod -n istio-system --version <VERSION> --reuse-values" in notes
    assert "kubectl -n istio-system rollout restart deploy/istiod" in notes
    installed = _manifest(helm_env, namespace)
    assert len(installed) == 21
    for obj in installed:
        live = _live(istio_cluster, obj)
        assert live is not None, _ref(obj)
        assert live["metadata"]["annotations"]["meta.helm.sh/release-name"] == "meshcache"
        if obj["kind"] == "Deployment":  # what was asked is what the API server keeps
            want = obj["spec"]["template"]["spec"]["containers"][0]
            got = live["spec"]["template"]["spec"]["containers"][0]
            # (the API server defaults fieldRef.apiVersion: compare the names and plain values)
            assert _env(got) == _env(want)
            assert got["image"] == want["image"]
    ap = _live(istio_cluster, {"apiVersion": "security.istio.io/v1", "kind": "AuthorizationPolicy",
                         "metadata": {"name": "meshcache-engine", "namespace": namespace}})
    assert ap is not None
    assert ap["spec"]["rules"][0]["from"][0]["source"]["principals"][0] == \
        f"cluster.local/ns/{namespace}/sa/meshcache-client"

    values = tmp_path / "kserve.json"
    values.write_text(json.dumps(KSERVE))
    notes = helm(helm_env, "upgrade", "meshcache", str(CHART), "--namespace", namespace, "-f", str(values)).stdout
    assert "istiod is not changed" in notes and "helm upgrade istiod" not in notes
    assert "caching the pods labelled component=predictor,serving.kserve.io/inferenceservice=sklearn" in notes
    upgraded = _manifest(helm_env, namespace)
    kept = {_ref(o) for o in upgraded}
    for obj in installed:
        if _ref(obj) not in kept:  # meshcache's engine, its routes, gateway and PeerAuthentication
            assert _live(istio_cluster, obj) is None, _ref(obj)
    assert {_ref(o) for o in installed} - kept == {
        "serviceaccount/meshcache-engine", "deployment.apps/meshcache-engine-blue", "service/meshcache-engine",
        "peerauthentication.security.istio.io/default", "virtualservice.networking.istio.io/meshcache-engine",
        "virtualservice.networking.istio.io/meshcache-engine-ingress", "gateway.networking.istio.io/meshcache-ingress"}
    role = _live(istio_cluster, {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {
        "name": "meshcache-control-plane-istio-objects", "namespace": namespace}})
    assert role is not None and role["rules"] == [
        {"apiGroups": ["networking.istio.io"], "resources": ["envoyfilters"],
         "verbs": ["get", "list", "create", "patch", "delete"]},
        {"apiGroups": ["rbac.authorization.k8s.io"], "resources": ["roles"],
         "resourceNames": [extensions.WRITER_ROLE], "verbs": ["get"]}]
    # The control plane's ServiceAccount may now write EnvoyFilters here, and nothing else.
    sa = f"system:serviceaccount:{namespace}:meshcache-control-plane"
    can = istio_cluster.kubectl("auth", "can-i", "create", "envoyfilters.networking.istio.io", "-n", namespace,
                          f"--as={sa}", check=False)
    assert can.stdout.strip() == "yes"
    cannot = istio_cluster.kubectl("auth", "can-i", "create", "envoyfilters.networking.istio.io", "-n", "default",
                             f"--as={sa}", check=False)
    assert cannot.stdout.strip() == "no"

    helm(helm_env, "uninstall", "meshcache", "--namespace", namespace)
    for obj in upgraded:
        assert _live(istio_cluster, obj) is None, _ref(obj)



def test_helm_install_native(istio_cluster: LocalCluster, helm_env: dict[str, str], namespace: str,
                             tmp_path: Path) -> None:
    """filter.host native: the API server keeps the engine's pod template as the chart writes it
    (the module's init container, its emptyDir and the sidecar annotations; the same as render's,
    tests/istio/test_helm.py) and the control plane's native mode."""
    values = tmp_path / "native.json"
    values.write_text(json.dumps(NATIVE))
    helm(helm_env, "install", "meshcache", str(CHART), "--namespace", namespace, "-f", str(values))
    deployments = {o["metadata"]["name"]: o for o in _manifest(helm_env, namespace) if o["kind"] == "Deployment"}
    engine = deployments["meshcache-engine-blue"]
    live = _live(istio_cluster, engine)
    assert live is not None
    want, got = engine["spec"]["template"], live["spec"]["template"]
    assert got["metadata"]["annotations"] == want["metadata"]["annotations"]
    assert json.loads(got["metadata"]["annotations"]["sidecar.istio.io/userVolumeMount"]) == {
        "meshcache-module": {"mountPath": "/var/lib/meshcache/modules", "readOnly": True}}
    init = {c["name"]: c for c in got["spec"]["initContainers"]}["meshcache-module"]
    assert (init["image"], init["command"]) == (NATIVE["filter"]["native"]["image"],
                                                 want["spec"]["initContainers"][-1]["command"])
    assert {v["name"]: v for v in got["spec"]["volumes"]}["meshcache-module"]["emptyDir"] == {"sizeLimit": "64Mi"}
    cp = _live(istio_cluster, deployments["meshcache-control-plane"])
    assert cp is not None
    env = _env(cp["spec"]["template"]["spec"]["containers"][0])
    assert (env["MESHCACHE_CP_ISTIO_MODE"], env["MESHCACHE_CP_ISTIO_NATIVE_MODULE"]) == (
        "native", "/var/lib/meshcache/modules/libmeshcache_native-envoy-1.39.so")


def test_helm_uninstall_removes_what_the_control_plane_wrote(
        istio_cluster: LocalCluster, helm_env: dict[str, str], namespace: str, tmp_path: Path,
        start_cp: Callable[..., ControlPlaneProc]) -> None:
    """delivery kube: a real control plane, as the release's ServiceAccount with the release's
    Role, writes the EnvoyFilters; each is owned by that Role, so `helm uninstall` (which deletes
    the Role) leaves none behind: Kubernetes' garbage collector deletes them. An EnvoyFilter of
    someone else's, with the same label, stays."""
    values = tmp_path / "kserve.json"
    values.write_text(json.dumps(KSERVE))
    helm(helm_env, "install", "meshcache", str(CHART), "--namespace", namespace, "-f", str(values))
    kubeconfig = service_account_kubeconfig(istio_cluster, namespace, "meshcache-control-plane",
                                            tmp_path / "cp.kubeconfig")
    cp = start_cp(extra_env={
        "MESHCACHE_CP_DELIVERY": "kube", "MESHCACHE_CP_KUBECONFIG": str(kubeconfig),
        "MESHCACHE_CP_ISTIO_NAMESPACE": namespace, "MESHCACHE_CP_ISTIO_COLOR": "",
        "MESHCACHE_CP_ISTIO_SELECTOR": "serving.kserve.io/inferenceservice=sklearn,component=predictor",
        "MESHCACHE_CP_ISTIO_HTTP_PORTS": "8080", "MESHCACHE_CP_ISTIO_GRPC_PORTS": "",
        "MESHCACHE_CP_ISTIO_SERVICE_PORTS": "80",
        "MESHCACHE_CP_ISTIO_WASM_URL": f"oci://registry.example.com/meshcache/filter@sha256:{DIGEST}",
        "MESHCACHE_CP_ISTIO_WASM_SHA256": DIGEST, "MESHCACHE_CP_KUBE_RESYNC_S": "1"})
    path = extensions.KUBE_RESOURCES["EnvoyFilter"].path(namespace)

    def names() -> set[str]:
        return {o["metadata"]["name"] for o in (istio_cluster.get(path) or {}).get("items", [])}

    istio_cluster.kubectl("apply", "--server-side", "-f", "-", input=json.dumps({
        "apiVersion": "networking.istio.io/v1alpha3", "kind": "EnvoyFilter",
        "metadata": {"name": "someone-else", "namespace": namespace, "labels": dict(extensions.MANAGED_BY)},
        "spec": {"workloadSelector": {"labels": {"app": "other"}}, "configPatches": []}}))
    with cp.client() as c:
        assert c.put("/v1/policies/sklearn", json={"ttl_s": 60}).status_code == 200
    eventually(lambda: names() == {"meshcache", "meshcache-client", "someone-else"}, timeout=30)
    role = _live(istio_cluster, {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {
        "name": extensions.WRITER_ROLE, "namespace": namespace}})
    assert role is not None and role["metadata"]["annotations"]["meta.helm.sh/release-name"] == "meshcache"

    helm(helm_env, "uninstall", "meshcache", "--namespace", namespace)
    eventually(lambda: names() == {"someone-else"}, timeout=60)


def test_helm_install_refused_in_istio_system(istio_cluster: LocalCluster, helm_env: dict[str, str]) -> None:
    r = helm(helm_env, "install", "meshcache", str(CHART), "--namespace", "istio-system", check=False)
    assert r.returncode != 0
    assert "namespace istio-system: that is Istio's or Kubernetes' own namespace" in r.stderr
