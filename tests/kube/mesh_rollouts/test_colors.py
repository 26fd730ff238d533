"""Colours through the cluster, as docs/istio.md "Colours and the ingress gateway" has a user roll
one out: `meshcache istio render --color green --also-color blue` applied with `kubectl apply
--server-side` (the green engine Deployment next to the live blue one, the DestinationRule's
colour subsets, the VirtualService's `x-traffic-color` routes with green the default, the control
plane's colour list, rolled out). Then `x-traffic-color: blue` reaches the blue pods through the
caller's sidecar and is cached apart from the default colour's answers; gRPC too. The shared
mesh is put back as rendered afterwards (blue only)."""

from __future__ import annotations

import json
from typing import Any

from meshcache.contract.extensions import AFFINITY_LABEL
from meshcache.ctl.istio import render
from meshcache.ctl.kube.mesh import KubeMesh
from meshcache.ctl.kube.up import scale_engine
from tests.helpers.kserve import MODEL_INFER, mlp_json, mlp_request
from tests.helpers.wait import eventually
from tests.kube.mesh.helpers import (
    CACHE_CALLER,
    NS,
    caller_pod,
    ecds_filters,
    engine_calls,
    envoy_admin,
    grpc_call,
    http_call,
    ready_engine_pods,
    running,
    service_ip,
)

Obj = dict[str, Any]
MODEL = "mlp-classifier"
GREEN, BLUE = "green", "blue"
COLOR_HEADER = "x-traffic-color"


def _selector(color: str) -> str:
    return f"app={render.ENGINE_APP},color={color}"


def _envoy_filters(mesh: KubeMesh) -> set[str]:
    """The EnvoyFilters istiod holds (from the control plane over MCP)."""
    assert mesh.istiod is not None
    return {c["metadata"]["name"] for c in mesh.istiod.debug("configz") if c["kind"] == "EnvoyFilter"}


def test_blue_reaches_its_pods_through_the_rendered_routes_and_is_cached_apart(kube_mesh: KubeMesh) -> None:
    assert kube_mesh.cluster is not None and kube_mesh.istiod is not None
    cfg = kube_mesh.config
    blue_pods = ready_engine_pods(kube_mesh, selector=_selector(BLUE))
    # One green pod is enough to be the default route here (the rendering's 2 would only add load).
    green = scale_engine(render.render(render.RenderOptions(namespace=cfg.namespace, module_path=cfg.module,
                                                            color=GREEN, also_colors=(BLUE,))), 1)
    try:
        kube_mesh.apply_rendered(green)
        kube_mesh.roll_control_plane(green)
        green_pods = ready_engine_pods(kube_mesh, count=1, selector=_selector(GREEN))
        eventually(lambda: {"meshcache-green", "meshcache-blue"} <= _envoy_filters(kube_mesh), timeout=30)
        # Each colour's sidecars run their colour's filter (the cache keys on it).
        for pods, color in ((green_pods, GREEN), (blue_pods, BLUE)):
            def keyed(pods: list[Obj] = pods, color: str = color) -> bool:
                for pod in pods:
                    config = ecds_filters(running(kube_mesh, pod))["meshcache"]["typed_config"]
                    assert config["@type"].endswith("wasm.v3.Wasm"), config["@type"]
                    assert json.loads(config["config"]["configuration"]["value"])["color"] == color
                return True

            eventually(keyed, timeout=60, interval=0.5)
        ip = service_ip(kube_mesh)
        client = caller_pod(kube_mesh, CACHE_CALLER, "meshcache-client", {AFFINITY_LABEL: "true"})
        path, body = f"/v2/models/{MODEL}/infer", json.dumps(mlp_json(seed=3460))

        def post(color: str = "") -> Obj:
            result = http_call(client, path, render.ENGINE_APP, ip, body=body,
                               headers={COLOR_HEADER: color} if color else None)
            assert result["status"] == 200, result
            return result

        def calls() -> tuple[float, float]:
            return (sum(engine_calls(kube_mesh, MODEL, green_pods).values()),
                    sum(engine_calls(kube_mesh, MODEL, blue_pods).values()))

        # The caller's sidecar has the colour routes (default: green) and the green endpoints.
        def routed() -> bool:
            routes = envoy_admin(client, "/config_dump?resource=dynamic_route_configs")
            clusters = envoy_admin(client, "/clusters")
            for port in (8000, 8001):
                name = f"outbound|{port}|{GREEN}|{render.ENGINE_APP}.{NS}.svc.cluster.local"
                assert name in routes, name
                assert f"{name}::{green_pods[0]['status']['podIP']}:{port}::health_flags::healthy" in clusters, name
            return True

        eventually(routed, timeout=60, interval=0.5)
        g0, b0 = calls()
        default = post()
        assert calls() == (g0 + 1, b0), "the default colour: green"
        assert default["headers"]["cache-status"] == "meshcache; fwd=miss; stored"
        blue = post(BLUE)
        assert blue["headers"]["cache-status"] == "meshcache; fwd=miss; stored", "not the green entry"
        assert calls() == (g0 + 1, b0 + 1), "x-traffic-color: blue reaches the blue pods"
        again = post(BLUE)
        assert again["headers"]["cache-status"].startswith("meshcache; hit; ttl=") and again["body"] == blue["body"]
        assert post()["headers"]["cache-status"].startswith("meshcache; hit; ttl=")
        assert calls() == (g0 + 1, b0 + 1)
        # gRPC the same way.
        request = mlp_request(seed=3461).SerializeToString()
        g1 = grpc_call(client, MODEL_INFER, request, render.ENGINE_APP, ip, {COLOR_HEADER: BLUE})
        g2 = grpc_call(client, MODEL_INFER, request, render.ENGINE_APP, ip, {COLOR_HEADER: BLUE})
        assert g1["cache_status"] == "meshcache; fwd=miss; stored", g1
        assert g2["cache_status"].startswith("meshcache; hit; ttl=") and g2["response"] == g1["response"]
        assert calls() == (g0 + 1, b0 + 2)
    finally:  # the shared mesh as rendered: blue only
        kube_mesh.apply_rendered()
        kube_mesh.cluster.kubectl("delete", "deployment", f"{render.ENGINE_APP}-{GREEN}", "-n", NS,
                                  "--ignore-not-found", "--wait=false")
        kube_mesh.roll_control_plane(kube_mesh.objects)
        # Gone from the API server, not only terminating: other tests list the engine pods.
        green_listed = f"/api/v1/namespaces/{NS}/pods?labelSelector=color%3D{GREEN}"
        eventually(lambda: not (kube_mesh.cluster.get(green_listed) or {}).get("items"),  # type: ignore[union-attr]
                   timeout=90, interval=0.5)
        eventually(lambda: "meshcache-green" not in _envoy_filters(kube_mesh), timeout=30)
