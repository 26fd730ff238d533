"""Cache affinity through istiod: three engine pods of one colour, the client pod labelled
`meshcache.io/cache-affinity: "true"`; the client-role EnvoyFilter (from MCP) sets the routing
key in the client's sidecar and the rendered DestinationRule's consistent hash picks the replica.
A caller whose first client-role config is refused passes its requests (the fail-open default).
(The native host's mesh runs the same checks: test_istiod.py, on its own three replicas.)"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from meshcache.ctl.istiod.mesh import IstiodMesh
from tests.istiod.helpers import assert_cache_affinity, assert_client_role_fails_open, istiod_mesh


@pytest.fixture(scope="module")
def mesh3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[IstiodMesh]:
    with istiod_mesh(tmp_path_factory, "istiod-affinity", replicas=3, canary_color="") as m:
        yield m


def test_identical_requests_reach_the_replica_that_holds_the_answer(mesh3: IstiodMesh) -> None:
    # REST and gRPC in one test per mesh: a module's tests may land on both xdist workers.
    assert_cache_affinity(mesh3, seeds=range(2400, 2412), grpc_seeds=range(2450, 2456))
    # And the client role fails open: a caller whose first `meshcache-client` config is refused.
    assert_client_role_fails_open(mesh3, seeds=range(2460, 2466))
