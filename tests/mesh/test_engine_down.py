"""Engine killed: hits are still served from the server sidecar; misses fail fast (503 / UNAVAILABLE)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from meshcache.ctl.mesh.config import MeshConfig
from meshcache.ctl.mesh.topology import Mesh
from tests.mesh.helpers import grpc_call, mlp_json, mlp_request, rest_infer


@pytest.fixture
def own_mesh(tmp_path: Path) -> Iterator[Mesh]:
    # No canary engine: this test is about the default one.
    config = dataclasses.replace(MeshConfig(state_dir=tmp_path / "mesh"), canary_color="").with_free_ports()
    with Mesh(config, log=lambda _: None) as m:
        yield m


def test_hits_survive_the_engine_and_misses_fail_fast(own_mesh: Mesh) -> None:
    app = own_mesh.endpoints()["app"]
    cached_grpc = mlp_request(seed=4001).SerializeToString()
    cached_json = mlp_json(seed=4002)
    stored_grpc, status = grpc_call(app, cached_grpc)
    assert status == "meshcache; fwd=miss; stored"
    stored_rest = rest_infer(app, "mlp-classifier", cached_json)
    assert stored_rest.headers["cache-status"] == "meshcache; fwd=miss; stored"

    engine = own_mesh.proc("engine")
    engine.kill()
    assert not engine.alive()

    response, status = grpc_call(app, cached_grpc)
    assert status.startswith("meshcache; hit") and response == stored_grpc
    hit = rest_infer(app, "mlp-classifier", cached_json)
    assert hit.status_code == 200 and hit.content == stored_rest.content

    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        grpc_call(app, mlp_request(seed=4003).SerializeToString(), timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
    assert time.monotonic() - t0 < 2.0

    t0 = time.monotonic()
    miss = rest_infer(app, "mlp-classifier", mlp_json(seed=4004))
    assert miss.status_code == 503
    assert time.monotonic() - t0 < 2.0
    # The failure was not cached: the same request fails again (it would be a hit otherwise).
    assert rest_infer(app, "mlp-classifier", mlp_json(seed=4004)).status_code == 503
    # The rest of the mesh is still up.
    assert all(p.alive() for p in own_mesh.procs if p.name != "engine")
