"""Engine killed: hits are still served from the server sidecar; misses fail fast (503 / UNAVAILABLE)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from meshcache.ctl.mesh.config import MeshConfig
from meshcache.ctl.mesh.topology import SERVER_NODE, Mesh
from tests.helpers.kserve import grpc_call, mlp_json, mlp_request, rest_infer


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


def test_engine_killed_after_the_ttl_stale_answers_within_the_window(own_mesh: Mesh) -> None:
    """stale-if-error through the local mesh (mTLS client sidecar -> server sidecar -> engine)."""
    app = own_mesh.endpoints()["app"]
    with own_mesh.api() as api:
        version = api.put("mlp-classifier", {"ttl_s": 1, "max_ttl_s": 1, "stale_if_error_s": 4})["version"]
        api.wait_acked(SERVER_NODE, version)
    request = mlp_request(seed=4101).SerializeToString()
    body = mlp_json(seed=4102)
    stored_at = time.monotonic()
    stored_grpc, status = grpc_call(app, request)
    assert status == "meshcache; fwd=miss; stored"
    stored_rest = rest_infer(app, "mlp-classifier", body)
    assert stored_rest.headers["cache-status"] == "meshcache; fwd=miss; stored"
    time.sleep(max(0.0, stored_at + 1.3 - time.monotonic()))
    engine = own_mesh.proc("engine")
    engine.kill()
    assert not engine.alive()

    response, status = grpc_call(app, request)
    assert response == stored_grpc, "the stored message, byte for byte"
    assert status.startswith("meshcache; hit; stale; ttl=-") and status.endswith("detail=stale-if-error")
    stale = rest_infer(app, "mlp-classifier", body)
    assert stale.status_code == 200 and stale.content == stored_rest.content
    assert stale.headers["cache-status"].endswith("; fwd-status=503; detail=stale-if-error")
    assert int(stale.headers["age"]) >= 1

    time.sleep(max(0.0, stored_at + 5.5 - time.monotonic()))
    with pytest.raises(grpc.RpcError) as err:
        grpc_call(app, request, timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
    assert rest_infer(app, "mlp-classifier", body).status_code == 503
