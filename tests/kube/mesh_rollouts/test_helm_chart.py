"""charts/meshcache installed with the real Helm into the shared kube mesh's cluster, in a namespace
of its own, with `delivery: kube` and meshcache's engine, and run for real on the test kubelet:
every pod of the chart Ready (the control plane, Redis with its claim bound, the engine injected
with istio-proxy); a policy PUT to the chart's control plane becomes EnvoyFilters it writes into
the API server, which istiod reads through its Kubernetes watch and sends to the engine sidecars
(ECDS in their config dumps); REST through a client pod's sidecar is a MISS then a HIT; `helm
uninstall` takes the pods away and the EnvoyFilters the control plane wrote with them (owned by
the release's Role), then the client pod's sidecar has no meshcache filter. The shared
mesh's own namespace is not touched."""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest

from meshcache.contract.extensions import AFFINITY_LABEL, MANAGED_BY, WRITER_ROLE
from meshcache.ctl.istio import render, xds_tls
from meshcache.ctl.kube.mesh import KubeMesh
from tests.helpers.kserve import MODEL_INFER, mlp_json, mlp_request
from tests.helpers.wait import eventually
from tests.istio.helpers import CHART, HELM
from tests.kube.mesh.helpers import (
    caller_pod,
    ecds_filters,
    engine_calls,
    engine_pods,
    grpc_call,
    http_ok,
    proxy_status,
    ready_engine_pods,
    running,
    service_ip,
)

Obj = dict[str, Any]
MODEL = "mlp-classifier"
TTL_S = 321
NEW_TTL_S = 654
# One engine replica (the shared node's CPU; the control plane's minimum is 2); the PriorityClass
# is the shared mesh's (a second release).
VALUES = {"delivery": "kube", "engine": {"replicas": 1}, "controlPlane": {"priorityClass": {"create": False}}}
LABELS = ",".join(f"{k}%3D{v}" for k, v in MANAGED_BY.items())


@pytest.fixture
def release(kube_mesh: KubeMesh, tmp_path: Path) -> Iterator[tuple[str, dict[str, str], str]]:
    """The release namespace (labelled for injection) with the Secrets the operator creates, a
    Helm environment, and the API token; uninstalled and deleted afterwards."""
    assert kube_mesh.cluster is not None
    ns = f"helm-{uuid.uuid4().hex[:8]}"
    cluster = kube_mesh.cluster
    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig), "HELM_CACHE_HOME": str(tmp_path / "cache"),
           "HELM_CONFIG_HOME": str(tmp_path / "config"), "HELM_DATA_HOME": str(tmp_path / "data")}
    token = uuid.uuid4().hex
    xds_tls.issue(ns, tmp_path / "xds-tls")
    cluster.kubectl("create", "namespace", ns)
    cluster.kubectl("label", "namespace", ns, "istio-injection=enabled")
    cluster.kubectl("-n", ns, "create", "secret", "generic", "meshcache-cp-tokens",
                    f"--from-literal=tokens=write:ops:{token}\n")
    cluster.kubectl("-n", ns, "create", "secret", "tls", "meshcache-cp-xds-tls",
                    f"--cert={tmp_path / 'xds-tls' / 'tls.crt'}", f"--key={tmp_path / 'xds-tls' / 'tls.key'}")
    try:
        yield ns, env, token
    finally:
        helm(env, "uninstall", "meshcache", "--namespace", ns, check=False)
        cluster.kubectl("delete", "pod", "--all", "-n", ns, "--wait=false", check=False)
        cluster.kubectl("delete", "envoyfilters", "--all", "-n", ns, check=False)
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def helm(env: dict[str, str], *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run([str(HELM), *args], capture_output=True, text=True, timeout=300, env=env)
    if check:
        assert r.returncode == 0, r.stderr
    return r


def _pods(mesh: KubeMesh, ns: str) -> list[Obj]:
    return engine_pods(mesh, selector="app.kubernetes.io/part-of=meshcache", namespace=ns) + \
        [p for p in engine_pods(mesh, selector="app", namespace=ns)
         if p["metadata"]["labels"].get("app") in ("meshcache-control-plane", "meshcache-redis")]


def _ready(mesh: KubeMesh, ns: str, app: str, count: int) -> list[Obj]:
    return ready_engine_pods(mesh, count=count, selector=f"app={app}", namespace=ns, timeout=300)


def _envoyfilters(mesh: KubeMesh, ns: str) -> list[Obj]:
    assert mesh.cluster is not None
    got = mesh.cluster.get(f"/apis/networking.istio.io/v1alpha3/namespaces/{ns}/envoyfilters?labelSelector={LABELS}")
    return list((got or {}).get("items", []))


def test_helm_install_runs_on_the_kube_mesh(kube_mesh: KubeMesh, release: tuple[str, dict[str, str], str],
                                           tmp_path: Path) -> None:
    assert kube_mesh.cluster is not None
    ns, env, token = release
    values = tmp_path / "values.json"
    values.write_text(json.dumps(VALUES))
    helm(env, "install", "meshcache", str(CHART), "--namespace", ns, "-f", str(values))

    # Every pod of the chart Ready on the test kubelet.
    cps = _ready(kube_mesh, ns, "meshcache-control-plane", 2)
    cp = cps[0]
    [redis] = _ready(kube_mesh, ns, "meshcache-redis", 1)
    [engine] = _ready(kube_mesh, ns, render.ENGINE_APP, 1)
    assert (proxy_status(engine) or {}).get("ready"), engine["status"]
    assert all(proxy_status(p) is None for p in [*cps, redis])  # not injected
    claims = kube_mesh.cluster.get(f"/api/v1/namespaces/{ns}/persistentvolumeclaims")
    assert claims is not None and [c["status"]["phase"] for c in claims["items"]] == ["Bound"]

    # A policy on the chart's control plane (its pod address, from the node) -> its EnvoyFilters
    # in the API server -> istiod's Kubernetes watch -> ECDS in the engine's sidecar.
    api = httpx.Client(base_url=f"http://{cp['status']['podIP']}:8080", timeout=10,
                       headers={"Authorization": f"Bearer {token}"})
    with api:
        version = int(api.put(f"/v1/policies/{MODEL}", json={"ttl_s": TTL_S}).raise_for_status().json()["version"])

    def written() -> list[Obj]:
        objs = _envoyfilters(kube_mesh, ns)
        assert objs and all(int(o["metadata"]["annotations"]["meshcache.io/snapshot-version"]) >= version
                            for o in objs), objs
        return objs

    filters = eventually(written, timeout=90, interval=1.0)
    assert all(o["metadata"]["name"].startswith("meshcache") for o in filters)

    def in_sidecar(pod: Obj, version: int, ttl: int) -> Obj:
        plugin = ecds_filters(running(kube_mesh, pod))["meshcache"]
        config = json.loads(plugin["typed_config"]["config"]["configuration"]["value"])
        assert int(config["version"]) >= version, config
        assert any(p.get("model_prefix") == MODEL and p.get("ttl_s") == ttl for p in config["policies"]), config
        return config

    eventually(lambda: in_sidecar(engine, version, TTL_S), timeout=120, interval=1.0)

    # REST from a client pod of the release's namespace, through its sidecar: MISS, then HIT.
    client = caller_pod(kube_mesh, "helm-caller", "meshcache-client", {AFFINITY_LABEL: "true"}, namespace=ns)
    ip = service_ip(kube_mesh, ns)
    path, body = f"/v2/models/{MODEL}/infer", json.dumps(mlp_json(seed=3535))

    post = partial(http_ok, client, path, ip, body)

    first = eventually(post, timeout=60)
    assert first["headers"]["cache-status"] == "meshcache; fwd=miss; stored", first["headers"]
    calls = engine_calls(kube_mesh, MODEL, [engine])
    second = post()
    assert second["headers"]["cache-status"].startswith("meshcache; hit; ttl="), second["headers"]
    assert second["body"] == first["body"]
    assert engine_calls(kube_mesh, MODEL, [engine]) == calls  # the hit did not reach the engine
    request = mlp_request(seed=3536).SerializeToString()
    g1 = grpc_call(client, MODEL_INFER, request, render.ENGINE_APP, ip)
    g2 = grpc_call(client, MODEL_INFER, request, render.ENGINE_APP, ip)
    assert g1["cache_status"] == "meshcache; fwd=miss; stored", g1
    assert g2["cache_status"].startswith("meshcache; hit; ttl=") and g2["response"] == g1["response"], g2

    # helm upgrade with another live colour: the control plane rolls (a new replica, the policy
    # kept in Redis on its claim), writes the green EnvoyFilter next to blue's, and drives the
    # sidecars: a TTL change through the new replica reaches the engine's sidecar.
    values.write_text(json.dumps({**VALUES, "engine": {"replicas": 1, "alsoColors": ["green"]}}))
    helm(env, "upgrade", "meshcache", str(CHART), "--namespace", ns, "-f", str(values))

    def rolled() -> Obj:
        new = _ready(kube_mesh, ns, "meshcache-control-plane", 2)
        assert not {p["metadata"]["name"] for p in new} & {p["metadata"]["name"] for p in cps}, new
        return new[0]

    new_cp = eventually(rolled, timeout=300, interval=1.0)
    names = {o["metadata"]["name"] for o in eventually(written, timeout=90, interval=1.0)}
    assert names == {o["metadata"]["name"] for o in filters} | {"meshcache-green"}, names
    in_sidecar(engine, version, TTL_S)  # the rollout took nothing away
    with httpx.Client(base_url=f"http://{new_cp['status']['podIP']}:8080", timeout=10,
                      headers={"Authorization": f"Bearer {token}"}) as api:
        changed = int(api.put(f"/v1/policies/{MODEL}", json={"ttl_s": NEW_TTL_S}).raise_for_status()
                      .json()["version"])
    assert changed > version
    eventually(lambda: in_sidecar(engine, changed, NEW_TTL_S), timeout=120, interval=1.0)

    # The client pod's sidecar has the client role's filter from the same EnvoyFilters.
    assert [n for n in ecds_filters(client) if n.startswith("meshcache")], ecds_filters(client)

    # helm uninstall: the chart's pods go, and the EnvoyFilters the control plane wrote with them
    # (owned by the release's Role: the garbage collector deletes them); then the namespace's
    # remaining sidecars have no meshcache filter.
    assert all(o["metadata"]["ownerReferences"][0]["name"] == WRITER_ROLE for o in _envoyfilters(kube_mesh, ns))
    helm(env, "uninstall", "meshcache", "--namespace", ns, "--wait", "--timeout", "180s")

    def gone() -> bool:
        left = [p["metadata"]["name"] for p in _pods(kube_mesh, ns)]
        assert left == [], left
        written = [o["metadata"]["name"] for o in _envoyfilters(kube_mesh, ns)]
        assert written == [], written
        return True

    eventually(gone, timeout=120, interval=1.0)

    def unfiltered() -> bool:
        left = [n for n in ecds_filters(client) if n.startswith("meshcache")]
        assert left == [], left
        return True

    eventually(unfiltered, timeout=120, interval=1.0)
