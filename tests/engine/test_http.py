"""The REST transport with httpx: v2 endpoints, the binary extension, /v1/infer, and errors."""

from __future__ import annotations

import json

import httpx
import numpy as np
import onnxruntime as ort
import pytest

from meshcache.ctl.procs import local_http
from tests.engine.helpers import DEMO_INPUTS, DEMO_OUTPUTS, Engine, demo_batch


def v2_body(name: str, x: np.ndarray, datatype: str = "FP32") -> dict[str, object]:
    return {
        "inputs": [
            {"name": name, "datatype": datatype, "shape": list(x.shape), "data": x.reshape(-1).tolist()}
        ]
    }


def test_health_and_metadata(engine: Engine) -> None:
    base = engine.http_url
    assert local_http().get(f"{base}/v2/health/live").status_code == 200
    assert local_http().get(f"{base}/v2/health/ready").status_code == 200
    server = local_http().get(f"{base}/v2").json()
    assert server["name"] == "meshcache-engine" and "binary_tensor_data" in server["extensions"]
    meta = local_http().get(f"{base}/v2/models/resnet-mini").json()
    assert meta["inputs"] == [{"name": "image", "datatype": "FP32", "shape": [-1, 3, 32, 32]}]
    assert meta["outputs"] == [{"name": "logits", "datatype": "FP32", "shape": [-1, 10]}]
    versioned = local_http().get(f"{base}/v2/models/mlp-classifier/versions/1").json()
    assert versioned["versions"] == ["1"]
    assert local_http().get(f"{base}/v2/models/mlp-classifier").json()["versions"] == ["1", "2"]
    assert local_http().get(f"{base}/v2/models/text-embedder/ready").status_code == 200
    assert local_http().get(f"{base}/v2/models/mlp-classifier/versions/2/ready").status_code == 200


@pytest.mark.parametrize("model", list(DEMO_INPUTS))
def test_v2_infer_json_each_model(
    engine: Engine, reference_sessions: dict[str, ort.InferenceSession], model: str
) -> None:
    name, _, dtype = DEMO_INPUTS[model]
    x = demo_batch(model, 2, seed=3)
    datatype = "INT64" if dtype is np.int64 else "FP32"
    r = local_http().post(
        f"{engine.http_url}/v2/models/{model}/infer", json={"id": "r1", **v2_body(name, x, datatype)}
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model_name"] == model and body["id"] == "r1"
    [out] = body["outputs"]
    expected = reference_sessions[model].run(None, {name: x})[0]
    assert out["name"] == DEMO_OUTPUTS[model] and out["shape"] == list(expected.shape)
    # JSON carries float32 values exactly (widened to doubles), so they round-trip bit for bit.
    assert np.array(out["data"], dtype=np.float32).tobytes() == expected.reshape(-1).tobytes()


def test_v2_infer_versioned_path_and_nested_data(engine: Engine) -> None:
    x = demo_batch("mlp-classifier", 2)
    nested = {"inputs": [{"name": "input", "datatype": "FP32", "shape": [2, 16], "data": x.tolist()}]}
    r1 = local_http().post(f"{engine.http_url}/v2/models/mlp-classifier/versions/1/infer", json=nested)
    r2 = local_http().post(f"{engine.http_url}/v2/models/mlp-classifier/versions/2/infer", json=nested)
    assert r1.json()["model_version"] == "1" and r2.json()["model_version"] == "2"
    assert r1.json()["outputs"] != r2.json()["outputs"]


def test_binary_tensor_extension(engine: Engine, reference_sessions: dict[str, ort.InferenceSession]) -> None:
    x = demo_batch("resnet-mini", 1)
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "image",
                    "datatype": "FP32",
                    "shape": [1, 3, 32, 32],
                    "parameters": {"binary_data_size": x.nbytes},
                }
            ],
            "outputs": [{"name": "logits", "parameters": {"binary_data": True}}],
        }
    ).encode()
    r = local_http().post(
        f"{engine.http_url}/v2/models/resnet-mini/infer",
        content=header + x.tobytes(),
        headers={"Inference-Header-Content-Length": str(len(header))},
    )
    assert r.status_code == 200, r.text
    n = int(r.headers["inference-header-content-length"])
    meta = json.loads(r.content[:n])
    assert meta["outputs"][0]["parameters"]["binary_data_size"] == 40
    expected = reference_sessions["resnet-mini"].run(None, {"image": x})[0]
    assert r.content[n:] == expected.tobytes()
    # The length is one line of ASCII digits: a sign, other digits ("²" once gave a 500) or a
    # repeated line (servers differ on which one counts) are refused with a clear 400.
    name, good = "inference-header-content-length", str(len(header))
    for lines in ([(name, "+" + good)], [(name, "\u00b2".encode("latin-1"))], [(name, good), (name, good)],
                  [(name, good + "x")]):
        bad = local_http().post(f"{engine.http_url}/v2/models/resnet-mini/infer", content=header + x.tobytes(),
                                headers=lines)
        assert bad.status_code == 400, (lines, bad.text)
        assert name in bad.json()["error"]


def test_v1_simple_infer(engine: Engine, reference_sessions: dict[str, ort.InferenceSession]) -> None:
    x = demo_batch("mlp-classifier", 1, seed=9)
    r = local_http().post(
        f"{engine.http_url}/v1/infer",
        headers={"x-model-id": "mlp-classifier"},
        json={"input": x.reshape(-1).tolist(), "shape": [1, 16]},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    expected = reference_sessions["mlp-classifier"].run(None, {"input": x})[0]
    assert body["shape"] == [1, 4]
    assert np.array(body["output"], dtype=np.float32).tobytes() == expected.tobytes()
    ids = demo_batch("text-embedder", 1)
    r = local_http().post(
        f"{engine.http_url}/v1/infer",
        headers={"x-model-id": "text-embedder"},
        json={"input": ids.tolist(), "shape": list(ids.shape)},
    )
    assert r.status_code == 200 and r.json()["shape"] == [1, 32]


def test_identical_bytes_and_headers_apart_from_date(engine: Engine) -> None:
    x = demo_batch("resnet-mini", 1, seed=4)
    responses = [
        local_http().post(f"{engine.http_url}/v2/models/resnet-mini/infer", json=v2_body("image", x))
        for _ in range(4)
    ] + [
        local_http().post(
            f"{engine.http_url}/v2/models/resnet-mini/infer",
            json=v2_body("image", x),
            headers={"x-priority": "5"},
        )
    ]
    assert len({r.content for r in responses}) == 1
    header_sets = {tuple(sorted((k, v) for k, v in r.headers.items() if k != "date")) for r in responses}
    assert len(header_sets) == 1
    assert {k for k, _ in next(iter(header_sets))} == {"content-type", "content-length"}
    v1 = [
        local_http().post(
            f"{engine.http_url}/v1/infer",
            headers={"x-model-id": "resnet-mini"},
            json={"input": x.reshape(-1).tolist(), "shape": [1, 3, 32, 32]},
        )
        for _ in range(3)
    ]
    assert len({r.content for r in v1}) == 1


def _error(response: httpx.Response, status: int) -> str:
    assert response.status_code == status, response.text
    return response.json()["error"]


def test_not_found(engine: Engine) -> None:
    base = engine.http_url
    body = v2_body("input", demo_batch("mlp-classifier", 1))
    assert "no-such" in _error(local_http().post(f"{base}/v2/models/no-such/infer", json=body), 404)
    assert "'9'" in _error(local_http().post(f"{base}/v2/models/mlp-classifier/versions/9/infer", json=body), 404)
    _error(local_http().get(f"{base}/v2/models/no-such"), 404)
    _error(local_http().get(f"{base}/v2/models/no-such/ready"), 404)
    _error(local_http().get(f"{base}/v2/models/mlp-classifier/versions/9"), 404)
    _error(
        local_http().post(f"{base}/v1/infer", headers={"x-model-id": "no-such"}, json={"input": [1], "shape": [1]}),
        404,
    )
    _error(local_http().get(f"{base}/nothing/here"), 404)


def test_bad_requests_name_the_input_and_expectation(engine: Engine) -> None:
    url = f"{engine.http_url}/v2/models/mlp-classifier/infer"
    x = demo_batch("mlp-classifier", 1)
    msg = _error(local_http().post(url, json=v2_body("input", x.reshape(2, 8))), 400)
    assert "'input'" in msg and "[-1, 16]" in msg
    msg = _error(local_http().post(url, json=v2_body("input", x.astype(np.int64), "INT64")), 400)
    assert "'input'" in msg and "INT64" in msg and "FP32" in msg
    msg = _error(local_http().post(url, json=v2_body("inputs", x)), 400)
    assert "'inputs'" in msg
    body = v2_body("input", x)
    body["inputs"][0]["data"] = body["inputs"][0]["data"][:5]  # type: ignore[index]
    msg = _error(local_http().post(url, json=body), 400)
    assert "'input'" in msg and "5 elements" in msg and "16" in msg
    body["inputs"][0]["data"] = ["a"] * 16  # type: ignore[index]
    assert "numbers" in _error(local_http().post(url, json=body), 400)
    assert "malformed JSON" in _error(
        local_http().post(url, content=b'{"inputs": [', headers={"content-type": "application/json"}), 400
    )
    assert "inputs" in _error(local_http().post(url, json={"nothing": 1}), 400)
    assert "priority" in _error(
        local_http().post(url, json=v2_body("input", x), headers={"x-priority": "urgent"}), 400
    )
    v1 = f"{engine.http_url}/v1/infer"
    assert "x-model-id" in _error(local_http().post(v1, json={"input": [1.0], "shape": [1]}), 400)
    msg = _error(
        local_http().post(v1, headers={"x-model-id": "mlp-classifier"}, json={"input": [1.0] * 16, "shape": [16]}),
        400,
    )
    assert "'input'" in msg and "[-1, 16]" in msg
    assert "input" in _error(local_http().post(v1, headers={"x-model-id": "mlp-classifier"}, json={"data": []}), 400)
    tokens = {"inputs": [{"name": "token_ids", "datatype": "INT64", "shape": [1, 2], "data": [1.5, 2]}]}
    assert "integers" in _error(
        local_http().post(f"{engine.http_url}/v2/models/text-embedder/infer", json=tokens), 400
    )
    # And nothing broke.
    assert local_http().post(url, json=v2_body("input", x)).status_code == 200


def test_body_size_limit(engine: Engine) -> None:
    big = b"[" + b"0," * (9 * 2**20) + b"0]"
    r = local_http().post(f"{engine.http_url}/v2/models/mlp-classifier/infer", content=big)
    assert r.status_code == 413 and "limit" in r.json()["error"]


def test_wrong_method(engine: Engine) -> None:
    assert local_http().get(f"{engine.http_url}/v2/models/mlp-classifier/infer").status_code == 405
    assert local_http().post(f"{engine.http_url}/v2/health/live").status_code == 405
