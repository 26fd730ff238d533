"""KServe request ids with the real engine behind a real Envoy: a hit is byte for byte what the
engine answers for the caller's id (REST JSON, REST with binary tensors, gRPC), Triton's own
clients get their ids back, and the engine is not called on hits."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http

from meshcache.contract.protos import grpc_predict_v2_pb2 as pb
from meshcache.ctl.launchers import Engine
from meshcache.ctl.procs import local_http
from tests.engine.helpers import init_demo_models, running_engine
from tests.filter.stack import config, filter_stack, policy
from tests.helpers.kserve import MLP, MODEL_INFER, engine_calls, infer_path
from tests.helpers.wait import eventually

INFER = infer_path(MLP)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    repo = init_demo_models(tmp_path_factory.mktemp("models"))
    with running_engine(repo, tmp_path_factory.mktemp("engine-logs")) as e:
        yield e


def _x(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).random((1, 16), dtype=np.float32)


def _json_body(seed: int, request_id: str | None) -> bytes:
    tensor = {"name": "input", "datatype": "FP32", "shape": [1, 16], "data": _x(seed).ravel().tolist()}
    body: dict = {"inputs": [tensor]}
    if request_id is not None:
        body["id"] = request_id
    return json.dumps(body).encode()


def _binary_body(seed: int, request_id: str) -> tuple[bytes, dict[str, str]]:
    """The binary tensor extension, with the output asked for in binary too."""
    raw = _x(seed).tobytes()
    header = json.dumps({
        "id": request_id,
        "inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 16],
                    "parameters": {"binary_data_size": len(raw)}}],
        "outputs": [{"name": "probabilities", "parameters": {"binary_data": True}}],
    }).encode()
    return header + raw, {"inference-header-content-length": str(len(header))}


def test_rest_hits_are_what_the_engine_answers_for_that_id(tmp_path: Path, engine: Engine, host: str) -> None:
    with filter_stack(tmp_path, config(policy("mlp")), upstream=(engine.http_port, engine.grpc_port), host=host) as s, \
            httpx.Client(timeout=10) as c:
        calls = engine_calls(MLP, engine.metrics_url)
        first = c.post(s.url(INFER), content=_json_body(1, "rest-1"))
        assert first.headers["cache-status"] == "meshcache; fwd=miss; stored"
        second = c.post(s.url(INFER), content=_json_body(1, "rest-2"))
        assert second.headers["cache-status"].startswith("meshcache; hit; ttl=")
        # One engine call, the miss's (the engine counts it as it answers: waited for).
        eventually(lambda: engine_calls(MLP, engine.metrics_url) == calls + 1)
        direct = local_http().post(f"{engine.http_url}{INFER}", content=_json_body(1, "rest-2"), timeout=10)
        assert second.content == direct.content
        assert second.json()["id"] == "rest-2"
        assert second.headers["x-response-hash"] == first.headers["x-response-hash"]
        # No id in, no id out (its own entry).
        plain = [c.post(s.url(INFER), content=_json_body(1, None)) for _ in range(2)]
        assert plain[1].headers["cache-status"].startswith("meshcache; hit")
        assert plain[1].content == local_http().post(f"{engine.http_url}{INFER}", content=_json_body(1, None)).content
        assert "id" not in plain[1].json()

        # Binary tensors in and out: the JSON part's length header follows the id's length.
        body, headers = _binary_body(2, "b-1")
        miss = c.post(s.url(INFER), content=body, headers=headers)
        assert miss.headers["cache-status"] == "meshcache; fwd=miss; stored"
        body, headers = _binary_body(2, "a-longer-binary-request-id")
        hit = c.post(s.url(INFER), content=body, headers=headers)
        assert hit.headers["cache-status"].startswith("meshcache; hit")
        direct = local_http().post(f"{engine.http_url}{INFER}", content=body, headers=headers, timeout=10)
        assert hit.content == direct.content
        for name in ("content-type", "inference-header-content-length"):
            assert hit.headers[name] == direct.headers[name]
        eventually(lambda: engine_calls(MLP, engine.metrics_url) == calls + 6)  # 3 misses, 3 direct calls


def test_binary_lengths_the_engine_reads_otherwise_bypass(tmp_path: Path, engine: Engine, host: str) -> None:
    """`inference-header-content-length` is read only as one plain decimal, exactly what the
    engine accepts: a sign, junk or repeated lines bypass (the engine answers those 400), so no
    stored answer is ever served for a request the engine would refuse."""
    with filter_stack(tmp_path, config(policy("mlp")), upstream=(engine.http_port, engine.grpc_port), host=host) as s, \
            httpx.Client(timeout=10) as c:
        body, headers = _binary_body(5, "len-1")
        n = headers["inference-header-content-length"]
        assert c.post(s.url(INFER), content=body, headers=headers).headers["cache-status"] == \
            "meshcache; fwd=miss; stored"
        name = "inference-header-content-length"
        for lines in ([(name, "+" + n)], [(name, n), (name, n)], [(name, n), (name, "0" + n)], [(name, n + "x")],
                      [(name, n + ".0")]):
            r = c.post(s.url(INFER), content=body, headers=lines)
            assert r.headers["cache-status"] == "meshcache; fwd=bypass; detail=binary-length", lines
            direct = local_http().post(f"{engine.http_url}{INFER}", content=body, headers=lines, timeout=10)
            assert r.status_code == direct.status_code == 400, (lines, r.text)
        # Leading zeros: one number to every reader, and the same entry.
        r = c.post(s.url(INFER), content=body, headers={name: "00" + n})
        assert r.status_code == 200 and r.headers["cache-status"].startswith("meshcache; hit")


def test_grpc_hits_are_what_the_engine_answers_for_that_id(tmp_path: Path, engine: Engine, host: str) -> None:
    def request(request_id: str) -> bytes:
        r = pb.ModelInferRequest(model_name=MLP, id=request_id)
        r.inputs.add(name="input", datatype="FP32", shape=[1, 16])
        r.raw_input_contents.append(_x(3).tobytes())
        return r.SerializeToString()

    with filter_stack(tmp_path, config(policy("mlp")), upstream=(engine.http_port, engine.grpc_port), host=host) as s:
        calls = engine_calls(MLP, engine.metrics_url)
        first, call1 = s.grpc_infer(request("g-1"))
        assert dict(call1.initial_metadata())["cache-status"] == "meshcache; fwd=miss; stored"
        second, call2 = s.grpc_infer(request("g-2-longer"))
        md2 = dict(call2.initial_metadata())
        assert md2["cache-status"].startswith("meshcache; hit")
        eventually(lambda: engine_calls(MLP, engine.metrics_url) == calls + 1)
        with grpc.insecure_channel(engine.grpc_target) as ch:
            direct = ch.unary_unary(MODEL_INFER)(request("g-2-longer"), timeout=10)
        assert second == direct
        assert pb.ModelInferResponse.FromString(second).id == "g-2-longer"
        assert md2["x-response-hash"] == dict(call1.initial_metadata())["x-response-hash"]


def test_triton_clients_get_their_own_ids(tmp_path: Path, engine: Engine, host: str) -> None:
    x = _x(4)
    with filter_stack(tmp_path, config(policy("mlp")), upstream=(engine.http_port, engine.grpc_port), host=host) as s:
        calls = engine_calls(MLP, engine.metrics_url)
        http_client = triton_http.InferenceServerClient(f"127.0.0.1:{s.listen_port}")
        grpc_client = triton_grpc.InferenceServerClient(f"127.0.0.1:{s.listen_port}")
        try:
            for i in range(3):
                # tritonclient's HTTP defaults: binary tensors in and out.
                inp = triton_http.InferInput("input", [1, 16], "FP32")
                inp.set_data_from_numpy(x)
                out = triton_http.InferRequestedOutput("probabilities")
                result = http_client.infer(MLP, [inp], outputs=[out], request_id=f"http-{i}")
                assert result.get_response()["id"] == f"http-{i}"
                g_inp = triton_grpc.InferInput("input", [1, 16], "FP32")
                g_inp.set_data_from_numpy(x)
                g_result = grpc_client.infer(MLP, [g_inp], request_id=f"grpc-{i}")
                assert g_result.get_response().id == f"grpc-{i}"
                np.testing.assert_array_equal(result.as_numpy("probabilities"), g_result.as_numpy("probabilities"))
        finally:
            http_client.close()
            grpc_client.close()
        eventually(lambda: engine_calls(MLP, engine.metrics_url) == calls + 2)  # one miss per protocol, then hits
        s.stats_reaching({"meshcache.hits": 4})
