"""Policy changes made through the control-plane API reach the server sidecar and the traffic."""

from __future__ import annotations

import re

import numpy as np

from meshcache.contract.filter_config import policy_spec
from meshcache.contract.protos import grpc_predict_v2_pb2 as pb
from meshcache.ctl.mesh.topology import SERVER_NODE, Mesh
from tests.helpers.kserve import grpc_call, mlp_request
from tests.mesh.helpers import default_engine_calls

MODEL = "text-embedder"


def _request(seed: int) -> bytes:
    request = pb.ModelInferRequest(model_name=MODEL)
    request.inputs.add(name="token_ids", datatype="INT64", shape=[1, 5])
    request.raw_input_contents.append(np.random.default_rng(seed).integers(1, 999, (1, 5)).tobytes())
    return request.SerializeToString()


def _ttl(status: str) -> int:
    m = re.fullmatch(r"meshcache; hit; ttl=(\d+)", status)
    assert m, status
    return int(m.group(1))


def test_ttl_purge_disable_and_delete_reach_the_mesh(mesh: Mesh) -> None:
    app = mesh.endpoints()["app"]
    with mesh.api() as api:
        original = next(p for p in api.policies()["policies"] if p["model_prefix"] == MODEL)
        try:
            # TTL: new entries get the new TTL.
            api.wait_acked(SERVER_NODE, api.put(MODEL, {"ttl_s": 42, "max_ttl_s": 42})["version"])
            request = _request(3001)
            assert grpc_call(app, request)[1] == "meshcache; fwd=miss; stored"
            assert 40 <= _ttl(grpc_call(app, request)[1]) <= 42

            # Purge: the stored entry is unreachable; the next request goes to the engine.
            api.wait_acked(SERVER_NODE, api.purge(MODEL)["version"])
            calls = default_engine_calls(mesh, MODEL)
            assert grpc_call(app, request)[1] == "meshcache; fwd=miss; stored"
            assert default_engine_calls(mesh, MODEL) == calls + 1
            assert grpc_call(app, request)[1].startswith("meshcache; hit")

            # Disabled: bypass (the engine answers every time).
            api.wait_acked(SERVER_NODE, api.put(MODEL, {"ttl_s": 42, "enabled": False})["version"])
            calls = default_engine_calls(mesh, MODEL)
            assert grpc_call(app, request)[1] == "meshcache; fwd=bypass; detail=disabled"
            assert grpc_call(app, request)[1] == "meshcache; fwd=bypass; detail=disabled"
            assert default_engine_calls(mesh, MODEL) == calls + 2

            # Deleted: no policy, no caching.
            api.wait_acked(SERVER_NODE, api.delete(MODEL)["version"])
            assert grpc_call(app, _request(3002))[1] == "meshcache; fwd=bypass; detail=no-policy"
        finally:
            spec = policy_spec(original)
            api.wait_acked(SERVER_NODE, api.put(MODEL, spec)["version"])
    # Other models were not touched by any of this.
    other = mlp_request(seed=3003).SerializeToString()
    assert grpc_call(app, other)[1] == "meshcache; fwd=miss; stored"
    assert grpc_call(app, other)[1].startswith("meshcache; hit")
