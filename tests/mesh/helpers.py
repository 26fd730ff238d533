"""Helpers for the mesh tests: requests through the client sidecar and engine call counts."""

from __future__ import annotations

import grpc
import httpx
import numpy as np

from meshcache.contract.protos import grpc_predict_v2_pb2 as pb
from meshcache.ctl import procs
from meshcache.ctl.mesh.engine_metrics import engine_requests
from meshcache.ctl.mesh.topology import Mesh

MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"


def default_engine_calls(mesh: Mesh, model: str) -> float:
    return engine_requests(mesh.endpoints()["engine_metrics"], model)


def canary_engine_calls(mesh: Mesh, model: str) -> float:
    return engine_requests(mesh.endpoints()["canary_engine_metrics"], model)


def mlp_request(seed: int, version: str = "") -> pb.ModelInferRequest:
    """A unique mlp-classifier request per seed (tests never share cache entries by accident)."""
    x = np.random.default_rng(seed).random((1, 16), dtype=np.float32)
    request = pb.ModelInferRequest(model_name="mlp-classifier", model_version=version)
    request.inputs.add(name="input", datatype="FP32", shape=[1, 16])
    request.raw_input_contents.append(x.tobytes())
    return request


def grpc_call(target: str, request: bytes, metadata: tuple[tuple[str, str], ...] = (),
              timeout: float = 10) -> tuple[bytes, str]:
    """Raw bytes in and out (an unmodified grpcio client); returns (response, Cache-Status)."""
    with grpc.insecure_channel(target) as channel:
        call = channel.unary_unary(MODEL_INFER)
        response, c = call.with_call(request, metadata=metadata, timeout=timeout)
        return response, dict(c.initial_metadata()).get("cache-status", "")


def rest_infer(app: str, model: str, body: dict, headers: dict[str, str] | None = None) -> httpx.Response:
    return procs.local_http().post(f"http://{app}/v2/models/{model}/infer", json=body, headers=headers or {},
                                   timeout=10)


def mlp_json(seed: int) -> dict:
    x = np.random.default_rng(seed).random(16, dtype=np.float32)
    return {"inputs": [{"name": "input", "shape": [1, 16], "datatype": "FP32", "data": x.tolist()}]}
