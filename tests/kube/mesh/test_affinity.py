"""Cache affinity through the rendered DestinationRule with three engine pods (the engine
Deployment scaled as `meshcache up --kube --replicas 3` does it): the caller's sidecar, labelled
`meshcache.io/cache-affinity: "true"`, runs the client-role filter (EnvoyFilter `meshcache-client`
from MCP) that sets `x-meshcache-route-key`, and the subset's consistent hash sends identical
requests to the pod whose sidecar holds the answer: every answer computed once in the mesh.
tests/istiod/test_affinity.py is the same check without Kubernetes."""

from __future__ import annotations

import json
import re
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
    service_ip,
)

Obj = dict[str, Any]
MODEL = "mlp-classifier"


def _engine_deployment(objects: list[Obj]) -> Obj:
    return next(o for o in objects if o["kind"] == "Deployment" and o["metadata"]["labels"].get("app")
                == render.ENGINE_APP)


def _endpoints(caller: Any, port: int) -> set[str]:
    """The healthy endpoints of the engine Service's port in the caller sidecar's clusters."""
    out = envoy_admin(caller, "/clusters")
    cluster = rf"outbound\|{port}\|[^|]*\|{render.ENGINE_APP}\.[^:]*"
    pattern = re.compile(rf"^{cluster}::([0-9.]+):{port}::health_flags::healthy$")
    return {m.group(1) for line in out.splitlines() if (m := pattern.match(line))}


def test_identical_requests_reach_the_replica_that_holds_the_answer(kube_mesh: KubeMesh) -> None:
    rendered = _engine_deployment(kube_mesh.objects)
    try:
        kube_mesh.apply_rendered([_engine_deployment(scale_engine(kube_mesh.objects, 3))])
        pods = ready_engine_pods(kube_mesh, count=3)
        ips = {p["status"]["podIP"] for p in pods}
        client = caller_pod(kube_mesh, CACHE_CALLER, "meshcache-client", {AFFINITY_LABEL: "true"})
        assert ecds_filters(client)["meshcache-client"]["typed_config"]["@type"].endswith("wasm.v3.Wasm")
        eventually(lambda: _endpoints(client, 8000) == ips == _endpoints(client, 8001), timeout=60, interval=0.5)
        ip = service_ip(kube_mesh)
        before = engine_calls(kube_mesh, MODEL, pods)
        n = 12
        bodies = [json.dumps(mlp_json(seed=3420 + seed)) for seed in range(n)]
        for body in bodies:
            first = http_call(client, f"/v2/models/{MODEL}/infer", render.ENGINE_APP, ip, body=body)
            assert first["headers"]["cache-status"] == "meshcache; fwd=miss; stored", first
        for seed, body in enumerate(bodies):
            again = http_call(client, f"/v2/models/{MODEL}/infer", render.ENGINE_APP, ip, body=body)
            assert again["headers"]["cache-status"].startswith("meshcache; hit; ttl="), (seed, again["headers"])
        after = engine_calls(kube_mesh, MODEL, pods)
        added = {name: after[name] - before[name] for name in after}
        assert sum(added.values()) == n, f"each answer computed once in the whole mesh: {added}"
        assert sum(1 for a in added.values() if a) >= 2, f"keys spread over the replicas: {added}"

        # gRPC the same way.
        for seed in range(6):
            request = mlp_request(seed=3440 + seed).SerializeToString()
            first = grpc_call(client, MODEL_INFER, request, render.ENGINE_APP, ip)
            second = grpc_call(client, MODEL_INFER, request, render.ENGINE_APP, ip)
            assert first["cache_status"] == "meshcache; fwd=miss; stored", first
            assert second["cache_status"].startswith("meshcache; hit; ttl=") and second["response"] == first["response"]
        assert sum(engine_calls(kube_mesh, MODEL, pods).values()) == sum(after.values()) + 6
    finally:  # the shared mesh's engine Deployment as rendered
        kube_mesh.apply_rendered([rendered])
        ready_engine_pods(kube_mesh, count=rendered["spec"]["replicas"])
        # The third pod gone from the API server, not only terminating: other tests list the pods.
        listed = f"/api/v1/namespaces/{NS}/pods?labelSelector=app%3D{render.ENGINE_APP}"
        eventually(lambda: len((kube_mesh.cluster.get(listed) or {}).get("items", []))  # type: ignore[union-attr]
                   == rendered["spec"]["replicas"], timeout=90, interval=0.5)
