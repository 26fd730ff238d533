"""A third-party KServe v2 client (tritonclient) against both transports."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp
from tritonclient.utils import InferenceServerException

from tests.engine.helpers import DEMO_INPUTS, DEMO_OUTPUTS, Engine, demo_batch


def _datatype(x: np.ndarray) -> str:
    return "INT64" if x.dtype == np.int64 else "FP32"


@pytest.mark.parametrize("model", list(DEMO_INPUTS))
def test_http_client(engine: Engine, reference_sessions: dict[str, ort.InferenceSession], model: str) -> None:
    client = thttp.InferenceServerClient(f"127.0.0.1:{engine.http_port}")
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready(model)
    assert client.get_model_metadata(model)["name"] == model
    name = DEMO_INPUTS[model][0]
    x = demo_batch(model, 2, seed=21)
    expected = reference_sessions[model].run(None, {name: x})[0]
    for binary in (True, False):
        inp = thttp.InferInput(name, list(x.shape), _datatype(x))
        inp.set_data_from_numpy(x, binary_data=binary)
        out = thttp.InferRequestedOutput(DEMO_OUTPUTS[model], binary_data=binary)
        result = client.infer(model, [inp], outputs=[out])
        assert result.as_numpy(DEMO_OUTPUTS[model]).tobytes() == expected.tobytes()
    # No outputs named: tritonclient asks for all of them in binary form.
    inp = thttp.InferInput(name, list(x.shape), _datatype(x))
    inp.set_data_from_numpy(x)
    assert client.infer(model, [inp]).as_numpy(DEMO_OUTPUTS[model]).tobytes() == expected.tobytes()


@pytest.mark.parametrize("model", list(DEMO_INPUTS))
def test_grpc_client(engine: Engine, reference_sessions: dict[str, ort.InferenceSession], model: str) -> None:
    client = tgrpc.InferenceServerClient(engine.grpc_target)
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready(model)
    meta = client.get_model_metadata(model)
    assert meta.name == model and meta.inputs[0].name == DEMO_INPUTS[model][0]
    assert client.get_server_metadata().name == "meshcache-engine"
    name = DEMO_INPUTS[model][0]
    x = demo_batch(model, 3, seed=22)
    inp = tgrpc.InferInput(name, list(x.shape), _datatype(x))
    inp.set_data_from_numpy(x)
    result = client.infer(model, [inp], priority=3, request_id="t1")
    expected = reference_sessions[model].run(None, {name: x})[0]
    assert result.as_numpy(DEMO_OUTPUTS[model]).tobytes() == expected.tobytes()
    assert result.get_response().id == "t1"


def test_client_errors(engine: Engine) -> None:
    grpc_client = tgrpc.InferenceServerClient(engine.grpc_target)
    http_client = thttp.InferenceServerClient(f"127.0.0.1:{engine.http_port}")
    x = np.zeros((1, 15), np.float32)
    for client, mod in ((grpc_client, tgrpc), (http_client, thttp)):
        inp = mod.InferInput("input", [1, 15], "FP32")
        inp.set_data_from_numpy(x)
        with pytest.raises(InferenceServerException, match="expected FP32 with shape"):
            client.infer("mlp-classifier", [inp])
        with pytest.raises(InferenceServerException, match="unknown model"):
            client.infer("missing-model", [inp])
