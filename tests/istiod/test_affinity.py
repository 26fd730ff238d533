"""Cache affinity through istiod: three engine pods of one colour, the client pod labelled
`meshcache.io/cache-affinity: "true"`; the client-role EnvoyFilter (from MCP) sets the routing
key in the client's sidecar and the rendered DestinationRule's consistent hash picks the replica."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from meshcache.ctl.istiod.mesh import IstiodMesh, ecds_filters
from tests.helpers.kserve import engine_calls, mlp_json, mlp_request
from tests.istiod.helpers import grpc_infer, istiod_mesh, rest_infer


@pytest.fixture(scope="module")
def mesh3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[IstiodMesh]:
    with istiod_mesh(tmp_path_factory, "istiod-affinity", replicas=3, canary_color="") as m:
        yield m


def per_replica(mesh: IstiodMesh, model: str) -> list[float]:
    return [engine_calls(model, e.engine.metrics_url) for e in mesh.engines]


def test_identical_requests_reach_the_replica_that_holds_the_answer(mesh3: IstiodMesh) -> None:
    assert mesh3.client is not None
    assert [f["ecds_filter"]["name"] for f in ecds_filters(mesh3.client)] == ["meshcache-client"]
    before = per_replica(mesh3, "mlp-classifier")
    n = 12
    for seed in range(n):
        first = rest_infer(mesh3, "mlp-classifier", mlp_json(seed=2400 + seed))
        assert first.headers["cache-status"] == "meshcache; fwd=miss; stored"
    for seed in range(n):
        again = rest_infer(mesh3, "mlp-classifier", mlp_json(seed=2400 + seed))
        assert again.headers["cache-status"].startswith("meshcache; hit; ttl="), seed
    after = per_replica(mesh3, "mlp-classifier")
    added = [a - b for a, b in zip(after, before, strict=True)]
    assert sum(added) == n, "each answer computed once in the whole mesh"
    assert sum(1 for a in added if a) >= 2, f"keys spread over the replicas: {added}"

    # gRPC too (one test per mesh: a module's tests may land on both xdist workers).
    before = sum(per_replica(mesh3, "mlp-classifier"))
    for seed in range(6):
        request = mlp_request(seed=2450 + seed).SerializeToString()
        first, s1 = grpc_infer(mesh3, request)
        second, s2 = grpc_infer(mesh3, request)
        assert s1 == "meshcache; fwd=miss; stored" and s2.startswith("meshcache; hit; ttl=") and first == second
    assert sum(per_replica(mesh3, "mlp-classifier")) == before + 6
