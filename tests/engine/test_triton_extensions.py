"""Triton's extensions over both transports, through tritonclient (the client Triton users have)
and raw gRPC/HTTP: model configuration, statistics, the model repository (index, load, reload,
unload without a restart) and ModelStreamInfer."""

from __future__ import annotations

import json
import queue
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp
from tritonclient.utils import InferenceServerException

from meshcache.contract.protos import grpc_predict_v2_pb2 as pb
from meshcache.ctl.procs import local_http
from tests.engine.helpers import Engine, demo_batch, grpc_infer_request, grpc_outputs, running_engine


@pytest.fixture
def own_engine(demo_repo: Path, tmp_path: Path) -> Iterator[tuple[Engine, Path]]:
    """A fresh engine on a private copy of the demo repository (statistics start at zero and the
    repository can be changed)."""
    repo = tmp_path / "models"
    shutil.copytree(demo_repo, repo)
    with running_engine(repo, tmp_path / "logs") as engine:
        yield engine, repo


def _clients(engine: Engine) -> tuple[tgrpc.InferenceServerClient, thttp.InferenceServerClient]:
    return tgrpc.InferenceServerClient(engine.grpc_target), thttp.InferenceServerClient(f"127.0.0.1:{engine.http_port}")


def test_model_config_over_both_transports(engine: Engine) -> None:
    grpc_client, http_client = _clients(engine)
    over_grpc = grpc_client.get_model_config("resnet-mini", as_json=True)["config"]
    over_http = http_client.get_model_config("resnet-mini")
    for config in (over_grpc, over_http):
        assert config["name"] == "resnet-mini" and config["platform"] == "onnxruntime_onnx"
        assert config["backend"] == "onnxruntime"
        assert config["input"][0]["name"] == "image" and config["input"][0]["data_type"] == "TYPE_FP32"
        assert config["output"][0]["name"] == "logits"
        assert config["dynamic_batching"]["preferred_batch_size"] == [4, 8, 16]
    # Triton writes int64 fields as JSON numbers over HTTP (protobuf's JSON mapping, over gRPC, as strings).
    assert over_http["max_batch_size"] == 16 and over_http["input"][0]["dims"] == [3, 32, 32]
    assert over_http["dynamic_batching"]["max_queue_delay_microseconds"] == 1000
    assert [int(d) for d in over_grpc["input"][0]["dims"]] == [3, 32, 32]
    versioned = local_http().get(f"{engine.http_url}/v2/models/mlp-classifier/versions/1/config").json()
    assert versioned["version_policy"] == {"all": {}}
    for call in (lambda: grpc_client.get_model_config("no-such-model"),
                 lambda: http_client.get_model_config("no-such-model"),
                 lambda: http_client.get_model_config("mlp-classifier", model_version="7")):
        with pytest.raises(InferenceServerException, match="no-such-model|no version '7'"):
            call()
    with pytest.raises(grpc.RpcError) as err:
        engine.stub().ModelConfig(pb.ModelConfigRequest(name="no-such-model"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert local_http().get(f"{engine.http_url}/v2/models/no-such-model/config").status_code == 404


def _stats_numbers(stats: dict[str, Any]) -> tuple[int, ...]:
    s = stats["inference_stats"]
    rows_in_batches = sum(int(b["batch_size"]) * int(b["compute_infer"]["count"]) for b in stats["batch_stats"])
    return (int(stats["inference_count"]), int(s["success"]["count"]), int(s["fail"]["count"]),
            int(s["queue"]["count"]), int(s["compute_infer"]["count"]), rows_in_batches,
            int(stats["execution_count"]))


def test_statistics_count_and_time_as_triton_does(own_engine: tuple[Engine, Path]) -> None:
    engine, _ = own_engine
    grpc_client, http_client = _clients(engine)
    stub = engine.stub()
    for rows in (1, 2, 3):
        stub.ModelInfer(grpc_infer_request("mlp-classifier", {"input": demo_batch("mlp-classifier", rows)},
                                           version="1"))
    with pytest.raises(grpc.RpcError):  # reaches the model, then fails validation: counted as a failure
        stub.ModelInfer(grpc_infer_request("mlp-classifier", {"input": np.zeros((1, 15), np.float32)}, version="1"))
    over_grpc = grpc_client.get_inference_statistics("mlp-classifier", "1", as_json=True)["model_stats"]
    over_http = http_client.get_inference_statistics("mlp-classifier", "1")["model_stats"]
    for [stats] in (over_grpc, over_http):
        assert stats["name"] == "mlp-classifier" and stats["version"] == "1"
        inference, success, fail, queued, infer_runs, rows_in_batches, executions = _stats_numbers(stats)
        # 6 rows in 3 successful requests; each request queued and ran once; the batches held 6 rows.
        assert (inference, success, fail, queued, infer_runs, rows_in_batches) == (6, 3, 1, 3, 3, 6)
        assert 1 <= executions <= 3
        s = stats["inference_stats"]
        assert int(s["success"]["ns"]) >= int(s["compute_infer"]["ns"]) > 0
        assert int(stats["last_inference"]) > 1.7e12  # milliseconds since the epoch
    # Every model and version, and one model's versions.
    everything = http_client.get_inference_statistics()["model_stats"]
    assert {(s["name"], s["version"]) for s in everything} == {
        ("mlp-classifier", "1"), ("mlp-classifier", "2"), ("resnet-mini", "1"), ("text-embedder", "1")}
    per_model = stub.ModelStatistics(pb.ModelStatisticsRequest(name="mlp-classifier"))
    assert [s.version for s in per_model.model_stats] == ["1", "2"]
    assert per_model.model_stats[1].inference_count == 0
    with pytest.raises(grpc.RpcError) as err:
        stub.ModelStatistics(pb.ModelStatisticsRequest(name="nope"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert local_http().get(f"{engine.http_url}/v2/models/nope/stats").status_code == 404


def _index(engine: Engine) -> dict[tuple[str, str], str]:
    over_http = local_http().post(f"{engine.http_url}/v2/repository/index").json()
    over_grpc = engine.stub().RepositoryIndex(pb.RepositoryIndexRequest()).models
    assert {(m["name"], m["version"], m["state"]) for m in over_http} == {
        (m.name, m.version, m.state) for m in over_grpc}
    return {(m["name"], m["version"]): m["state"] for m in over_http}


def test_repository_unload_and_load_over_http(own_engine: tuple[Engine, Path]) -> None:
    engine, _ = own_engine
    _, client = _clients(engine)
    assert _index(engine) == {("mlp-classifier", "1"): "READY", ("mlp-classifier", "2"): "READY",
                              ("resnet-mini", "1"): "READY", ("text-embedder", "1"): "READY"}
    client.unload_model("text-embedder")
    assert not client.is_model_ready("text-embedder")
    assert _index(engine)[("text-embedder", "")] == "UNAVAILABLE"
    ready_only = local_http().post(f"{engine.http_url}/v2/repository/index", json={"ready": True}).json()
    assert "text-embedder" not in {m["name"] for m in ready_only}
    r = local_http().post(f"{engine.http_url}/v2/models/text-embedder/infer", json={"inputs": []})
    assert r.status_code == 404 and "text-embedder" in r.json()["error"] and "unloaded" in r.json()["error"]
    client.load_model("text-embedder")
    assert client.is_model_ready("text-embedder")
    x = demo_batch("text-embedder", 1)
    inp = thttp.InferInput("token_ids", list(x.shape), "INT64")
    inp.set_data_from_numpy(x)
    assert client.infer("text-embedder", [inp]).as_numpy("embedding").shape == (1, 32)
    # Errors name what is wrong.
    r = local_http().post(f"{engine.http_url}/v2/repository/models/text-embedder/load",
                          json={"parameters": {"file:1/model.onnx": "AAAA"}})
    assert r.status_code == 400 and "load parameter 'file:1/model.onnx' is not supported" in r.json()["error"]
    r = local_http().post(f"{engine.http_url}/v2/repository/models/no-such-model/load")
    assert r.status_code == 404 and "no-such-model" in r.json()["error"]
    r = local_http().post(f"{engine.http_url}/v2/repository/models/no-such-model/unload")
    assert r.status_code == 404
    assert local_http().get(f"{engine.http_url}/v2/repository/models/text-embedder/load").status_code == 405


def test_repository_adds_and_reloads_models_over_grpc(own_engine: tuple[Engine, Path], demo_repo: Path) -> None:
    engine, repo = own_engine
    client, _ = _clients(engine)
    # A new model directory appears: load it without a restart.
    shutil.copytree(demo_repo / "mlp-classifier", repo / "mlp-new")
    config = (repo / "mlp-new" / "config.pbtxt")
    config.write_text(config.read_text().replace('name: "mlp-classifier"', 'name: "mlp-new"'))
    with pytest.raises(InferenceServerException, match="unknown model 'mlp-new'"):
        client.get_model_metadata("mlp-new")
    client.load_model("mlp-new")
    x = demo_batch("mlp-classifier", 2)
    inp = tgrpc.InferInput("input", [2, 16], "FP32")
    inp.set_data_from_numpy(x)
    new = client.infer("mlp-new", [inp]).as_numpy("probabilities")
    old = client.infer("mlp-classifier", [inp]).as_numpy("probabilities")
    assert new.tobytes() == old.tobytes()
    # Reload with a changed config.pbtxt: the new configuration is served.
    config.write_text(config.read_text().replace("max_batch_size: 32", "max_batch_size: 2").replace(
        "preferred_batch_size: 8\n  preferred_batch_size: 16\n  preferred_batch_size: 32\n", ""))
    client.load_model("mlp-new")
    assert client.get_model_config("mlp-new").config.max_batch_size == 2
    # A broken reload is refused with the reason, and the served version stays.
    config.write_text(config.read_text() + "\nmodel_warmup { name: \"w\" }\n")
    with pytest.raises(InferenceServerException, match="model_warmup' \\(a Triton feature\\) is not supported"):
        client.load_model("mlp-new")
    assert client.get_model_config("mlp-new").config.max_batch_size == 2
    # A JSON config given with the load request (Triton's override) instead of the file.
    override = {"max_batch_size": 4, "version_policy": {"specific": {"versions": [1]}}}
    client.load_model("mlp-new", config=json.dumps(override))
    meta = client.get_model_metadata("mlp-new")
    assert list(meta.versions) == ["1"]
    with pytest.raises(InferenceServerException, match="ModelConfig has no field 'max_batch'"):
        client.load_model("mlp-new", config=json.dumps({"max_batch": 4}))
    client.unload_model("mlp-new")
    index = client.get_model_repository_index(as_json=True)["models"]
    assert {"name": "mlp-new", "state": "UNAVAILABLE", "reason": "unloaded"} in index


def test_load_and_unload_parameters_are_checked_alike_over_both_transports(engine: Engine) -> None:
    """One check in the service: the same bad parameter gets the same message over REST and gRPC
    (and nothing is loaded or unloaded)."""
    def over_http(action: str, params: dict[str, Any]) -> tuple[int, str]:
        r = local_http().post(f"{engine.http_url}/v2/repository/models/resnet-mini/{action}",
                              json={"parameters": params})
        return r.status_code, r.json()["error"]

    def over_grpc(action: str, key: str, **value: Any) -> tuple[grpc.StatusCode, str]:
        if action == "load":
            request: Any = pb.RepositoryModelLoadRequest(model_name="resnet-mini")
            call = engine.stub().RepositoryModelLoad
        else:
            request = pb.RepositoryModelUnloadRequest(model_name="resnet-mini")
            call = engine.stub().RepositoryModelUnload
        request.parameters[key].MergeFrom(pb.ModelRepositoryParameter(**value))
        with pytest.raises(grpc.RpcError) as err:
            call(request)
        return err.value.code(), err.value.details()

    bad_config = "load parameter 'config' must be a string holding a JSON ModelConfig"
    unknown = "load parameter 'file:1/model.onnx' is not supported; supported: 'config' (JSON ModelConfig)"
    bad_unload = "unload parameter 'unload_dependents' is not supported; supported: 'unload_dependents' (bool)"
    assert over_http("load", {"config": 5}) == (400, bad_config)
    assert over_grpc("load", "config", int64_param=5) == (grpc.StatusCode.INVALID_ARGUMENT, bad_config)
    assert over_http("load", {"file:1/model.onnx": "AAAA"}) == (400, unknown)
    assert over_grpc("load", "file:1/model.onnx", string_param="AAAA") == (grpc.StatusCode.INVALID_ARGUMENT, unknown)
    assert over_http("unload", {"unload_dependents": "yes"}) == (400, bad_unload)
    assert over_grpc("unload", "unload_dependents", string_param="yes") == (grpc.StatusCode.INVALID_ARGUMENT,
                                                                             bad_unload)
    assert local_http().get(f"{engine.http_url}/v2/models/resnet-mini/ready").status_code == 200


def test_model_metadata_is_the_same_over_both_transports(engine: Engine) -> None:
    for path, version in (("mlp-classifier", ""), ("mlp-classifier/versions/2", "2"), ("resnet-mini", "")):
        over_http = local_http().get(f"{engine.http_url}/v2/models/{path}").json()
        over_grpc = engine.stub().ModelMetadata(pb.ModelMetadataRequest(name=path.split("/")[0], version=version))
        assert over_http == {
            "name": over_grpc.name, "versions": list(over_grpc.versions), "platform": over_grpc.platform,
            "inputs": [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)} for t in over_grpc.inputs],
            "outputs": [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)} for t in over_grpc.outputs],
        }
    assert over_http["inputs"][0]["shape"][0] == -1  # int64 shapes stay JSON numbers, -1 = batch dimension
    assert local_http().get(f"{engine.http_url}/v2/models/mlp-classifier").json()["versions"] == ["1", "2"]
    assert local_http().get(f"{engine.http_url}/v2/models/mlp-classifier/versions/2").json()["versions"] == ["2"]


def test_model_control_mode_none_refuses_load_and_unload(demo_repo: Path, tmp_path: Path) -> None:
    with running_engine(demo_repo, tmp_path, extra=["--model-control-mode", "none"]) as engine:
        r = local_http().post(f"{engine.http_url}/v2/repository/models/resnet-mini/unload")
        with pytest.raises(grpc.RpcError) as err:
            engine.stub().RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="resnet-mini"))
        ready = local_http().get(f"{engine.http_url}/v2/models/resnet-mini/ready").status_code
    assert r.status_code == 503 and "--model-control-mode none" in r.json()["error"]
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert ready == 200


def test_stream_infer_with_tritonclient(engine: Engine, reference_sessions: dict[str, ort.InferenceSession]) -> None:
    client = tgrpc.InferenceServerClient(engine.grpc_target)
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    inputs = {}
    try:
        for i in range(6):
            x = demo_batch("resnet-mini", 1 + i % 3, seed=40 + i)
            inputs[f"r{i}"] = x
            inp = tgrpc.InferInput("image", list(x.shape), "FP32")
            inp.set_data_from_numpy(x)
            client.async_stream_infer("resnet-mini", [inp], request_id=f"r{i}")
        bad = tgrpc.InferInput("image", [1, 3, 32, 31], "FP32")
        bad.set_data_from_numpy(np.zeros((1, 3, 32, 31), np.float32))
        client.async_stream_infer("resnet-mini", [bad], request_id="bad")
        got = [answers.get(timeout=30) for _ in range(7)]
    finally:
        client.stop_stream()
    errors = [e for _, e in got if e is not None]
    assert len(errors) == 1 and "expected FP32 with shape [-1, 3, 32, 32]" in str(errors[0])
    results = {r.get_response().id: r for r, e in got if e is None}
    assert set(results) == set(inputs)
    for rid, x in inputs.items():
        expected = reference_sessions["resnet-mini"].run(None, {"image": x})[0]
        assert results[rid].as_numpy("logits").tobytes() == expected.tobytes()


def test_stream_infer_raw_messages_and_malformed_request(engine: Engine) -> None:
    """With the generated stubs: a malformed message in the stream answers with an error and the
    stream goes on."""
    channel = grpc.insecure_channel(engine.grpc_target)
    call = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer")
    good = grpc_infer_request("mlp-classifier", {"input": demo_batch("mlp-classifier", 1)})
    good.id = "ok"
    answers = [pb.ModelStreamInferResponse.FromString(b) for b in call(iter(
        [b"\x0a\xff\xff\xff\xff\x0f", good.SerializeToString()]))]
    assert len(answers) == 2
    by_error = {bool(a.error_message): a for a in answers}
    assert "malformed ModelInferRequest" in by_error[True].error_message
    assert by_error[False].infer_response.id == "ok"
    assert grpc_outputs(by_error[False].infer_response)["probabilities"].shape == (1, 4)
