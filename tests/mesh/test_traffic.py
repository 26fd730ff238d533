"""Inference through the client sidecar: hits are byte-identical and never reach the engine."""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp

from meshcache.ctl.mesh.topology import Mesh
from meshcache.engine import perf_analyzer
from tests.helpers.kserve import grpc_call, mlp_request, rest_infer
from tests.mesh.helpers import default_engine_calls


def test_grpcio_miss_then_hit_byte_identical_without_engine_call(mesh: Mesh) -> None:
    app = mesh.endpoints()["app"]
    request = mlp_request(seed=1001).SerializeToString()
    before = default_engine_calls(mesh, "mlp-classifier")
    miss, status = grpc_call(app, request)
    assert status == "meshcache; fwd=miss; stored"
    assert default_engine_calls(mesh, "mlp-classifier") == before + 1
    for _ in range(3):
        hit, status = grpc_call(app, request)
        assert status.startswith("meshcache; hit; ttl=")
        assert hit == miss
    assert default_engine_calls(mesh, "mlp-classifier") == before + 1


def test_tritonclient_grpc_hits(mesh: Mesh) -> None:
    client = tgrpc.InferenceServerClient(mesh.endpoints()["app"])
    assert client.is_server_ready() and client.is_model_ready("resnet-mini")  # metadata calls pass through
    x = np.random.default_rng(1002).random((1, 3, 32, 32), dtype=np.float32)
    inp = tgrpc.InferInput("image", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    before = default_engine_calls(mesh, "resnet-mini")
    first = client.infer("resnet-mini", [inp])
    assert default_engine_calls(mesh, "resnet-mini") == before + 1
    again = [client.infer("resnet-mini", [inp]) for _ in range(3)]
    assert default_engine_calls(mesh, "resnet-mini") == before + 1
    expected = first.get_response().SerializeToString()
    assert all(r.get_response().SerializeToString() == expected for r in again)
    assert first.as_numpy("logits").shape == (1, 10)


def test_tritonclient_http_hits_binary_and_json(mesh: Mesh) -> None:
    client = thttp.InferenceServerClient(mesh.endpoints()["app"])
    assert client.is_server_ready()
    x = np.random.default_rng(1003).integers(1, 999, size=(1, 7), dtype=np.int64)
    for binary in (True, False):
        inp = thttp.InferInput("token_ids", list(x.shape), "INT64")
        inp.set_data_from_numpy(x, binary_data=binary)
        out = thttp.InferRequestedOutput("embedding", binary_data=binary)
        before = default_engine_calls(mesh, "text-embedder")
        first = client.infer("text-embedder", [inp], outputs=[out]).as_numpy("embedding")
        assert default_engine_calls(mesh, "text-embedder") == before + 1
        for _ in range(2):
            again = client.infer("text-embedder", [inp], outputs=[out]).as_numpy("embedding")
            assert again.tobytes() == first.tobytes()
        assert default_engine_calls(mesh, "text-embedder") == before + 1


def test_rest_hit_body_and_cache_status(mesh: Mesh) -> None:
    app = mesh.endpoints()["app"]
    x = np.random.default_rng(1004).random(3 * 32 * 32, dtype=np.float32)
    body = {"inputs": [{"name": "image", "shape": [1, 3, 32, 32], "datatype": "FP32", "data": x.tolist()}]}
    miss = rest_infer(app, "resnet-mini", body)
    assert miss.status_code == 200 and miss.headers["cache-status"] == "meshcache; fwd=miss; stored"
    before = default_engine_calls(mesh, "resnet-mini")
    hit = rest_infer(app, "resnet-mini", body)
    assert hit.headers["cache-status"].startswith("meshcache; hit; ttl=")
    assert hit.content == miss.content
    assert hit.headers["content-type"] == miss.headers["content-type"]
    assert default_engine_calls(mesh, "resnet-mini") == before


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_perf_analyzer_through_the_app_port_gets_hits(mesh: Mesh, protocol: str) -> None:
    """Triton's perf_analyzer repeats one input, so after the first answer the cache serves it. Its
    model version is given (-x): with every request a hit the engine's statistics do not move, and
    perf_analyzer finds no version that served them otherwise."""
    before = default_engine_calls(mesh, "resnet-mini")
    [result] = perf_analyzer.run("resnet-mini", mesh.endpoints()["app"], protocol, [2], measurement_ms=800,
                                 extra=["-x", "1"])
    misses = default_engine_calls(mesh, "resnet-mini") - before
    assert result.throughput > 0
    served = result.throughput * 0.8 * 3  # at least three measurement windows
    assert 1 <= misses <= 2 and served > 50 * misses
