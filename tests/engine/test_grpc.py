"""The gRPC transport with the generated grpcio stubs: every RPC, both tensor encodings, errors."""

from __future__ import annotations

import grpc
import numpy as np
import onnxruntime as ort
import pytest

from meshcache.contract.protos import grpc_predict_v2_pb2 as pb
from tests.engine.helpers import DEMO_INPUTS, DEMO_OUTPUTS, Engine, demo_batch, grpc_infer_request, grpc_outputs
from tests.helpers.kserve import MODEL_INFER


def test_health_and_server_metadata(engine: Engine) -> None:
    stub = engine.stub()
    assert stub.ServerLive(pb.ServerLiveRequest()).live is True
    assert stub.ServerReady(pb.ServerReadyRequest()).ready is True
    meta = stub.ServerMetadata(pb.ServerMetadataRequest())
    assert meta.name == "meshcache-engine" and meta.version
    assert "binary_tensor_data" in meta.extensions


def test_model_ready_and_metadata(engine: Engine) -> None:
    stub = engine.stub()
    assert stub.ModelReady(pb.ModelReadyRequest(name="resnet-mini")).ready is True
    assert stub.ModelReady(pb.ModelReadyRequest(name="mlp-classifier", version="1")).ready is True
    meta = stub.ModelMetadata(pb.ModelMetadataRequest(name="mlp-classifier"))
    assert list(meta.versions) == ["1", "2"] and meta.platform == "onnxruntime_onnx"
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.inputs] == [("input", "FP32", [-1, 16])]
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.outputs] == [("probabilities", "FP32", [-1, 4])]
    one = stub.ModelMetadata(pb.ModelMetadataRequest(name="mlp-classifier", version="1"))
    assert list(one.versions) == ["1"]
    text = stub.ModelMetadata(pb.ModelMetadataRequest(name="text-embedder"))
    assert [(t.name, t.datatype, list(t.shape)) for t in text.inputs] == [("token_ids", "INT64", [-1, -1])]


@pytest.mark.parametrize("model", list(DEMO_INPUTS))
@pytest.mark.parametrize("raw", [True, False], ids=["raw", "contents"])
def test_infer_each_demo_model(
    engine: Engine, reference_sessions: dict[str, ort.InferenceSession], model: str, raw: bool
) -> None:
    name = DEMO_INPUTS[model][0]
    x = demo_batch(model, 3, seed=11)
    response = engine.stub().ModelInfer(grpc_infer_request(model, {name: x}, raw=raw))
    assert response.model_name == model
    assert bool(response.raw_output_contents) == raw  # answered in the encoding it was asked in
    got = grpc_outputs(response)[DEMO_OUTPUTS[model]]
    expected = reference_sessions[model].run(None, {name: x})[0]
    assert got.shape == expected.shape
    assert got.tobytes() == expected.tobytes()


def test_versions_are_distinct_models(engine: Engine) -> None:
    x = demo_batch("mlp-classifier", 1)
    stub = engine.stub()
    v1 = stub.ModelInfer(grpc_infer_request("mlp-classifier", {"input": x}, version="1"))
    v2 = stub.ModelInfer(grpc_infer_request("mlp-classifier", {"input": x}, version="2"))
    default = stub.ModelInfer(grpc_infer_request("mlp-classifier", {"input": x}))
    assert (v1.model_version, v2.model_version, default.model_version) == ("1", "2", "2")
    assert v1.raw_output_contents != v2.raw_output_contents
    assert default.raw_output_contents == v2.raw_output_contents


def test_request_id_and_requested_outputs(engine: Engine) -> None:
    request = grpc_infer_request("resnet-mini", {"image": demo_batch("resnet-mini", 1)})
    request.id = "abc-1"
    request.outputs.add(name="logits")
    response = engine.stub().ModelInfer(request)
    assert response.id == "abc-1" and [o.name for o in response.outputs] == ["logits"]
    request.outputs[0].name = "nope"
    with pytest.raises(grpc.RpcError) as err:
        engine.stub().ModelInfer(request)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "nope" in err.value.details()


def test_not_found(engine: Engine) -> None:
    stub = engine.stub()
    x = demo_batch("mlp-classifier", 1)
    for call in (
        lambda: stub.ModelInfer(grpc_infer_request("no-such-model", {"input": x})),
        lambda: stub.ModelInfer(grpc_infer_request("mlp-classifier", {"input": x}, version="9")),
        lambda: stub.ModelReady(pb.ModelReadyRequest(name="no-such-model")),
        lambda: stub.ModelMetadata(pb.ModelMetadataRequest(name="mlp-classifier", version="9")),
    ):
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


def _invalid(engine: Engine, request: pb.ModelInferRequest) -> str:
    with pytest.raises(grpc.RpcError) as err:
        engine.stub().ModelInfer(request)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    return err.value.details()


def test_invalid_arguments_name_the_input_and_expectation(engine: Engine) -> None:
    x = demo_batch("mlp-classifier", 1)
    msg = _invalid(engine, grpc_infer_request("mlp-classifier", {"input": x.reshape(1, 4, 4)}))
    assert "'input'" in msg and "[-1, 16]" in msg
    msg = _invalid(engine, grpc_infer_request("mlp-classifier", {"input": x.astype(np.float64)}))
    assert "'input'" in msg and "FP64" in msg and "FP32" in msg
    msg = _invalid(engine, grpc_infer_request("mlp-classifier", {"wrong": x}))
    assert "'wrong'" in msg and "input" in msg
    too_many = np.zeros((33, 16), np.float32)
    msg = _invalid(engine, grpc_infer_request("mlp-classifier", {"input": too_many}))
    assert "1..32" in msg
    short = grpc_infer_request("mlp-classifier", {"input": x})
    short.raw_input_contents[0] = short.raw_input_contents[0][:10]
    msg = _invalid(engine, short)
    assert "'input'" in msg and "64" in msg
    bad_type = grpc_infer_request("mlp-classifier", {"input": x})
    bad_type.inputs[0].datatype = "FLOAT"
    assert "unsupported datatype" in _invalid(engine, bad_type)
    bad_priority = grpc_infer_request("mlp-classifier", {"input": x})
    bad_priority.parameters["priority"].string_param = "high"
    assert "priority" in _invalid(engine, bad_priority)


def test_malformed_protobuf_is_invalid_argument(engine: Engine) -> None:
    channel = grpc.insecure_channel(engine.grpc_target)
    call = channel.unary_unary(MODEL_INFER)
    with pytest.raises(grpc.RpcError) as err:
        call(b"\x0a\xff\xff\xff\xff\x0f")  # field 1, length far past the end
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "malformed ModelInferRequest" in err.value.details()
    # The server is unaffected.
    response = engine.stub().ModelInfer(
        grpc_infer_request("mlp-classifier", {"input": demo_batch("mlp-classifier", 1)})
    )
    assert response.model_name == "mlp-classifier"


def test_deterministic_responses(engine: Engine) -> None:
    request = grpc_infer_request("text-embedder", {"token_ids": demo_batch("text-embedder", 2, seed=5)})
    channel = grpc.insecure_channel(engine.grpc_target)
    call = channel.unary_unary(MODEL_INFER)
    answers = set()
    metadata = set()
    for _ in range(5):
        body, rpc = call.with_call(request.SerializeToString())
        answers.add(body)
        metadata.add((tuple(rpc.initial_metadata()), tuple(rpc.trailing_metadata())))
    assert len(answers) == 1 and len(metadata) == 1
