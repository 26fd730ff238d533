"""KServe v2 as the tests and benchmarks speak it: the ModelInfer method path, unique requests per
seed (mlp-classifier over gRPC and REST, resnet-mini over gRPC), one inference call each way, and
how many requests an engine answered."""

from __future__ import annotations

import grpc
import httpx
import numpy as np

from meshcache.contract.headers import CACHE_STATUS_HEADER
from meshcache.contract.protos import grpc_predict_v2_pb2 as pb
from meshcache.ctl import procs
from meshcache.ctl.mesh.engine_metrics import engine_requests

MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"
MLP = "mlp-classifier"
RESNET = "resnet-mini"


def infer_path(model: str) -> str:
    return f"/v2/models/{model}/infer"


def mlp_request(seed: int, version: str = "") -> pb.ModelInferRequest:
    """A unique mlp-classifier request per seed (tests never share cache entries by accident)."""
    x = np.random.default_rng(seed).random((1, 16), dtype=np.float32)
    request = pb.ModelInferRequest(model_name=MLP, model_version=version)
    request.inputs.add(name="input", datatype="FP32", shape=[1, 16])
    request.raw_input_contents.append(x.tobytes())
    return request


def resnet_request(seed: int, request_id: str = "") -> pb.ModelInferRequest:
    """A resnet-mini request of one image drawn from `seed` (the benchmarks' gRPC requests)."""
    x = np.random.default_rng(seed).standard_normal((1, 3, 32, 32)).astype(np.float32)
    request = pb.ModelInferRequest(model_name=RESNET, id=request_id)
    request.inputs.add(name="image", datatype="FP32", shape=[1, 3, 32, 32])
    request.raw_input_contents.append(x.tobytes())
    return request


def mlp_json(seed: int) -> dict:
    """The REST (JSON) request of the same seed's tensor, as `mlp_request` draws it."""
    x = np.random.default_rng(seed).random(16, dtype=np.float32)
    return {"inputs": [{"name": "input", "shape": [1, 16], "datatype": "FP32", "data": x.tolist()}]}


def grpc_call(target: str, request: bytes, metadata: tuple[tuple[str, str], ...] = (),
              timeout: float = 10, authority: str = "") -> tuple[bytes, str]:
    """Raw bytes in and out (an unmodified grpcio client); returns (response, Cache-Status).
    `authority`: the `:authority` to send (the Service name a sidecar routes on)."""
    options = [("grpc.default_authority", authority)] if authority else []
    with grpc.insecure_channel(target, options=options) as channel:
        call = channel.unary_unary(MODEL_INFER)
        response, c = call.with_call(request, metadata=metadata, timeout=timeout)
        return response, dict(c.initial_metadata()).get(CACHE_STATUS_HEADER, "")


def rest_infer(address: str, model: str, body: dict, headers: dict[str, str] | None = None,
               timeout: float = 10) -> httpx.Response:
    """POST the JSON `body` to `model`'s infer endpoint at `address` (host:port or a base URL)."""
    base = address if "://" in address else f"http://{address}"
    return procs.local_http().post(f"{base}{infer_path(model)}", json=body, headers=headers or {}, timeout=timeout)


def engine_calls(model: str, *metrics_urls: str) -> float:
    """Inference requests for `model` the engines behind `metrics_urls` received, together."""
    return sum(engine_requests(url, model) for url in metrics_urls)
