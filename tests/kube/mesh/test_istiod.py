"""istiod in Kubernetes mode against the local cluster, its MCP source the meshcache control plane
as istio/ renders it: the rendered workloads applied with `kubectl apply --server-side` come back
from the API server injected by istiod's webhook (engine pods, with our annotations applied) or
not (the control plane's), and istiod's validation webhook accepts the EnvoyFilters our control
plane serves and refuses a broken one."""

from __future__ import annotations

import copy
import json
from typing import Any

import yaml

from meshcache.ctl.istio import render
from meshcache.ctl.kube.mesh import KubeMesh
from tests.helpers.wait import eventually

Obj = dict[str, Any]
NS = render.BASE_NAMESPACE


def _pods(mesh: KubeMesh, app: str, count: int) -> list[Obj]:
    assert mesh.cluster is not None

    def listed() -> list[Obj]:
        pods = mesh.cluster.get(f"/api/v1/namespaces/{NS}/pods?labelSelector=app%3D{app}")  # type: ignore[union-attr]
        items = pods["items"] if pods else []
        return items if len(items) >= count else []

    return eventually(listed, timeout=60)


def _env(container: Obj) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container.get("env", [])}


def test_engine_pods_come_back_injected_with_our_annotations_applied(kube_mesh: KubeMesh) -> None:
    deployment = next(o for o in kube_mesh.objects if o["kind"] == "Deployment"
                      and o["metadata"]["labels"].get("app") == render.ENGINE_APP)
    pods = _pods(kube_mesh, render.ENGINE_APP, deployment["spec"]["replicas"])
    for pod in pods:
        status = json.loads(pod["metadata"]["annotations"]["sidecar.istio.io/status"])
        # Both as init containers: istio-init (traffic capture) and istio-proxy, a native sidecar.
        assert {"istio-init", "istio-proxy"} <= set(status["initContainers"])
        # The native sidecar keeps running beside the app (restartPolicy: Always).
        inits = {c["name"]: c for c in pod["spec"]["initContainers"]}
        proxy = inits["istio-proxy"]
        assert proxy.get("restartPolicy") == "Always"
        # Our proxy.istio.io/config: proxyMetadata as the agent's environment, the rest in PROXY_CONFIG.
        env = _env(proxy)
        color = deployment["metadata"]["labels"]["color"]
        assert env["MESHCACHE_TRAFFIC_COLOR"] == color and env["ISTIO_META_MESHCACHE_TRAFFIC_COLOR"] == color
        proxy_config = json.loads(env["PROXY_CONFIG"])
        assert proxy_config["holdApplicationUntilProxyStarts"] is True
        assert "wasmcustom.meshcache" in proxy_config["proxyStatsMatcher"]["inclusionPrefixes"]
        # holdApplicationUntilProxyStarts: the sidecar starts before the app's own init containers.
        names = [c["name"] for c in pod["spec"]["initContainers"]]
        assert names.index("istio-proxy") < names.index("demo-models")
        assert proxy["startupProbe"]["httpGet"]["path"] == "/healthz/ready"
        # The identity the agent will ask istiod's CA for: the pod's ServiceAccount token, istio-ca audience.
        token_volume = next(v for v in pod["spec"]["volumes"] if v["name"] == "istio-token")
        assert token_volume["projected"]["sources"][0]["serviceAccountToken"]["audience"] == "istio-ca"
        assert pod["spec"]["serviceAccountName"] == deployment["spec"]["template"]["spec"]["serviceAccountName"]


def test_the_control_plane_and_redis_pods_are_not_injected(kube_mesh: KubeMesh) -> None:
    for app in (render.CONTROL_PLANE, "meshcache-redis"):
        for pod in _pods(kube_mesh, app, 1):
            containers = [c["name"] for c in pod["spec"]["containers"] + pod["spec"].get("initContainers", [])]
            assert "istio-proxy" not in containers and "istio-init" not in containers, (app, containers)
            assert "sidecar.istio.io/status" not in pod["metadata"].get("annotations", {})


def _dry_run(mesh: KubeMesh, obj: Obj) -> tuple[int, str]:
    assert mesh.cluster is not None
    r = mesh.cluster.kubectl("apply", "--server-side", "--dry-run=server", "-f", "-",
                             input=yaml.safe_dump(obj), check=False)
    return r.returncode, r.stderr


def test_the_validation_webhook_accepts_our_envoyfilters_and_refuses_a_broken_one(kube_mesh: KubeMesh) -> None:
    served = render.mcp_objects(kube_mesh.objects, render.demo_plugin_config())
    filters = [o for o in served if o["kind"] == "EnvoyFilter"]
    assert filters
    for obj in filters:
        code, err = _dry_run(kube_mesh, obj)
        assert code == 0, (obj["metadata"]["name"], err)
    broken = copy.deepcopy(filters[0])
    broken["metadata"]["name"] = "broken"
    # Schema-valid for the CRD, invalid for Istio: a patch that adds a filter with no value.
    patch = broken["spec"]["configPatches"][0]["patch"]
    patch.pop("value", None)
    patch["operation"] = "INSERT_BEFORE"
    code, err = _dry_run(kube_mesh, broken)
    assert code != 0
    assert 'admission webhook "validation.istio.io" denied the request' in err, err
    assert "missing patch value" in err, err
